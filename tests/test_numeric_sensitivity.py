"""sensitivity(): agreement with the exhaustive one-layer-at-a-time ranking."""

import copy
import json
import warnings

import pytest
import torch
import torch.nn as nn
from scipy.stats import spearmanr

from qlint.numeric.compare import compare
from qlint.numeric.examples import SmallConvNet, bad_layer_qconfig_mapping, image_batches, randomize_batch_norm
from qlint.numeric.sensitivity import (
    exhaustive_sensitivity,
    sensitivity,
    sensitivity_rows,
    spearman,
    top_k_spearman,
)

warnings.filterwarnings("ignore")


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def model_and_data():
    torch.manual_seed(0)
    model = randomize_batch_norm(SmallConvNet()).eval()  # 12 weighted layers
    return model, image_batches(3, batch_size=4, size=8, seed=5)


@pytest.fixture(scope="module")
def estimated_rows(model_and_data):
    model, data = model_and_data
    return sensitivity_rows(model, data), None


def test_matches_exhaustive_ranking(model_and_data, estimated_rows):
    model, data = model_and_data
    rows, _ = estimated_rows
    estimate = [(row.name, row.score) for row in rows]
    reference = exhaustive_sensitivity(model, data)
    assert len(reference) >= 10 and {name for name, _ in estimate} == {name for name, _ in reference}
    assert top_k_spearman(reference, estimate, 10) >= 0.9
    # How much faster the estimate is than the exhaustive run: bench/sensitivity.py (tests assert no times).
    # the estimate is of the same quantity, not only the same order: within a factor of 3 per layer
    estimated = dict(estimate)
    for name, value in reference[:10]:
        assert value / 3 < estimated[name] < value * 3, name


def test_broken_layer_ranks_first(model_and_data):
    model, data = model_and_data
    broken = "res2.conv1"
    ranking = sensitivity(model, data, qconfig_mapping=bad_layer_qconfig_mapping(broken))
    assert ranking[0][0] == broken
    assert ranking[0][1] > 10 * ranking[1][1]


def test_rows_carry_flops_and_params_shares(model_and_data, estimated_rows):
    model, _ = model_and_data
    rows, _ = estimated_rows
    assert [row.score for row in rows] == sorted((row.score for row in rows), reverse=True)
    # Shares are of the whole model: the batch norms folded into the convs are in no row.
    total_params = sum(parameter.numel() for parameter in model.parameters())
    assert sum(row.params_share for row in rows) == pytest.approx(sum(row.params for row in rows) / total_params)
    assert sum(row.params for row in rows) < total_params
    assert sum(row.flops_share for row in rows) == pytest.approx(1.0)  # every conv and linear is ranked
    by_name = {row.name: row for row in rows}
    assert by_name["fc1"].params == sum(parameter.numel() for parameter in model.fc1.parameters())
    # stem: 3->16 channels, 3x3, stride 1 on 8x8: 2 * 16*8*8 outputs * 27 MACs per sample
    assert by_name["stem.conv"].flops == pytest.approx(2 * 16 * 8 * 8 * 27)
    assert all(row.local_sqnr_db is not None and row.local_sqnr_db > 20 for row in rows)


def test_spearman_agrees_with_scipy():
    generator = torch.Generator().manual_seed(3)
    for size in (3, 7, 12):
        first = torch.randn(size, generator=generator).tolist()
        second = [value + 0.5 * noise for value, noise in zip(first, torch.randn(size, generator=generator).tolist())]
        second[0] = second[1]  # a tie
        assert spearman(first, second) == pytest.approx(spearmanr(first, second).statistic, abs=1e-12)
    with pytest.raises(ValueError):
        spearman([1.0], [2.0])


def test_one_shot_iterators_are_refused(model_and_data):
    model, data = model_and_data
    with pytest.raises(TypeError):
        sensitivity(model, iter(data))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.lstm_cell = nn.LSTMCell(16, 32)
        self.gru_cell = nn.GRUCell(32, 24)
        self.head = nn.Linear(24, 4)

    def forward(self, x):
        h, _ = self.lstm_cell(self.fc(x))
        return self.head(self.gru_cell(h))


