"""Fuzzing with hypothesis: damaged checkpoints fed to load.

Every generated case (a flipped, truncated, appended or deleted byte, an edited, deeply nested
JSON value, a file replaced by a link to the same bytes elsewhere) must end in a refusal
(``CheckpointError`` or ``FileNotFoundError``) with the state untouched, or in a load of exactly
the saved state (a change that did not matter).
The counts are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from fuzz_helpers import assert_untouched, fresh_state, snapshot
from helpers import classify
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import accelfn as af
from accelfn import checkpointing as ckpt


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_ckpt")
    state = fresh_state(0)
    step = af.with_clipping(classify)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        step(state, {"x": torch.randn(6, 6, generator=g), "y": torch.randint(0, 4, (6,),
                                                                             generator=g)})
    path = ckpt.save(root / "run", state, step=step, sharded=False)
    return path, step, [p.detach().clone() for p in state.model.parameters()]


@pytest.mark.slow
def test_fuzz_damaged_checkpoints_never_load_wrong(good_checkpoint, tmp_path_factory, capsys):
    path, step, saved_params = good_checkpoint
    files = sorted(p.name for p in path.iterdir())
    outcomes: Counter[str] = Counter()
    work = tmp_path_factory.mktemp("fuzz_damage")

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(name=st.sampled_from(files), kind=st.sampled_from(["flip", "truncate", "append",
                                                               "delete", "json", "nest",
                                                               "link"]),
           where=st.floats(0.0, 1.0), byte=st.integers(1, 255))
    def check(name, kind, where, byte):
        target_dir = work / "ckpt"
        shutil.rmtree(target_dir, ignore_errors=True)
        shutil.copytree(path, target_dir)
        target = target_dir / name
        data = bytearray(target.read_bytes())
        at = min(int(where * len(data)), len(data) - 1)
        if kind == "flip":
            data[at] ^= byte
        elif kind == "truncate":
            data = data[:at]
        elif kind == "append":
            data += bytes([byte])
        elif kind == "json" and name in ("COMMITTED", "meta.json"):
            obj = json.loads(data)
            obj["step"] = obj["step"] + byte
            data = bytearray(json.dumps(obj).encode())
        elif kind == "nest" and name in ("COMMITTED", "meta.json"):
            obj = json.loads(data)
            obj["step"] = json.loads("[" * (byte * 2) + "]" * (byte * 2))
            data = bytearray(json.dumps(obj).encode())
        if kind == "delete":
            target.unlink()
        elif kind == "link":  # the same bytes, outside the checkpoint, behind a link
            outside = work / "outside" / name
            outside.parent.mkdir(parents=True, exist_ok=True)
            outside.write_bytes(bytes(data))
            target.unlink()
            target.symlink_to(outside)
        else:
            target.write_bytes(bytes(data))
        state = fresh_state(1)
        before = snapshot(state)
        try:
            ckpt.load(target_dir, state, step=step)
        except (ckpt.CheckpointError, FileNotFoundError):
            assert_untouched(before, state)
            outcomes["refused"] += 1
            return
        # loaded: then it must be exactly the saved state (a change that did not matter)
        assert kind != "link", f"{name} behind a link to a file outside was loaded"
        assert not (kind == "nest" and name in ("COMMITTED", "meta.json")), "nested JSON loaded"
        assert all(torch.equal(a, b) for a, b in zip(saved_params, state.model.parameters()))
        outcomes["loaded"] += 1

    check()
    with capsys.disabled():
        print(f"\nfuzzed checkpoints: {sum(outcomes.values())} cases: {dict(outcomes)}")
    assert outcomes["refused"] > 0
