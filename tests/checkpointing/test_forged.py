"""Forged checkpoints (issue 13, item 6): deeply nested JSON, a huge sparse file, DCP storage
paths leading out of the checkpoint, symbolic links to files outside it. A forger can fix
the commit marker's sizes and checksums, so each must be refused for what it is: a
CheckpointError before any state changes, never a RecursionError or a MemoryError, and never
a file outside the checkpoint read.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import assert_unchanged, forge, run, setup, snapshot

from accelfn import checkpointing as ckpt


def saved_run(root: Path, *, sharded: bool = False, seed: int = 0) -> Path:
    state, loader, step = setup(seed=seed)
    run(state, iter(loader), step, 2)
    return ckpt.save(root, state, loader=loader, step=step, sharded=sharded)


def refused(path: Path, match: str) -> None:
    fresh, loader, step = setup(seed=1)
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load(path, fresh, loader=loader, step=step)
    assert_unchanged(before, fresh)


def marker(path: Path) -> dict:
    return json.loads((path / "COMMITTED").read_text())


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ------------------------------------------------------------------------- deep JSON
def test_deeply_nested_json_in_the_marker_is_refused(tmp_path):
    path = saved_run(tmp_path)
    (path / "COMMITTED").write_text('{"format": "accelfn.checkpoint/1", "step": 2, "files": '
                                    + nested(200_000) + "}")
    refused(path, r"COMMITTED.*nested")


def test_deeply_nested_json_in_the_metadata_is_refused(tmp_path):
    path = saved_run(tmp_path)
    meta = (path / "meta.json").read_text()
    forge(path, "meta.json", (meta.rstrip()[:-1] + ', "x": ' + nested(200_000) + "}").encode())
    refused(path, r"meta\.json.*nested")


# ------------------------------------------------------------------------- huge files
def _meminfo_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


@pytest.mark.parametrize("rel", ["state.pt", "rank-00000.pt", "meta.json", "COMMITTED"])
def test_a_huge_sparse_file_is_refused_without_reading_it(tmp_path, rel):
    path = saved_run(tmp_path)
    size = 4 * _meminfo_bytes()  # sparse: takes no disk space, cannot fit in memory
    os.truncate(path / rel, size)
    if rel != "COMMITTED":
        entry = marker(path)
        entry["files"][rel] = {"size": size, "sha256": hashlib.sha256(b"").hexdigest()}
        (path / "COMMITTED").write_text(json.dumps(entry))
    refused(path, rf"{rel}.* bytes")


# ------------------------------------------------------------------------- DCP paths
def _forge_storage_paths(path: Path, relative: str) -> None:
    with open(path / "sharded" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file: safe to unpickle in the test
    for info in metadata.storage_data.values():
        info.relative_path = relative
    forge(path, "sharded/.metadata", pickle.dumps(metadata, protocol=2))


@pytest.mark.parametrize("where", ["../../../outside/__0_0.distcp", "/ABS/__0_0.distcp",
                                   "../state.pt", "__7_0.distcp"])
def test_dcp_storage_paths_must_name_the_checkpoints_own_shards(tmp_path, where):
    path = saved_run(tmp_path / "run", sharded=True)
    other = saved_run(tmp_path / "other", sharded=True, seed=5)  # other weights, valid shards
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(other / "sharded" / "__0_0.distcp", outside / "__0_0.distcp")
    where = where.replace("/ABS", str(outside))
    _forge_storage_paths(path, where)
    refused(path, r"storage path")


def test_a_marker_listing_a_file_outside_the_checkpoint_is_refused(tmp_path):
    path = saved_run(tmp_path / "run")
    (tmp_path / "outside.pt").write_bytes(b"x")
    entry = marker(path)
    entry["files"]["../../outside.pt"] = {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    (path / "COMMITTED").write_text(json.dumps(entry))
    refused(path, r"outside\.pt.*not a checkpoint file")


# ------------------------------------------------------------------------- symlinks
@pytest.mark.parametrize("rel", ["state.pt", "rank-00000.pt", "meta.json", "COMMITTED",
                                 "sharded/__0_0.distcp", "sharded"])
def test_symbolic_links_out_of_the_checkpoint_are_refused(tmp_path, rel):
    path = saved_run(tmp_path / "run", sharded=True)
    outside = tmp_path / "outside" / rel
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(path / rel, outside)  # the same bytes: every checksum still matches
    os.symlink(outside, path / rel)
    refused(path, r"symbolic link")


def test_the_checkpoint_folder_itself_may_be_reached_through_a_link(tmp_path):
    state, loader, step = setup()
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path / "real", state, loader=loader, step=step)
    os.symlink(tmp_path / "real", tmp_path / "linked")
    fresh, fresh_loader, fresh_step = setup(seed=1)
    info = ckpt.load(tmp_path / "linked" / path.name, fresh, loader=fresh_loader,
                     step=fresh_step)
    assert info.step == 2
    assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(),
                                                 fresh.model.parameters()))
