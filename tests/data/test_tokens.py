"""Token files (accelfn.data.tokens): nanoGPT's raw layout, llm.c / modded-nanogpt shards,
several files as one stream, refusals, and reads bounded whatever the file's size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import accelfn.data as ad

HERE = Path(__file__).resolve().parent


def test_reads_nanogpt_bin_written_with_np_memmap(tmp_path):
    # nanoGPT's prepare.py: arr = np.memmap(filename, dtype=np.uint16, mode='w+', shape=...)
    ids = np.random.default_rng(0).integers(0, 50257, size=10_000).astype(np.uint16)
    arr = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="w+", shape=ids.shape)
    arr[:] = ids
    arr.flush()
    del arr
    files = ad.TokenFiles(tmp_path / "train.bin")  # raw, uint16 by default
    assert files.num_tokens == len(files) == 10_000 and files.dtype.name == "uint16"
    assert (files.read(0, 10_000) == ids).all()
    assert (files.read(1234, 1300) == ids[1234:1300]).all()
    assert files.read(5, 5).size == 0


@pytest.mark.parametrize(("dtype", "magic", "version"),
                         [("uint16", 20240520, 1), ("uint32", 20240801, 7)])
def test_shards_have_llm_c_headers(tmp_path, dtype, magic, version):
    ids = np.random.default_rng(1).integers(0, 2**16 if dtype == "uint16" else 2**20, size=777)
    path = ad.write_tokens(tmp_path / "shard_000.bin", ids, dtype=dtype)
    raw = path.read_bytes()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[:3].tolist() == [magic, version, 777] and not header[3:].any()
    assert len(raw) == 1024 + 777 * np.dtype(dtype).itemsize
    # modded-nanogpt reads a shard as: tokens = np.frombuffer(..., offset=256 * 4)
    assert (np.frombuffer(raw, dtype=dtype, offset=1024) == ids).all()
    files = ad.TokenFiles(path)
    assert files.dtype.name == dtype and (files.read(0, 777) == ids).all()
    assert ad.write_tokens(tmp_path / "auto.bin", ids).stat().st_size == len(raw)  # by range


def test_several_files_read_as_one_stream(tmp_path):
    rng = np.random.default_rng(2)
    parts = [rng.integers(0, 1000, size=n) for n in (50, 1, 300, 7)]
    for i, part in enumerate(parts):
        ad.write_tokens(tmp_path / f"fineweb_train_{i:06d}.bin", part)
    files = ad.TokenFiles(str(tmp_path / "fineweb_train_*.bin"))  # a glob, sorted
    stream = np.concatenate(parts)
    assert files.counts == (50, 1, 300, 7) and files.num_tokens == len(stream)
    for start, stop in [(0, 358), (45, 52), (50, 51), (49, 352), (357, 358)]:
        assert (files.read(start, stop) == stream[start:stop]).all()
    with pytest.raises(IndexError):
        files.read(300, 359)
    assert files.describe()[0] == ["fineweb_train_000000.bin", 50]


def test_raw_uint32_and_explicit_formats(tmp_path):
    ids = np.arange(100, dtype=np.uint32) * 70_000
    ids.tofile(tmp_path / "raw32.bin")
    assert (ad.TokenFiles(tmp_path / "raw32.bin", dtype="uint32").read(0, 100) == ids).all()
    ad.write_tokens(tmp_path / "raw16.bin", np.arange(10), format="raw")
    assert (tmp_path / "raw16.bin").stat().st_size == 20
    with pytest.raises(ValueError, match="not a token shard"):
        ad.TokenFiles(tmp_path / "raw16.bin", format="shard")
    shard = ad.write_tokens(tmp_path / "s.bin", np.arange(10))
    assert ad.TokenFiles(shard, format="raw").num_tokens == 10 + 512  # the header as tokens


def test_refusals(tmp_path):
    shard = ad.write_tokens(tmp_path / "s.bin", np.arange(100))
    with open(shard, "r+b") as f:
        f.truncate(1024 + 150)  # an interrupted write
    with pytest.raises(ValueError, match="not completely written"):
        ad.TokenFiles(shard)
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="whole number of uint16"):
        ad.TokenFiles(tmp_path / "odd.bin")
    ok = ad.write_tokens(tmp_path / "ok.bin", np.arange(10))
    with pytest.raises(ValueError, match="leave dtype=None for shards"):
        ad.TokenFiles(ok, dtype="uint32")
    ad.write_tokens(tmp_path / "big.bin", np.arange(10), dtype="uint32")
    with pytest.raises(ValueError, match="different dtypes"):
        ad.TokenFiles([ok, tmp_path / "big.bin"])
    with pytest.raises(ValueError, match=r"uint16.*or uint32"):
        ad.TokenFiles(ok, dtype="int64")
    with pytest.raises(FileNotFoundError):
        ad.TokenFiles(tmp_path / "missing.bin")
    with pytest.raises(FileNotFoundError, match="no token file matches"):
        ad.TokenFiles(str(tmp_path / "nothing_*.bin"))
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="hold no token"):
        ad.TokenFiles(tmp_path / "empty.bin")
    with pytest.raises(ValueError, match="does not fit in uint16"):
        ad.write_tokens(tmp_path / "x.bin", [70_000], dtype="uint16")
    with pytest.raises(ValueError, match=">= 0"):
        ad.write_tokens(tmp_path / "x.bin", [-1])
    with pytest.raises(ValueError, match="integers"):
        ad.write_tokens(tmp_path / "x.bin", [0.5])
    assert not (tmp_path / "x.bin").exists()  # nothing half-written


def test_write_tokens_creates_missing_folders(tmp_path):
    """``write_tokens("data/fineweb/train_000.bin", ids)`` in a fresh checkout: the missing
    folders are made (a data-preparation script failed with FileNotFoundError)."""
    path = ad.write_tokens(tmp_path / "data" / "fineweb" / "train_000.bin", np.arange(10))
    assert path.parent.is_dir()
    assert ad.TokenFiles(path).read(0, 10).tolist() == list(range(10))
    assert [p.name for p in path.parent.iterdir()] == ["train_000.bin"]  # no temporary left


def test_token_files_pickle_and_tensors(tmp_path):
    import pickle

    ids = torch.arange(5000) % 311
    files = ad.TokenFiles(ad.write_tokens(tmp_path / "t.bin", ids))
    files.read(0, 10)  # opens a descriptor, which does not travel
    again = pickle.loads(pickle.dumps(files))
    assert (again.read(100, 4000) == ids[100:4000].numpy()).all()
    files.close()
    assert (files.read(0, 3) == [0, 1, 2]).all()  # opened again


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS, /proc: Linux")
def test_memory_stays_bounded_on_a_file_larger_than_the_process_may_use(tmp_path):
    """An 8 GiB sparse token file (no disk used), read by a process whose address space may
    grow by 1 GiB: random windows all over it, and a single 4-billion-token document packed
    into rows, without reading it whole; the peak resident memory grows by a few MiB."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "bounded_memory_worker.py"), str(tmp_path / "huge.bin")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["file_bytes"] == 8 * 2**30
    assert result["address_space_headroom_bytes"] == 2**30  # the whole file could not fit
    assert result["window_span"] > 0.95 * result["file_tokens"]  # reads all over the file
    assert result["windows_read"] >= 10_000 and result["packed_rows"] >= 10_000
    assert result["rss_growth_mib"] < 64, result
