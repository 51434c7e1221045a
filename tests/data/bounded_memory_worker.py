"""Run by tests/data/test_tokens.py: read an 8 GiB token file in a process that may not hold it.

The file is sparse (``truncate``: no disk used); its tokens read as zeros. Once the loaders
are running, the process's address space is limited to what it has plus 1 GiB, so reading
the file whole, or mapping it, would fail. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch

import accelfn.data as ad
from accelfn.data.positions import core_node

GIB = 2**30


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def address_space() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


def main(path: str) -> None:
    torch.set_num_threads(1)
    with open(path, "wb") as f:
        f.truncate(8 * GIB)
    files = ad.TokenFiles(path)  # raw uint16: 4 Gi tokens
    windows = ad.token_loader(files, batch_size=64, seq_len=256, seed=0)
    # eot=1 never occurs: the whole file is one document of 4 Gi tokens
    packed = ad.token_loader(files, batch_size=64, seq_len=256, packing="best-fit", eot=1)
    its = [iter(windows), iter(packed)]
    for it in its:  # threads started, buffers allocated
        next(it)
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + GIB, resource.RLIM_INFINITY))
    before = peak_rss_mib()
    node = core_node(windows.root)  # the node below the stages: the windows node
    starts = [int(s) for b in range(1, 200) for s in node.window_starts(0, b)]
    for _ in range(199):
        batch = next(its[0])
        assert batch["inputs"].shape == (64, 256)
    rows = 0
    for _ in range(200):
        batch = next(its[1])
        assert (batch["document_ids"] == 0).all()  # one document, cut into rows
        rows += batch.shape[0]
    after = peak_rss_mib()
    windows.close()
    packed.close()
    print(json.dumps({
        "file_bytes": os.path.getsize(path),
        "file_tokens": files.num_tokens,
        "address_space_headroom_bytes": GIB,
        "windows_read": len(starts),
        "window_span": max(starts) - min(starts),
        "packed_rows": rows,
        "rss_growth_mib": round(after - before, 1),
    }))


if __name__ == "__main__":
    main(sys.argv[1])
