"""Run under torchrun (one process) by tests/transforms/test_distributed_ft.py: one replica
group of a fault-tolerant run, ``python -m torch.distributed.run ... ft_worker.py OUT GROUP
[STRATEGY]`` (``ddp`` by default; with ``fsdp`` and several processes, each saves its shards).

Group 1's first process SIGKILLs itself in the forward of the update after KILL_AT updates
taken with both groups (the update in flight); torchrun (``--max-restarts=1``) starts it
again and it heals from group 0, which never stops. Each group trains until the run's record
shows replicas lost after both had trained together, then both again (the update where group
1 healed), and saves its final model, optimizer and scheduler state and its record in
``OUT/group<g>.pt``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from helpers import Net, classify, make_batch  # noqa: E402

import accelfn as af  # noqa: E402
from accelfn.transforms.distributed import FaultTolerance, fault_tolerance_report  # noqa: E402

KILL_AT = 3  # group 1's first process dies in the update after 3 updates with both groups
DEADLINE = 60.0  # seconds: a hang fails the test instead of blocking it


def rejoined(report: dict) -> bool:
    """Whether the record shows 2 groups, then fewer, then 2 again (ending with 2)."""
    counts = [run["replicas"] for run in report["runs"]]
    if not counts or counts[-1] != 2:
        return False
    first_full = counts.index(2)
    return any(n < 2 for n in counts[first_full:])


def main() -> None:
    out, group = sys.argv[1], int(sys.argv[2])
    strategy = sys.argv[3] if len(sys.argv) > 3 else "ddp"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(group + 10 * attempt)  # different initial weights: the heal must copy
    model = Net(dim=8, depth=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.1 * s))
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    together = 0  # updates taken with both groups by this process

    def fn(model, batch):
        if group == 1 and attempt == 0 and together == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-update: the forward of update KILL_AT
        return classify(model, batch)

    options = FaultTolerance(replica_id=f"group{group}", replicas=2, timeout=5.0,
                             quorum_timeout=30.0, connect_timeout=5.0,
                             report=os.path.join(out, f"report{group}.json"))
    step = af.distributed(strategy=strategy, fault_tolerance=options)(fn)
    start = time.monotonic()
    while True:
        metrics = step(state, make_batch(n=8, seed=100 * group + state.step))
        together += int(metrics["replicas"]) == 2
        report = fault_tolerance_report(state, replicas=2)
        if rejoined(report):
            break
        if int(metrics["replicas"]) < 2:
            time.sleep(0.05)  # alone: leave the cores to the restarting group
        if time.monotonic() - start > DEADLINE:
            raise SystemExit(f"group {group}: no rejoin within {DEADLINE} s: {report}")
    rank = int(os.environ.get("RANK", "0"))  # FSDP2 within a group: this process' shards
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    optimized = optimizer.state_dict()
    optimized["state"] = {k: {n: local(v) for n, v in s.items()}
                          for k, s in optimized["state"].items()}
    torch.save({"model": {k: local(v) for k, v in model.state_dict().items()},
                "optimizer": optimized, "scheduler": scheduler.state_dict(),
                "step": state.step, "attempt": attempt, "report": report},
               os.path.join(out, f"group{group}" + (f"-rank{rank}" if rank else "") + ".pt"))


if __name__ == "__main__":
    main()
