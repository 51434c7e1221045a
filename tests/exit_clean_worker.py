"""A tiny complete run under torchrun, for test_exit_clean.py: DDP (gloo) steps over a
prefetching loader, a checkpoint, the loader closed, a last collective, the process group
destroyed, then the interpreter exits.

    torchrun --nproc_per_node=2 exit_clean_worker.py OUT [--gc-off]

``--gc-off`` turns the garbage collector off first (``gc.disable()``, as some training scripts
do for speed): what only a collection frees (the step's DDP wrapper, which holds the process
group, sits in reference cycles) is then still there when the interpreter exits.

At interpreter exit, after every other exit handler (it is registered first), each process
writes ``OUT/threads-<rank>.json``: the names of the gloo threads still running. A process
group that is still alive then keeps its threads into the interpreter's finalization, where a
thread that asks for the GIL aborts the process. The last collective (the final metrics, kept to the
end) is made with this thread keeping the GIL (no switch every 5 ms): a gloo thread that
still has to release the collective's tensors gets the GIL only when this thread blocks,
which, with no group destructor to wait for, is in the interpreter's finalization (an abort
in about half the runs).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

import accelfn as af
from accelfn import checkpointing, data


def gloo_threads() -> list[str]:
    """Names of this process' native threads that belong to gloo (Linux: /proc)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def record_threads_at_exit(out: str) -> None:
    path = Path(out) / f"threads-{os.environ['RANK']}.json"

    def record() -> None:
        path.write_text(json.dumps(gloo_threads()))

    atexit.register(record)  # first registered, last run


def loss_fn(model: nn.Module, batch: TensorDict) -> dict[str, torch.Tensor]:
    return {"loss": F.cross_entropy(model(batch["x"]), batch["y"])}


def main(out: str, gc_off: bool = False) -> TensorDict:
    if gc_off:
        gc.disable()
    Path(out).mkdir(parents=True, exist_ok=True)
    record_threads_at_exit(out)
    device = af.init_distributed()
    torch.manual_seed(0)
    samples = TensorDict({"x": torch.randn(64, 8), "y": torch.randint(0, 3, (64,))}, [64])
    train = data.loader(samples, batch_size=8, device=device, prefetch=2)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)).to(device)
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step = af.distributed(af.with_accumulation(2)(loss_fn))
    metrics = TensorDict({}, batch_size=[])
    for _ in range(2):
        for batch in train:
            metrics = step(state, batch)
    checkpointing.save(out, state, step=step, keep=1)
    train.close()
    sys.setswitchinterval(1000.0)  # this thread keeps the GIL until it blocks
    final = af.reduce_metrics(metrics)  # the usual last collective: the run's final metrics
    torch.distributed.destroy_process_group()
    return final  # kept to the end, as a script keeps what it reports


if __name__ == "__main__":
    final = main(sys.argv[1], gc_off="--gc-off" in sys.argv[2:])
