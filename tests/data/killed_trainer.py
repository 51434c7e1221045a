"""A trainer to be SIGKILLed: a loader with two worker processes, then a step that never ends.

``python killed_trainer.py <start method>`` prints ``workers <pid> <pid>`` once both workers
have produced batches, then sleeps (the loop stuck in a long step, the workers idle).
"""

from __future__ import annotations

import os
import sys
import time

import torch

import accelfn.data as ad


class PidDataset:
    """Samples that say which process loaded them (module level: spawn workers import it)."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor(index), "pid": torch.tensor(os.getpid())}


def main(method: str) -> None:
    loader = ad.loader(PidDataset(), batch_size=4, num_workers=2, worker_type="process",
                       mp_context=method)
    pids: set[int] = set()
    deadline = time.monotonic() + 300
    while len(pids) < 2 and time.monotonic() < deadline:
        for batch in loader:
            pids.update(batch["pid"].tolist())
            if len(pids) == 2:
                break
    print("workers", *sorted(pids), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