def test_recurrent_cells_count_their_gates_flops_as_torchs_flop_counter():
    """silero_vad's LSTMCell was counted as 128 FLOPs per sample (its output's size): 0.01 % of
    the model where it does 19 %."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = _Recurrent().eval()
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    rows = {row.name: row for row in sensitivity_rows(model, batches)}
    assert {"lstm_cell", "gru_cell", "fc", "head"} <= set(rows)
    for name in ("lstm_cell", "gru_cell", "fc", "head"):
        inputs: list = []
        handle = model.get_submodule(name).register_forward_pre_hook(lambda _m, args, seen=inputs: seen.append(args))
        model(batches[0])
        handle.remove()
        with FlopCounterMode(display=False) as counter:
            model.get_submodule(name)(*inputs[0])
        assert rows[name].flops == pytest.approx(counter.get_total_flops() / 8), name


class _Sequence(nn.Module):
    def __init__(self, bidirectional: bool) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(32 if bidirectional else 16, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_a_bidirectional_recurrent_layer_counts_both_directions():
    """Each direction runs the same gates over every step: twice the FLOPs of one (the count
    divided the steps by the directions and never multiplied them back)."""
    batches = [torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    flops = {}
    for bidirectional in (False, True):
        torch.manual_seed(0)
        rows = {row.name: row for row in sensitivity_rows(_Sequence(bidirectional).eval(), batches)}
        flops[bidirectional] = rows["rnn"].flops
    assert flops[False] > 0 and flops[True] == pytest.approx(2 * flops[False])


class _TwoHeads(nn.Module):
    """A trunk and two heads; the second head's output is the model's second output."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.relu(self.trunk(x))
        return self.head_a(hidden), self.head_b(hidden)


def test_the_exhaustive_reference_scores_every_output_as_the_estimate_does():
    """exhaustive_sensitivity scored the first output tensor only, so a layer feeding the second
    output ranked 0 there while sensitivity() (every output's power) ranked it."""
    torch.manual_seed(0)
    model = _TwoHeads().eval()
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(16, 8, generator=generator) for _ in range(3)]
    exhaustive = dict(exhaustive_sensitivity(model, data))
    estimated = dict(sensitivity(model, data))
    assert exhaustive["head_b"] > 0 and estimated["head_b"] > 0
    # linear heads and few outputs per sample: the estimate is exact up to rounding
    assert exhaustive == pytest.approx(estimated, rel=0.01)


