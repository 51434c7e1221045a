"""init_distributed's options refused before anything changes (one process, no launcher)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

import accelfn as af


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "30", True,
                                     timedelta(seconds=-5)])
def test_a_bad_timeout_is_refused_with_the_fix(timeout, monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    with pytest.raises(ValueError, match="a number > 0, or a timedelta"):
        af.init_distributed(timeout=timeout)
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ


def test_a_bad_hang_dir_is_refused(tmp_path):
    with pytest.raises(TypeError, match="give a directory path"):
        af.init_distributed(hang_dir=3)  # type: ignore[arg-type]


def test_without_a_launcher_the_options_change_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    device = af.init_distributed(timeout=timedelta(seconds=5), hang_dir=tmp_path / "hangs")
    assert device.type in ("cpu", "cuda") and not torch.distributed.is_initialized()
    assert not (tmp_path / "hangs").exists() and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
