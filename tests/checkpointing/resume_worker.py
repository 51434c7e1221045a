"""Training runs that get killed, preempted and resumed, for test_resume.py and
test_preemption.py (each mode runs in its own process, as a real restart would).

    python resume_worker.py first   RUN OUT   reference run, then train, save, die (SIGKILL)
                                              in the middle of a later save
    python resume_worker.py preempt RUN OUT   reference run, then train until SIGTERM comes:
                                              checkpoint at the next boundary, exit 75
    python resume_worker.py resume  RUN OUT [--mutations]
                                              resume from RUN's latest checkpoint to the end;
                                              with --mutations also once per part left out
    torchrun --nproc_per_node=2 --max-restarts=2 resume_worker.py dist RUN OUT
                                              DDP and FSDP2: phase 0 trains, saves, and a
                                              worker is SIGKILLed; phase 1 (torchrun's restart)
                                              resumes both, then is preempted by SIGTERM on
                                              one rank; phase 2 resumes that
    torchrun --nproc_per_node=2 resume_worker.py locked RUN OUT
                                              both ranks save into a folder another host's
                                              lock holds: every rank raises, none hangs
    torchrun --nproc_per_node=2 --max-restarts=1 resume_worker.py reconnect RUN OUT
                                              af.init_distributed() after a restart in which
                                              rank 0 comes up last
    torchrun --nproc_per_node=2 resume_worker.py several RUN OUT
                                              DDP and FSDP2: two states in one checkpoint,
                                              one with two optimizers; saved, loaded into new
                                              states, compared with the uninterrupted run

The training uses every kind of state on purpose: AdamW moments, an LR schedule, an fp16 loss
scaler, a transform slot, Python/NumPy/torch RNG in the step function (dropout), and a
shuffled, augmented loader stopped mid-epoch.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tensordict import TensorDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from helpers import Net

import accelfn as af
from accelfn import checkpointing, data
from accelfn.checkpointing import files as checkpoint_files
from accelfn.checkpointing import format as checkpoint_format
from accelfn.checkpointing import loading as checkpoint_loading
from accelfn.checkpointing.preemption import PreemptionGuard

STEPS = 16       # single process: 12 batches per epoch, so the run crosses an epoch
SAVE_AT = 5      # mid-epoch
DIST_STEPS = 10  # per rank: 6 batches per epoch
DIST_SAVE_AT = 4
MUTATIONS = ("optimizer", "scheduler", "slot:with_amp", "slot:gradients.gradient_noise",
             "rng.python", "rng.numpy", "rng.torch", "data")


def dataset() -> TensorDict:
    g = torch.Generator().manual_seed(42)
    n = 96
    return TensorDict({"x": torch.randn(n, 6, generator=g),
                       "y": torch.randint(0, 4, (n,), generator=g)}, batch_size=[n])


def jitter(batch: TensorDict, generator: torch.Generator | None = None) -> TensorDict:
    """A host-side augmentation drawing from the loader's per-batch generator."""
    batch["x"] = batch["x"] + 0.05 * torch.randn(batch["x"].shape, generator=generator)
    return batch