def test_a_layer_convert_keeps_float_adds_no_error_in_a_prepared_counterpart():
    """A prepared counterpart and its converted model agree on a layer left float: the observer
    feeding it belongs to its producer (whose output convert_fx quantizes), not to it."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    # Layer 2, float, sits between quantized ones: the observer before it is layer 0's
    # output (via the tanh) and the one after it layer 3's input.
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Linear(8, 4)).eval()
    batches = [torch.randn(4, 16) for _ in range(3)]
    mapping = get_default_qconfig_mapping("x86").set_module_name("2", None)
    prepared = prepare_fx(copy.deepcopy(model), mapping, (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    converted = convert_fx(copy.deepcopy(prepared))
    scores, shadows = {}, {}
    for counterpart in (prepared, converted):
        rows = {row.name: row for row in sensitivity_rows(model, batches, quantized_model=counterpart)}
        scores[counterpart is prepared] = (rows["0"].score, rows["2"].score)
        table = {row.name: row for row in compare(model, counterpart, batches).layers}
        shadows[counterpart is prepared] = table["2"].sqnr_shadow
    assert scores[False][1] == 0.0  # the converted model runs layer 2 in float
    assert scores[True][1] == 0.0, scores
    assert scores[True][0] > 0.0 and scores[False][0] > 0.0  # layer 0 is quantized in both
    # The per-layer table agrees: layer 2's own error is none in both (its output is float).
    assert shadows[True] == shadows[False], shadows


class _FunctionalConvs(nn.Module):
    """EfficientNet-Lite style: convolutions as F.conv2d on parameters (compared, not ranked),
    one of them applied twice (a shared parameter), and a Linear head (ranked)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 3, 3, 3) * 0.2)
        self.w2 = nn.Parameter(torch.randn(16, 16, 3, 3) * 0.1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.relu(torch.nn.functional.conv2d(x, self.w1, None, (1, 1), (1, 1), (1, 1), 1))
        x = torch.nn.functional.relu(torch.nn.functional.conv2d(x, self.w2, None, (1, 1), (1, 1), (1, 1), 1))
        x = torch.nn.functional.relu(torch.nn.functional.conv2d(x, self.w2, None, (1, 1), (1, 1), (1, 1), 1))
        return self.fc(x.mean((2, 3)))


def test_shares_are_of_the_whole_model_functional_layers_included():
    """The shares were of the ranked (module) layers only: on EfficientNet-Lite0, whose 49 convs
    are F.conv2d, `_fc` showed 96.8 % of the params (really 27.5 %) and each BatchNorm 48 % of
    the FLOPs. They are of the whole model: every parameter once, torch's count of the forward."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = _FunctionalConvs().eval()
    batches = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    rows = {row.name: row for row in sensitivity_rows(model, batches)}
    assert set(rows) == {"fc"}  # the functional convs are not ranked
    distinct = {id(parameter): parameter.numel() for _, parameter in model.named_parameters(remove_duplicate=False)}
    total_params = sum(distinct.values())
    assert total_params == 16 * 27 + 16 * 16 * 9 + 16 * 10 + 10
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(batches[0])
    total_flops = counter.get_total_flops() / 4  # per sample, as the rows' FLOPs are
    fc = rows["fc"]
    assert fc.params == 170 and fc.flops == pytest.approx(2 * 16 * 10)
    assert fc.params_share == pytest.approx(170 / total_params)
    assert fc.flops_share == pytest.approx(fc.flops / total_flops)
    assert fc.flops_share < 0.01  # the convs do nearly all the work


_FUNCTIONAL_CONV_PAIR = """
import copy
import json
import torch
import torch.nn.functional as F
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 3, 3, 3) * 0.2)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(F.relu(F.conv2d(x, self.w, None, (1, 1), (1, 1), (1, 1), 1)).mean((2, 3)))


def batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 8, 8, generator=generator) for _ in range(2)]


def float_model():
    torch.manual_seed(0)
    return Net().eval()


def quantized_model():
    prepared = prepare_fx(copy.deepcopy(float_model()), get_default_qconfig_mapping("x86"), (batches()[0],))
    for batch in batches():
        prepared(batch)
    return convert_fx(prepared)
"""


def test_the_sensitivity_section_says_which_compared_layers_it_does_not_rank(run_main, tmp_path):
    """On EfficientNet-Lite0 (49 F.conv2d) the ranking showed batch norms and the head as the
    most sensitive layers, and nothing said the convs were left out."""
    (tmp_path / "funconv_pair.py").write_text(_FUNCTIONAL_CONV_PAIR)
    spec = ["funconv_pair:float_model", "funconv_pair:quantized_model", "--calibration", "funconv_pair:batches"]
    ranked = run_main("compare", *spec, "--sensitivity", "--format", "json")
    assert ranked.returncode in (0, 1), ranked.stderr
    notices = [notice["message"] for notice in json.loads(ranked.stdout)["notices"]]
    (unranked,) = [message for message in notices if "not ranked" in message]
    assert "1 functional layers" in unranked and "conv2d" in unranked
    plain = run_main("compare", *spec, "--format", "json")  # no ranking, nothing to say
    assert not [n for n in json.loads(plain.stdout)["notices"] if "not ranked" in n["message"]]
