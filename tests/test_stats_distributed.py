"""all_reduce_stats across 2 gloo ranks equals one process over all the data."""

from __future__ import annotations

import io
import math
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qlint.stats import StatsObserver, TensorStats, all_reduce_stats

WORLD_SIZE = 2
NUM_BATCHES = 6


def _all_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    batches = [torch.randn(4, 3, 16, 16, generator=generator) * (i + 1) for i in range(NUM_BATCHES)]
    batches[2][0, 1, 0, 0] = math.nan
    batches[4][1, 2, 3, 3] = -math.inf
    batches[5][:, 0] = 0.0
    return batches


def _observe(batches) -> TensorStats:
    observer = StatsObserver(channel_axis=1)
    for batch in batches:
        observer(batch)
    return observer.stats


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        shard = _all_batches()[rank::WORLD_SIZE]
        outcome = {"sharded": all_reduce_stats(_observe(shard)).to_state()}
        # A rank that saw nothing still takes part and gets the global stats.
        outcome["one_rank_empty"] = all_reduce_stats(_observe(shard if rank == 0 else [])).to_state()
        # Disagreeing channel counts must raise on every rank, not hang.
        mismatched = _observe([torch.randn(2, 3 + rank, 4)])
        try:
            all_reduce_stats(mismatched)
            outcome["mismatch_error"] = None
        except ValueError as error:
            outcome["mismatch_error"] = str(error)
        # Plain bytes cross the process boundary without shared-memory handles.
        buffer = io.BytesIO()
        torch.save(outcome, buffer)
        results.put((rank, buffer.getvalue()))
    finally:
        dist.destroy_process_group()


def _assert_same(actual: TensorStats, expected: TensorStats) -> None:
    for name, tensor in expected.to_state().items():
        got = actual.to_state()[name]
        if name in ("sum", "sum_of_squares", "percentile_ratio_sum", "batch_range_sum"):  # float64 sums
            torch.testing.assert_close(got, tensor, rtol=1e-12, atol=0, msg=name)
        else:
            assert torch.equal(got, tensor), name


def test_all_reduce_over_two_gloo_ranks_equals_single_process():
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, port, results)) for rank in range(WORLD_SIZE)]
    for process in processes:
        process.start()
    try:
        received = [results.get(timeout=90) for _ in range(WORLD_SIZE)]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in processes] == [0] * WORLD_SIZE
    outcomes = {rank: torch.load(io.BytesIO(data)) for rank, data in received}

    batches = _all_batches()
    single_process = _observe(batches)
    rank0_only = _observe(batches[0::WORLD_SIZE])
    for rank in range(WORLD_SIZE):
        _assert_same(TensorStats.from_state(outcomes[rank]["sharded"]), single_process)
        _assert_same(TensorStats.from_state(outcomes[rank]["one_rank_empty"]), rank0_only)
        assert "channel count" in outcomes[rank]["mismatch_error"]
