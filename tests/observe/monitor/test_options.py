"""The monitor's grouped options: each checked when built, and the flat keywords of earlier
versions refused before anything starts, naming the form that replaced them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import accelfn as af
from accelfn.observe.monitor import Monitor


@pytest.mark.parametrize(("flat", "grouped"), [
    ({"jsonl": "m.jsonl"}, "Monitor(jsonl=...) is now Monitor(sinks=[af.JsonlSink(...)])"),
    ({"csv": "m.csv"}, "Monitor(csv=...) is now Monitor(sinks=[af.CsvSink(...)])"),
    ({"tensorboard": "tb"}, "Monitor(tensorboard=...) is now Monitor(sinks=[af.TensorBoardSink("),
    ({"samples_per_step": 8}, "Monitor(throughput=af.Throughput(samples_per_step=...))"),
    ({"peak_dtype": "tf32"}, "Monitor(throughput=af.Throughput(peak_dtype=...))"),
    ({"gpu_index": 0}, "Monitor(gpu=af.GPUSampling(index=...))"),
    ({"gpu_interval": 1.0}, "Monitor(gpu=af.GPUSampling(interval=...))"),
    ({"sync_check_step": 2}, "Monitor(sync_check=af.SyncCheck(step=...))"),
    ({"sync_check_step": None}, "Monitor(sync_check_step=None) is now Monitor(sync_check=None)"),
    ({"sync_allow": ["x"]}, "Monitor(sync_check=af.SyncCheck(allow=...))"),
    ({"jsonl_path": "m.jsonl"}, "Monitor() got an unexpected keyword argument 'jsonl_path'"),
])
def test_a_flat_keyword_names_its_grouped_form_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flat: dict[str, Any],
        grouped: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError) as caught:
        Monitor(progress=False, **flat)
    assert grouped in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # no file opened


def test_the_grouped_options_are_checked_when_built() -> None:
    for bad in (0, -1, math.nan, math.inf, True):
        with pytest.raises(ValueError, match=r"Throughput\(samples_per_step="):
            af.Throughput(samples_per_step=bad)
    with pytest.raises(ValueError, match=r"Throughput\(peak_flops=0\)"):
        af.Throughput(peak_flops=0)
    with pytest.raises(ValueError, match="peak_dtype='bf61'"):
        af.Throughput(peak_dtype="bf61")
    with pytest.raises(ValueError, match=r"GPUSampling\(index=-1\)"):
        af.GPUSampling(index=-1)
    with pytest.raises(ValueError, match=r"GPUSampling\(interval=0\)"):
        af.GPUSampling(interval=0)
    with pytest.raises(ValueError, match=r"SyncCheck\(step=-1\).*sync_check=None"):
        af.SyncCheck(step=-1)
    with pytest.raises(TypeError, match=r"allow=\['nonfinite'\]"):
        af.SyncCheck(allow="nonfinite")
    assert af.SyncCheck(allow=["a"]).allow == ("a",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        af.Throughput().samples_per_step = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"Monitor\(throughput=\.\.\.\) takes an "
                                        r"af\.Throughput\(\.\.\.\), not dict"):
        Monitor(throughput={"samples_per_step": 8})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not a sink.*af\.JsonlSink\(path\)"):
        Monitor(sinks=["m.jsonl"])  # type: ignore[list-item]


def test_the_grouped_options_reach_the_rows_and_the_probe() -> None:
    mon = Monitor(progress=False, warmup=0, log_every=1,
                  throughput=af.Throughput(samples_per_step=8, tokens_per_step=64),
                  sync_check=af.SyncCheck(step=0))
    with mon:
        for batch in mon.iterate(range(2)):
            mon.step({"loss": float(batch)})
    assert [(r["samples"], r["tokens"]) for r in mon.rows] == [(8, 64), (8, 64)]
    assert mon.rows[0]["probed"] and not mon.rows[1].get("probed")
    assert mon.report().syncs == []
    flops = mon.count_flops(torch.nn.Linear(2, 2), torch.randn(3, 2))
    assert flops > 0 and mon.throughput == af.Throughput(samples_per_step=8, tokens_per_step=64,
                                                         flops_per_step=flops)
