"""Two gloo ranks each calibrate half the batches; the merged report equals one process on all."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qlint

ROOT = Path(__file__).resolve().parent.parent
RULES = ["QL201", "QL202", "QL203"]


def _model():
    sys.path.insert(0, str(ROOT))
    from examples.badnet import build

    return build()


def _mapping():
    from examples.badnet import qconfig_mapping

    return qconfig_mapping()


def _data():
    sys.path.insert(0, str(ROOT))
    from tests.test_calibration import badnet_calibration

    return badnet_calibration(count=8, batch=2)


def _summary(report: qlint.Report, statistics=None) -> dict:
    return {
        "findings": [f.model_dump(mode="json") for f in report.findings],
        "layers": [r.model_dump(mode="json") for r in report.layers],
    }


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        shard = _data()[rank::world]
        report = qlint.lint(
            _model(),
            (torch.randn(1, 3, 32, 32),),
            calibration=shard,
            trial_options={"enabled": False},
            qconfig_mapping=_mapping(),
            select=RULES,
            calibration_options={"quiet": True},
        )
        Path(out, f"rank{rank}.json").write_text(json.dumps(_summary(report)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_same(a, b, path="") -> None:
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), (path, a, b)
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (path, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is unavailable")
def test_two_gloo_ranks_match_single_process(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    single = qlint.lint(
        _model(),
        (torch.randn(1, 3, 32, 32),),
        calibration=_data(),
        qconfig_mapping=_mapping(),
        trial_options={"enabled": False},  # the trial runs on each rank's own data
        select=RULES,
        calibration_options={"quiet": True},
    )
    expected = _summary(single)
    assert {f["rule"] for f in expected["findings"]} == set(RULES)  # the comparison is not vacuous
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for merged in ranks:
        _assert_same(merged, expected)