def noisy_classify(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """Cross-entropy with dropout (torch RNG) and a loss factor from Python and NumPy RNG."""
    logits = F.dropout(model(batch["x"]), p=0.2, training=True)
    factor = (1.0 + 0.1 * random.random()) * (1.0 + 0.1 * float(np.random.rand()))
    return {"loss": F.cross_entropy(logits, batch["y"]) * factor}


def _add_noise(grads: list[Any], params: list[Any], state: dict[str, Any]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + int(state["count"]))
    for grad in grads:
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2's shard
        local.add_(torch.randn(local.shape, generator=g).to(local.dtype) * 0.01)
    return {"count": state["count"] + 1}


def grad_noise() -> af.GradientTransform:
    """A user gradient transform with checkpointable state: noise seeded by an update
    counter."""
    return af.GradientTransform(
        "gradient_noise", _add_noise,
        init=lambda params: {"count": torch.zeros((), dtype=torch.int64)})


def warmup_then_decay(update: int) -> float:
    """An LR factor computed from the scheduler's own counter (not from the current LR)."""
    return min(1.0, (update + 1) / 4) * 0.9**update


def seed_everything(seed: int) -> None:
    """What a training script does first (a restarted process does it again)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(strategy: str | None = None) -> tuple[af.TrainState, Any, af.Step]:
    rank = int(os.environ.get("RANK", "0"))
    seed_everything(1234 + rank)
    torch.manual_seed(7)  # the same initial model on every rank
    model = Net()
    seed_everything(1234 + rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    loader = data.loader(dataset(), batch_size=8, shuffle=True, seed=3, transform=jitter)
    step = af.apply_transform(af.with_clipping(max_norm=1.0)(noisy_classify), grad_noise())
    if strategy is None:
        step = af.with_amp(dtype=torch.float16, init_scale=2.0**14, growth_interval=1)(step)
    else:
        step = af.distributed(strategy=strategy)(af.with_accumulation(2)(step))
    return state, loader, step


def batches(loader: Any) -> Iterator[Any]:
    while True:  # one iterator across epochs: a new iter() starts the next epoch
        yield from loader


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
            for name, p in model.named_parameters()}


def summary(state: af.TrainState, losses: list[torch.Tensor]) -> dict[str, Any]:
    state.sync()
    scaler = state.slots.get("with_amp")
    return {"params": full_params(state.model), "step": state.step,
            "lr": state.scheduler.get_last_lr()[0], "losses": [x.clone() for x in losses],
            "scale": None if scaler is None else float(scaler.get_scale()),
            "skipped": state.slots["nonfinite"].skipped}


def train(state: af.TrainState, it: Iterator[Any], step: af.Step, until: int,
          losses: list[torch.Tensor], record_from: int) -> None:
    while state.step < until:
        metrics = step(state, next(it))
        if state.step > record_from:
            losses.append(metrics["loss"].detach().clone())


def reference(out: Path, record_from: int, strategy: str | None = None, tag: str = "") -> None:
    state, loader, step = build(strategy)
    losses: list[torch.Tensor] = []
    train(state, batches(loader), step, DIST_STEPS if strategy else STEPS, losses, record_from)
    torch.save(summary(state, losses), out / f"reference{tag}.pt")


# ------------------------------------------------------------------------- for the tests
WORKER = Path(__file__).resolve()
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def load_result(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def assert_same_run(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Bitwise the same parameters and losses after the resume, same counters and LR."""
    for name, value in expected["params"].items():
        assert torch.equal(value, got["params"][name]), f"{name} differs after the resume"
    assert len(expected["losses"]) == len(got["losses"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(expected["losses"], got["losses"]))
    for key in ("step", "lr", "scale", "skipped"):
        assert expected[key] == got[key], key


# ------------------------------------------------------------------------- single process
def first(run: Path, out: Path) -> None:
    reference(out, SAVE_AT)
    state, loader, step = build()
    it = batches(loader)
    losses: list[torch.Tensor] = []
    for at in (2, 4, SAVE_AT):  # keep=2: only the last two survive
        train(state, it, step, at, losses, STEPS)
        checkpointing.save(run, state, loader=loader, step=step, keep=2, extra={"at": at})
    train(state, it, step, SAVE_AT + 2, losses, STEPS)  # work that will be lost

    real_write_json = checkpoint_files.write_json

    def die_before_the_marker(path: Path, obj: Any) -> Any:
        if path.name.startswith(checkpoint_format.MARKER):
            print(f"killed while committing {path.parent.name}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write_json(path, obj)

    checkpoint_files.write_json = die_before_the_marker
    checkpointing.save(run, state, loader=loader, step=step, keep=2)
    raise AssertionError("the process should have been killed while saving")


def preempt(run: Path, out: Path) -> None:
    reference(out, 3)
    state, loader, step = build()
    it = batches(loader)
    with PreemptionGuard() as guard:
        while state.step < STEPS:
            step(state, next(it))
            if state.step == 3:
                print("ready for SIGTERM", flush=True)
                deadline = time.monotonic() + 60
                while not guard.requested and time.monotonic() < deadline:
                    time.sleep(0.01)
            guard.exit_if_requested(run, state, loader=loader, step=step)
    print("finished without being preempted", flush=True)
    sys.exit(3)


def resume(run: Path, out: Path, mutations: bool) -> None:
    state, loader, step = build()
    info = checkpointing.load(run, state, loader=loader, step=step)
    losses: list[torch.Tensor] = []
    train(state, batches(loader), step, STEPS, losses, info.step)
    result = summary(state, losses)
    result["info"] = {"step": info.step, "path": str(info.path), "restored": list(info.restored),
                      "extra": info.extra}
    torch.save(result, out / "resumed.pt")
    if not mutations:
        return
    for part in MUTATIONS:
        state, loader, step = build()
        with checkpoint_loading._dropping(part):
            info = checkpointing.load(run, state, loader=loader, step=step)
        assert part not in info.restored, (part, info.restored)
        losses = []
        train(state, batches(loader), step, STEPS, losses, info.step)
        torch.save(summary(state, losses), out / f"mutation-{part}.pt")


# ------------------------------------------------------------------------- torchrun
def dist_main(run: Path, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    phase = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    af.init_distributed()
    rank = dist.get_rank()
    (out / f"phase{phase}-rank{rank}.started").touch()
    if phase == 0:
        for strategy in ("ddp", "fsdp"):
            reference(out, DIST_SAVE_AT, strategy, tag=f"-{strategy}-rank{rank}")
            state, loader, step = build(strategy)
            it = batches(loader)
            losses: list[torch.Tensor] = []
            train(state, it, step, 2, losses, DIST_STEPS)
            checkpointing.save(run / strategy, state, loader=loader, step=step, keep=1)
            train(state, it, step, DIST_SAVE_AT, losses, DIST_STEPS)
            checkpointing.save(run / strategy, state, loader=loader, step=step, keep=1)
            optim = get_optimizer_state_dict(state.model, state.optimizer,
                                             options=StateDictOptions(full_state_dict=True))
            params = full_params(state.model)  # collective under FSDP: on every rank
            if rank == 0:
                torch.save({"params": params, "optimizer": optim}, out / f"at-save-{strategy}.pt")
            train(state, it, step, DIST_SAVE_AT + 2, losses, DIST_STEPS)  # lost
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dies: torchrun restarts all
        time.sleep(120)  # rank 0 is stopped by torchrun
    elif phase == 1:
        for strategy in ("ddp", "fsdp"):
            state, loader, step = build(strategy)
            info = checkpointing.load(run / strategy, state, loader=loader, step=step)
            losses = []
            train(state, batches(loader), step, DIST_STEPS, losses, info.step)
            torch.save(summary(state, losses), out / f"resumed-{strategy}-rank{rank}.pt")
        state, loader, step = build("ddp")
        it = batches(loader)
        with PreemptionGuard(check_every=2) as guard:
            while state.step < DIST_STEPS:
                step(state, next(it))
                if state.step == 3 and rank == 1:
                    os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told
                    while not guard.requested:
                        time.sleep(0.01)
                if guard.should_stop():
                    (out / f"preempted-rank{rank}.json").write_text(json.dumps(
                        {"step": state.step, "requested": guard.requested}))
                    guard.checkpoint_and_exit(run / "preempt", state, loader=loader, step=step)
        raise AssertionError("phase 1 should have been preempted")
    else:
        state, loader, step = build("ddp")
        info = checkpointing.load(run / "preempt", state, loader=loader, step=step)
        losses = []
        train(state, batches(loader), step, DIST_STEPS, losses, info.step)
        torch.save(summary(state, losses), out / f"resumed-preempt-rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()


def reconnect(out: Path) -> None:
    """A worker is killed; after torchrun's restart rank 0 is slow to come up."""
    import torch.distributed as dist

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 1:  # rank 1 looks up rank 0's address before rank 0 publishes its new one
        ready = out / "rank1-connecting"
        if os.environ.get("RANK") == "1":
            ready.touch()
        else:
            deadline = time.monotonic() + 60
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(5.0)  # rank 1 has read the stale address and is failing to connect
    af.init_distributed()
    total = torch.ones(1)
    dist.all_reduce(total)
    if restart == 0:
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    (out / f"reconnected-rank{dist.get_rank()}").write_text(str(total.item()))
    dist.destroy_process_group()


def build_pair(strategy: str) -> tuple[dict[str, af.TrainState], Any, dict[str, af.Step]]:
    """Two states, each with its step under ``strategy``: "main" trains Net's matrices with
    SGD (momentum) and the rest with AdamW, each with its schedule (the second None); "aux"
    trains another Net with Adam."""
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(7)  # the same initial models on every rank
    main, aux = Net(), Net(dim=4)
    seed_everything(1234 + rank)
    matrices = [p for p in main.parameters() if p.dim() == 2]
    sgd = torch.optim.SGD(matrices, lr=0.05, momentum=0.9)
    adamw = torch.optim.AdamW([p for p in main.parameters() if p.dim() != 2], lr=1e-2)
    states = {"main": af.TrainState(main, [sgd, adamw], scheduler=[
                  torch.optim.lr_scheduler.LambdaLR(sgd, warmup_then_decay), None]),
              "aux": af.TrainState(aux, torch.optim.Adam(aux.parameters(), lr=1e-2))}
    steps = {name: af.distributed(strategy=strategy)(af.with_clipping(max_norm=1.0)(
        noisy_classify)) for name in states}
    loader = data.loader(dataset(), batch_size=8, shuffle=True, seed=3, transform=jitter)
    return states, loader, steps


def train_pair(states: dict[str, af.TrainState], it: Iterator[Any], steps: dict[str, af.Step],
               until: int, losses: list[torch.Tensor]) -> None:
    while states["main"].step < until:
        batch = next(it)
        for name in ("main", "aux"):
            losses.append(steps[name](states[name], batch)["loss"].detach().clone())


def several(run: Path, out: Path) -> None:
    """Two states (one with two optimizers) in one checkpoint, under DDP and FSDP2."""
    import torch.distributed as dist

    af.init_distributed()
    rank = dist.get_rank()
    outcome: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        states, loader, steps = build_pair(strategy)
        expected: list[torch.Tensor] = []
        train_pair(states, batches(loader), steps, DIST_STEPS, expected)
        reference = {name: full_params(s.model) for name, s in states.items()}

        states, loader, steps = build_pair(strategy)
        it = batches(loader)
        losses: list[torch.Tensor] = []
        train_pair(states, it, steps, DIST_SAVE_AT, losses)
        checkpointing.save(run / strategy, states, loader=loader, step=steps)
        states, loader, steps = build_pair(strategy)  # a new run, seeded alike
        info = checkpointing.load(run / strategy, states, loader=loader, step=steps)
        train_pair(states, batches(loader), steps, DIST_STEPS, losses)
        got = {name: full_params(s.model) for name, s in states.items()}
        outcome[strategy] = {
            "sharded": info.sharded, "states": list(info.states),
            "same_losses": len(losses) == len(expected) and all(
                torch.equal(a, b) for a, b in zip(losses, expected)),
            "same_params": all(torch.equal(reference[n][k], got[n][k])
                               for n in reference for k in reference[n]),
            "lr": states["main"].schedulers[0].get_last_lr()[0]}
    (out / f"several-rank{rank}.json").write_text(json.dumps(outcome))
    dist.barrier()
    dist.destroy_process_group()


def locked(run: Path, out: Path) -> None:
    """Both ranks save into a folder whose lock another (live) host holds: every rank raises,
    none waits in a collective, and each says why."""
    import torch.distributed as dist

    af.init_distributed()
    rank = dist.get_rank()
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        (run / ".lock").write_text(json.dumps({"pid": 4242, "host": "node-17.cluster",
                                               "created": time.time(), "token": "t0"}))
    dist.barrier()
    state, loader, step = build("ddp")
    train(state, batches(loader), step, 1, [], DIST_STEPS)
    try:
        checkpointing.save(run, state, loader=loader, step=step)
        outcome = {"raised": None}
    except Exception as error:
        outcome = {"raised": type(error).__name__, "message": str(error)}
    (out / f"locked-rank{rank}.json").write_text(json.dumps(outcome))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, run_dir, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    if mode == "first":
        first(run_dir, out_dir)
    elif mode == "preempt":
        preempt(run_dir, out_dir)
    elif mode == "resume":
        resume(run_dir, out_dir, "--mutations" in sys.argv)
    elif mode == "dist":
        dist_main(run_dir, out_dir)
    elif mode == "locked":
        locked(run_dir, out_dir)
    elif mode == "reconnect":
        reconnect(out_dir)
    elif mode == "several":
        several(run_dir, out_dir)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
