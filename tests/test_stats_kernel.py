"""The compiled statistics kernel (qlint.stats.kernel): exact against torch on every layout.

Expected values come from torch reductions and torch.kthvalue on the raw data,
in float64 where sums are compared."""

from __future__ import annotations

import math
import platform
import shutil

import pytest
import torch

from qlint.stats import StatsObserver, kernel, summarize_batch

pytestmark = pytest.mark.skipif(not kernel.available(), reason="the compiled statistics kernel is not built here")


@pytest.fixture(params=[0, 1, 2], ids=["baseline", "avx2", "avx512"], autouse=True)
def instruction_set(request):
    """Every version of the hot loops this CPU can run (each test runs once per level)."""
    level = kernel._compiled.use_instruction_set(request.param)
    if level != request.param:
        kernel._compiled.use_instruction_set(2)
        pytest.skip(f"this CPU has no instruction set level {request.param}")
    yield level
    kernel._compiled.use_instruction_set(2)


def _per_channel(values: torch.Tensor) -> torch.Tensor:
    """(outer, channels, inner) -> (channels, outer * inner)."""
    return values.transpose(0, 1).reshape(values.shape[1], -1)


def _check(values: torch.Tensor, m, threads: int, hint=None) -> kernel.KernelSummary:
    result = kernel.summarize_channels(values, m, histogram=True, threads=threads, hint=hint)
    rows = _per_channel(values)
    assert result.trusted
    assert torch.equal(result.packed[kernel.MIN], rows.amin(1).double())
    assert torch.equal(result.packed[kernel.MAX], rows.amax(1).double())
    torch.testing.assert_close(result.packed[kernel.SUM], rows.double().sum(1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(result.packed[kernel.SUM_OF_SQUARES], rows.double().square().sum(1), rtol=1e-6,
                               atol=0)
    keys = (values.view(torch.int32) >> 23).reshape(-1).long() + 256
    assert torch.equal(result.key_counts, torch.bincount(keys, minlength=kernel.HISTOGRAM_KEYS))
    if m is None:
        assert result.packed[kernel.KTH_LARGEST:].isnan().all() and result.next_hint is None
    else:
        expected = rows.kthvalue(rows.shape[1] - m + 1, dim=1).values.double()
        assert torch.equal(result.packed[kernel.KTH_LARGEST], expected)
    return result


LAYOUTS = {
    "channel-last": lambda g: torch.randn(1024, 300, 1, generator=g),
    "channel-major": lambda g: torch.randn(1, 5, 5000, generator=g),
    "nchw": lambda g: torch.randn(3, 6, 777, generator=g),
    "nchw-after-relu": lambda g: torch.randn(4, 3, 1000, generator=g).relu(),  # ties at 0
    "integers": lambda g: torch.randint(0, 5, (2000, 9, 1), generator=g).float(),  # heavy ties
    "constant": lambda g: torch.full((700, 4, 1), -2.5),
    "sorted": lambda g: torch.arange(3000.0).reshape(1, 1, -1),
    "reverse-sorted": lambda g: torch.arange(3000.0).flip(0).reshape(1, 1, -1).contiguous(),
    "sorted-columns": lambda g: torch.arange(2048.0).repeat(5, 1).T.reshape(2048, 5, 1).contiguous(),
    "heavy-tail": lambda g: (torch.randn(600, 7, 3, generator=g).exp() ** 3),
    "short-runs": lambda g: torch.randn(9, 4, 3, generator=g),
    "one-value": lambda g: torch.randn(1, 3, 1, generator=g),
    "single-channel": lambda g: torch.randn(1, 1, 100_000, generator=g),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("fraction", [None, 0.025, 0.0, 0.5, 1.0])
@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_matches_torch(layout, fraction, threads):
    values = LAYOUTS[layout](torch.Generator().manual_seed(3))
    width = values.shape[0] * values.shape[2]
    m = None if fraction is None else min(width, max(1, round(fraction * width)))
    _check(values, m, threads)


@pytest.mark.parametrize("layout", ["channel-last", "nchw", "nchw-after-relu", "integers", "single-channel"])
@pytest.mark.parametrize("hint_kind", ["previous", "few-too-high", "nan", "+inf", "-inf", "huge", "tiny", "random"])
def test_any_hint_gives_the_exact_answer(layout, hint_kind):
    generator = torch.Generator().manual_seed(4)
    first, second = LAYOUTS[layout](generator), LAYOUTS[layout](generator) * 1.5
    width = first.shape[0] * first.shape[2]
    m = width - math.floor(0.975 * (width - 1))
    channels = first.shape[1]
    hints = {
        "previous": lambda: _check(first, m, 2).next_hint,
        # a few channels fail and are redone on their own (the others keep their hint)
        "few-too-high": lambda: _check(first, m, 2).next_hint.index_fill(0, torch.arange(0, channels, 37), 1e30),
        "nan": lambda: torch.full((channels,), float("nan"), dtype=torch.float64),
        "+inf": lambda: torch.full((channels,), float("inf")),
        "-inf": lambda: torch.full((channels,), float("-inf")),
        "huge": lambda: torch.full((channels,), 1e300, dtype=torch.float64),
        "tiny": lambda: torch.full((channels,), -1e300, dtype=torch.float64),
        "random": lambda: torch.randn(channels, generator=generator) * 3,
    }
    result = _check(second, m, 2, hint=hints[hint_kind]())
    assert torch.isfinite(result.next_hint).all()


def test_hints_follow_a_stream():
    generator = torch.Generator().manual_seed(8)
    hint = None
    for step in range(6):  # the distribution drifts; every batch stays exact
        batch = torch.randn(512, 40, 1, generator=generator) * (1 + step) + step
        hint = _check(batch, 13, 2, hint=hint).next_hint


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf"), 1e30, 1e-30])
def test_untrustworthy_batches_are_flagged(poison):
    values = torch.randn(200, 3, 1)
    if abs(poison) in (1e30, 1e-30) and math.isfinite(poison):
        values[:, 1, 0] = poison  # a whole channel of extreme magnitude
    else:
        values[17, 1, 0] = poison
    assert not kernel.summarize_channels(values, 5).trusted


def test_zero_channel_is_trusted():
    values = torch.zeros(100, 2, 1)
    values[:, 1] = 1.0
    assert kernel.summarize_channels(values, 3).trusted


def test_kernel_rejects_bad_arguments():
    with pytest.raises(ValueError):
        kernel.summarize_channels(torch.randn(4, 3, 2, dtype=torch.float64), None)
    with pytest.raises(ValueError):
        kernel.summarize_channels(torch.randn(3, 4, 2).transpose(0, 1), None)
    with pytest.raises(ValueError):
        kernel.summarize_channels(torch.randn(4, 3), None)
    with pytest.raises(ValueError):
        kernel.summarize_channels(torch.randn(4, 3, 2), 9)
    with pytest.raises(ValueError):
        kernel.summarize_channels(torch.randn(4, 3, 2), 0)
    with pytest.raises(ValueError):
        kernel.summarize_channels(torch.randn(4, 3, 2), 2, hint=torch.zeros(4))
    with pytest.raises(ValueError):
        kernel.summarize_channels(torch.randn(4, 3, 2), 2, hint=torch.zeros(3, device="meta"))
    with pytest.raises(ValueError):
        kernel.summarize_channels(torch.randn(4, 3, 2), None, hint=torch.zeros(3))


@pytest.mark.parametrize("shape,axis", [((8, 64, 56, 56), 1), ((8, 512, 7, 7), 1), ((8, 128, 96), -1),
                                        ((4, 1000), None)])
def test_kernel_and_tensor_paths_give_the_same_stats(shape, axis, monkeypatch):
    batch = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).relu() + 0.01
    with_kernel = summarize_batch(batch, axis, 0.975)
    monkeypatch.setattr(kernel, "_compiled", None)
    with_tensors = summarize_batch(batch, axis, 0.975)
    assert torch.equal(with_kernel.channel_min, with_tensors.channel_min)
    assert torch.equal(with_kernel.channel_max, with_tensors.channel_max)
    assert torch.equal(with_kernel.percentile_ratio_sum, with_tensors.percentile_ratio_sum)
    assert torch.equal(with_kernel.histogram, with_tensors.histogram)
    values = batch.double().reshape(-1) if axis is None else batch.double().movedim(axis, 0).reshape(shape[axis], -1)
    true_squares = values.square().sum(-1).reshape(-1)
    # The kernel sums float32 blocks of 16 in float64; the tensor path's norm is coarser.
    torch.testing.assert_close(with_kernel.sum_of_squares, true_squares, rtol=1e-6, atol=0)
    torch.testing.assert_close(with_tensors.sum_of_squares, true_squares, rtol=1e-4, atol=0)
    torch.testing.assert_close(with_kernel.sum, values.sum(-1).reshape(-1), rtol=1e-6, atol=1e-6)


def test_observer_keeps_a_hint_per_stream_and_stays_exact():
    observer = StatsObserver(channel_axis=-1, histogram=False)
    batches = [torch.randn(4, 256, 32, generator=torch.Generator().manual_seed(i)) * (1 + i) for i in range(5)]
    for batch in batches:
        observer(batch)
    stream = observer._stream
    assert stream is not None and stream.observed_channels == 32 and len(stream) == len(batches)
    expected = summarize_batch(batches[0], -1, 0.975, histogram=False)
    for batch in batches[1:]:
        expected = expected.merge(summarize_batch(batch, -1, 0.975, histogram=False))
    assert torch.equal(observer.stats.percentile_ratio_sum, expected.percentile_ratio_sum)


@pytest.mark.skipif(platform.system() != "Linux" or shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="only where a C compiler builds the kernel at install time")
def test_kernel_is_built_where_a_compiler_exists():
    # Guards against a silently skipped build: the extension is optional at install time.
    assert kernel.available()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["first", "last", "every-other", "all"])
def test_non_finite_values_end_in_an_untrusted_result(layout, poison, where):
    # Regression: a NaN among a channel's last few values (blocks of one value)
    # once made the selection loop forever.
    values = LAYOUTS[layout](torch.Generator().manual_seed(6)).clone()
    flat = values.view(-1)
    index = {"first": slice(0, 1), "last": slice(-1, None), "every-other": slice(0, None, 2),
             "all": slice(None)}[where]
    flat[index] = poison
    width = values.shape[0] * values.shape[2]
    for m in {1, max(1, width // 40), width}:
        for hint in (None, torch.zeros(values.shape[1], dtype=torch.float64)):
            assert not kernel.summarize_channels(values, m, hint=hint, threads=2).trusted


def test_workspaces_can_be_released_and_regrown():
    values = torch.randn(2048, 64, 1)
    before = kernel.summarize_channels(values, 20, threads=2).packed.clone()
    kernel.release_workspaces()
    kernel.release_workspaces()  # idempotent
    assert torch.equal(kernel.summarize_channels(values, 20, threads=2).packed, before)


@pytest.mark.skipif(platform.system() != "Linux" or "parallel backend: OpenMP" not in torch.__config__.parallel_info(),
                    reason="the kernel enters torch's OpenMP team only where torch uses OpenMP and /proc is readable")
def test_parts_run_in_torchs_openmp_team():
    # Guards against silently falling back to one thread: the team is looked up at run time.
    assert kernel._find_openmp_entries() is not None
    kernel.prepare_parallel()
    assert kernel._use_openmp_team()
    assert kernel.part_count(1 << 20, True, threads=2) == 2


def _summarize_in_parts(values: torch.Tensor, m, parts: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The kernel entry itself, with a fixed number of parts (kernel.part_count picks 1 without a team)."""
    outer, channels, inner = values.shape
    out = torch.empty(6, channels, dtype=torch.float64)
    keys = torch.zeros(parts, kernel.HISTOGRAM_KEYS, dtype=torch.int64)
    trusted = kernel._compiled.summarize(values.data_ptr(), outer, channels, inner, m or 0, parts, out.data_ptr(),
                                         0, keys.data_ptr())
    return out, keys.sum(0), trusted


@pytest.mark.parametrize("layout", ["channel-last", "nchw", "single-channel", "sorted-columns"])
@pytest.mark.parametrize("m_fraction", [None, 0.025])
def test_team_and_calling_thread_give_identical_results(layout, m_fraction):
    values = LAYOUTS[layout](torch.Generator().manual_seed(9))
    width = values.shape[0] * values.shape[2]
    m = None if m_fraction is None else max(1, round(m_fraction * width))
    kernel.prepare_parallel()
    in_team = _summarize_in_parts(values, m, 4)
    entries = kernel._find_openmp_entries()
    kernel._set_team(None)
    try:
        alone = _summarize_in_parts(values, m, 4)
    finally:
        kernel._set_team(entries)
    assert torch.equal(in_team[0].nan_to_num(7.0), alone[0].nan_to_num(7.0))
    assert torch.equal(in_team[1], alone[1]) and in_team[2] == alone[2]
    rows = _per_channel(values)
    assert torch.equal(in_team[0][kernel.MAX], rows.amax(1).double())  # and both are right
    if m is not None:
        assert torch.equal(in_team[0][kernel.KTH_LARGEST], rows.kthvalue(width - m + 1, dim=1).values.double())


def test_stream_buffers_check_the_batch_and_keep_hints_between_batches():
    buffers = kernel.StreamBuffers(8, histogram=False)
    with pytest.raises(ValueError, match="channels"):
        buffers.add(torch.randn(100, 9, 1), 3)
    with pytest.raises(ValueError, match="float32"):
        buffers.add(torch.randn(100, 8, 1, dtype=torch.float64), 3)
    generator = torch.Generator().manual_seed(2)
    batches = [torch.randn(400, 8, 1, generator=generator) for _ in range(3)]
    ranges = [buffers.add(batch, 10) for batch in batches]
    assert ranges == [pytest.approx(float(b.max() - b.min()), rel=0, abs=0) for b in batches]
    last = buffers.summaries[buffers.latest]
    assert torch.equal(last[kernel.KTH_LARGEST], _per_channel(batches[-1]).kthvalue(400 - 10 + 1, dim=1).values.double())
    assert torch.equal(buffers.totals[1], torch.stack([_per_channel(b).amax(1) for b in batches]).amax(0).double())
    poisoned = batches[0].clone()
    poisoned[3, 2, 0] = float("nan")
    totals = buffers.totals.clone()
    assert buffers.add(poisoned, 10) is None and torch.equal(buffers.totals, totals)  # untouched


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_runs_the_kernel_in_its_calling_thread():
    import os

    kernel.prepare_parallel()
    values = torch.randn(4096, 64, 1)
    expected = kernel.summarize_channels(values, 30, threads=2).packed
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must neither hang nor use the parent's team
        try:
            os.close(read_end)
            result = kernel.summarize_channels(values, 30, threads=2).packed
            ok = torch.equal(result, expected) and not kernel._use_openmp_team()
            os.write(write_end, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write_end)
    answer = os.read(read_end, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
