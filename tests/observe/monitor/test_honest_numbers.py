"""The report's statistics against hand-computed values on rows with known times."""

from __future__ import annotations

from typing import Any

import torch

from accelfn.observe.monitor.report import Thresholds
from accelfn.observe.monitor.verdict import summarise


def _rows(times: list[float]) -> list[dict[str, Any]]:
    out, t = [], 0.0
    for i, s in enumerate(times):
        t += s
        out.append({"step": i, "time_s": t, "iter_s": s, "step_s": s, "data_wait_s": 0.0,
                    "data_share": 0.0, "samples": 4, "tokens": None, "samples_per_s": 4 / s,
                    "tokens_per_s": None, "mem_gib": None})
    return out


def _summary(times: list[float], warmup: int = 0) -> Any:
    return summarise(_rows(times), warmup=warmup, device=torch.device("cpu"),
                     device_name=None, flops_per_step=None, peak=None, peak_memory_gib=None,
                     gpu_samples=[], gpu_note="no GPU in use", syncs=[],
                     probe_mode="emulate", th=Thresholds())


def test_median_and_p90_interpolate_between_order_statistics() -> None:
    r = _summary([4.0, 1.0, 3.0, 2.0])
    assert r.step_time_median_s == 2.5  # not the upper middle value, 3
    r = _summary([float(i) for i in range(10, 0, -1)])
    assert r.step_time_median_s == 5.5
    assert abs(r.step_time_p90_s - 9.1) < 1e-9  # not the maximum, 10
    r = _summary([7.0])
    assert r.step_time_median_s == r.step_time_p90_s == 7.0
    r = _summary([1.0, 2.0, 3.0])
    assert r.step_time_median_s == 2.0 and abs(r.step_time_p90_s - 2.8) < 1e-9


def test_a_run_shorter_than_its_warmup_says_its_numbers_include_warmup() -> None:
    r = _summary([5.0, 1.0, 1.0], warmup=5)
    assert r.measured_steps == 3 and r.warmup_included
    assert "warm-up included" in str(r).splitlines()[3]
    (f,) = [f for f in r.findings if f.check == "warmup"]
    assert f.severity == "warning" and "warmup=5" in f.message
    assert r.to_dict()["warmup_included"] is True
    r = _summary([5.0, 1.0, 1.0], warmup=1)
    assert not r.warmup_included and "warm-up" not in str(r).splitlines()[3]
    assert not [f for f in r.findings if f.check == "warmup"]
    r = _summary([5.0, 1.0, 1.0], warmup=0)
    assert not r.warmup_included


def test_counting_flops_leaves_the_random_stream_of_training_alone() -> None:
    from torch import nn

    from accelfn.observe.flops import training_flops

    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    flops = training_flops(model, x)
    assert torch.equal(torch.rand(3), expected)  # dropout in the count drew no numbers
    assert flops == 2 * 4 * 8 * 16 * 2 + 2 * 4 * 16 * 2 * 3


def test_opening_slow_outputs_is_not_timed_as_the_first_step() -> None:
    import time

    from accelfn.observe.monitor import Monitor

    class SlowToOpen:  # like wandb.init or an MLflow server: seconds before the first step
        def open(self, start_step: int) -> None:
            time.sleep(0.3)

        def write(self, rows: Any) -> None:
            pass

        def close(self, report: str | None = None) -> None:
            pass

    mon = Monitor(progress=False, warmup=0, sync_check=None, sinks=[SlowToOpen()])
    with mon:
        for _ in range(2):
            time.sleep(0.01)
            mon.step(samples=4)
    first = mon.rows[0]
    assert first["iter_s"] < 0.2 and first["step_s"] < 0.2 and first["time_s"] < 0.2
    assert mon.report().step_time_s < 0.2


def test_nested_mappings_and_numpy_scalars_in_a_steps_metrics_are_kept() -> None:
    import numpy as np
    from tensordict import TensorDict

    from accelfn.observe.monitor import Monitor

    mon = Monitor(progress=False, warmup=0, sync_check=None)
    with mon:
        mon.step({"loss": torch.tensor(1.5), "grad": {"norm": torch.tensor(2.0),
                                                      "clipped": {"frac": 0.25}},
                  "acc": np.float32(0.5), "n": np.int64(3)})
        mon.step(TensorDict({"loss": torch.tensor(1.0),
                             "grad": TensorDict({"norm": torch.tensor(3.0)})}))
    first, second = mon.rows
    assert (first["loss"], first["grad.norm"], first["grad.clipped.frac"]) == (1.5, 2.0, 0.25)
    assert (first["acc"], first["n"]) == (0.5, 3.0)
    assert (second["loss"], second["grad.norm"]) == (1.0, 3.0)


def test_an_unknown_peak_dtype_is_refused_not_turned_into_no_mfu() -> None:
    import pytest

    from accelfn.observe.flops import peak_flops
    from accelfn.observe.monitor import Monitor, Throughput

    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_flops(h100, "bfloat16") == peak_flops(h100, torch.bfloat16) == 989.4e12
    assert peak_flops(h100, "float32") == peak_flops(h100, "fp32") == 66.9e12
    assert peak_flops(h100, torch.float64) is None  # a dtype with no tensor-core rate
    with pytest.raises(ValueError, match="'bf61'"):
        peak_flops(h100, "bf61")
    with pytest.raises(ValueError, match="peak_dtype='bf61'"):
        Monitor(throughput=Throughput(peak_dtype="bf61"))
