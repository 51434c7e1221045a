"""benchmarks/data.py's real-JPEG part in its dry run: every stage runs, and both pipelines
end in batches of the same shape, dtype and device with normalised values.

Benchmarks measure; nothing here asserts a timing or a speedup.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _benchmark():
    path = ROOT / "benchmarks" / "data.py"
    spec = importlib.util.spec_from_file_location("benchmarks_data", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jpeg_dry_run_runs_every_stage_and_both_sides_make_the_same_batches():
    bench = _benchmark()
    args = bench.parse_args(["--dry-run", "--device", "cpu"])
    result = bench.jpeg_part(args)

    setup = result["setup"]
    assert setup["stages"] == ["dataloader", "accelfn", "decode_only", "read_only"]
    assert setup["images"]["count"] == 64 and setup["workers"] == 1
    assert setup["cpu_cores"] >= 1 and setup["device"] == "cpu"
    for stage in setup["stages"]:
        assert len(result[stage]["images_per_s_all"]) == args.repeats
        assert result[stage]["images_per_s"] > 0
    dl, af = result["dataloader"]["batch"], result["accelfn"]["batch"]
    assert dl["shape"] == af["shape"] == [16, 3, 16, 16]
    assert dl["dtype"] == af["dtype"] == str(torch.float32)
    assert dl["device"] == af["device"] == "cpu"
    # ImageNet-normalised pixels: (0 - 0.485) / 0.229 = -2.12 to (1 - 0.406) / 0.225 = 2.64
    for batch in (dl, af):
        assert -2.2 < batch["min"] < batch["mean"] < batch["max"] < 2.7
        assert 0.3 < batch["std"] < 2.0
    targets = result["targets"]
    assert targets["meaningful"] is False and "not meaningful" in targets["note"]
    for key in ("accelfn_images_per_s", "decode_only_images_per_s",
                "ratio_accelfn_to_dataloader"):
        assert isinstance(targets[key]["met"], bool) and targets[key]["value"] > 0
