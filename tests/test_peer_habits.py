"""Habits of HF Accelerate and Lightning Fabric, and their accelfn ports (docs/coming-from.md).

Each test runs a real loop with the other tool on the CPU (a tiny model, fixed seeds) and the
accelfn port of it, from the same initial weights and random state, and compares the
parameters after every update: bitwise where the arithmetic is the same, with the tolerance
stated and explained where it is not. The tools are the `peers` extra; without them these
tests are skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af
import accelfn.data as ad
from accelfn import checkpointing

N = 4  # micro-batches per update
MAX_NORM = 0.25  # below every update's gradient norm (0.4 to 0.7 here): every update is clipped
Params = list[Tensor]


# ------------------------------------------------------------------------------ shared parts
def dataset(samples: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(samples, 8, generator=g), torch.randint(0, 3, (samples,), generator=g)


def build(first: str = "linear", dropout: float = 0.1) -> tuple[nn.Module, Any, Any]:
    """The same model, AdamW and warm-up schedule for every run."""
    torch.manual_seed(1)
    head = [nn.LayerNorm(8)] if first == "layernorm" else []
    model = nn.Sequential(*head, nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout),
                          nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 3))
    return model, optimizer, scheduler


def snapshot(model: nn.Module) -> Params:
    return [p.detach().clone() for p in model.parameters()]


def record_gradients(optimizer: torch.optim.Optimizer,
                     seen: list[Params] | None = None) -> list[Params]:
    """The gradients each `optimizer.step()` applies (after clipping), in order, appended to
    `seen` (a new list by default) as the steps happen."""
    seen = [] if seen is None else seen
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
        [p.grad.clone() for group in opt.param_groups for p in group["params"]]))
    return seen


def assert_bitwise(a: list[Params], b: list[Params]) -> None:
    assert len(a) == len(b) > 0
    for k, (u, v) in enumerate(zip(a, b, strict=True)):
        for i, (p, q) in enumerate(zip(u, v, strict=True)):
            diff = (p - q).abs().max()
            assert torch.equal(p, q), f"update {k + 1}, tensor {i}: max |diff| {diff}"


def max_relative(a: list[Params], b: list[Params]) -> float:
    return max(((p - q).abs().max() / q.abs().max()).item()
               for u, v in zip(a, b, strict=True) for p, q in zip(u, v, strict=True))


def loss_fn(model: nn.Module, batch: TensorDict) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def port(precision: str, *, mode: str = "split", clip: bool = True) -> af.Step:
    """The accelfn stack for the other tool's settings."""
    stack = af.with_clipping(max_norm=MAX_NORM)(loss_fn) if clip else af.lift(loss_fn)
    stack = af.with_accumulation(N, mode=mode)(stack)
    if precision in ("bf16", "bf16-mixed"):
        stack = af.with_amp(dtype=torch.bfloat16)(stack)
    return stack


def port_loader(x: Tensor, y: Tensor, batch_size: int) -> ad.BatchLoader:
    """`DataLoader(TensorDataset(x, y), batch_size=...)` with its draws from torch's generator
    (one int64 at each `iter()`), so that the dropout masks are the same."""
    return ad.loader(TensorDict({"x": x, "y": y}, batch_size=[len(x)]), batch_size=batch_size,
                     shuffle=False, drop_last=False, rng=ad.DataLoaderRNG())


def run_port(step: af.Step, state: af.TrainState, loader: ad.BatchLoader, epochs: int,
             *, every_call: bool = False) -> list[Params]:
    out = []
    for _ in range(epochs):
        for batch in loader:
            step(state, batch)
            if every_call or state.at_update_boundary:
                out.append(snapshot(state.model))
    return out


# ------------------------------------------------------------------------------- Accelerate
@pytest.fixture
def accelerate() -> Iterator[Any]:
    """The module, with Accelerate's process-wide state reset after the test (an
    `Accelerator` of other settings refuses to be built while it is kept)."""
    mod = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield mod
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerate_loop(accelerate: Any, mixed_precision: str, x: Tensor, y: Tensor, *,
                    epochs: int = 2, clip: bool = True, build_kw: dict[str, Any] | None = None,
                    ) -> tuple[list[Params], list[Params], list[bool]]:
    """The loop of Accelerate's gradient-accumulation guide. Returns the parameters after each
    update, the gradients each update applied, and `sync_gradients` after each batch."""
    model, optimizer, scheduler = build(**(build_kw or {}))
    seen = record_gradients(optimizer)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision,
                                         gradient_accumulation_steps=N)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    torch.manual_seed(2)
    out, syncs = [], []
    for _ in range(epochs):
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                if clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            syncs.append(accelerator.sync_gradients)
            if accelerator.sync_gradients:
                out.append(snapshot(model))
    return out, seen, syncs


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_accumulation_clipping_schedule_equals_the_port_bitwise(
        accelerate: Any, mixed_precision: str) -> None:
    """`Accelerator(mixed_precision=..., gradient_accumulation_steps=4)`, `prepare`,
    `accumulate`, `backward`, `clip_grad_norm_` under `sync_gradients`, a scheduler, dropout:
    bitwise the split-mode port fed the 4 micro-batches of an update as one batch."""
    x, y = dataset(64)
    theirs, _, _ = accelerate_loop(accelerate, mixed_precision, x, y)
    model, optimizer, scheduler = build()
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    torch.manual_seed(2)
    ours = run_port(port(mixed_precision), state, port_loader(x, y, 4 * N), epochs=2)
    assert len(ours) == 8
    assert_bitwise(ours, theirs)
    assert scheduler.get_last_lr() == [1e-2]
    if mixed_precision == "bf16":  # autocast is on on both sides: fp32 is another run
        model, optimizer, scheduler = build()
        torch.manual_seed(2)
        fp32 = run_port(port("no"), af.TrainState(model, optimizer, scheduler=scheduler),
                        port_loader(x, y, 4 * N), epochs=2)
        assert max_relative(fp32, theirs) > 1e-3


def test_accelerate_accumulate_is_calls_mode_and_sync_gradients_is_at_update_boundary(
        accelerate: Any) -> None:
    """One micro-batch per call, as Accelerate's loop is written: calls mode, bitwise (bf16);
    `state.at_update_boundary` after each call is `accelerator.sync_gradients`."""
    x, y = dataset(64)
    theirs, _, syncs = accelerate_loop(accelerate, "bf16", x, y)
    model, optimizer, scheduler = build()
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    step, loader = port("bf16", mode="calls"), port_loader(x, y, 4)
    torch.manual_seed(2)
    ours, boundaries = [], []
    for _ in range(2):
        for batch in loader:
            step(state, batch)
            boundaries.append(state.at_update_boundary)
            if state.at_update_boundary:
                ours.append(snapshot(model))
    assert boundaries == syncs == [k % N == N - 1 for k in range(32)]
    assert_bitwise(ours, theirs)


def test_accelerate_short_last_window_is_divided_by_n_where_flush_takes_its_mean(
        accelerate: Any) -> None:
    """18 micro-batches of 4 with n = 4: Accelerate updates at the end of the data
    (`end_of_dataloader`) with the last 2 micro-batches' losses each divided by 4; accelfn's
    `step.flush(state)` weights them by samples (each 1/2). The first 4 updates are bitwise
    equal, and the last gradient is exactly twice Accelerate's (fp32, no clipping)."""
    x, y = dataset(72)
    _, theirs, syncs = accelerate_loop(accelerate, "no", x, y, epochs=1, clip=False)
    assert syncs[-1] and sum(syncs) == 5
    model, optimizer, scheduler = build()
    ours = record_gradients(optimizer)
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    step = port("no", mode="calls", clip=False)
    torch.manual_seed(2)
    run_port(step, state, port_loader(x, y, 4), epochs=1)
    assert len(ours) == 4 and not state.at_update_boundary
    step.flush(state)
    assert_bitwise(ours[:4], theirs[:4])
    assert_bitwise([[g / 2 for g in ours[4]]], theirs[4:])


def test_accelerate_save_state_load_state_resume_equals_the_port(accelerate: Any,
                                                                  tmp_path: Path) -> None:
    """`save_state` after 2 of an epoch's 4 updates, then a fresh Accelerator, `load_state`
    and `skip_first_batches`, against `checkpointing.save` and `load` with the loader. Without
    dropout both resumed runs equal the uninterrupted one, bitwise. With dropout the accelfn
    resume is still bitwise the uninterrupted run; Accelerate's is not: the `DataLoader`
    made by `skip_first_batches` draws its base seed from torch's generator after the RNG
    was restored, so every later dropout mask shifts."""
    x, y = dataset(64)

    def accelerate_resumed(dropout: float) -> list[Params]:
        kw = {"dropout": dropout}

        def session() -> tuple[Any, nn.Module, Any, Any, Any]:
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            model, optimizer, scheduler = build(**kw)
            accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=N)
            loader = DataLoader(TensorDataset(x, y), batch_size=4)
            return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)

        def train(accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any,
                  batches: Any) -> list[Params]:
            out = []
            for xb, yb in batches:
                with accelerator.accumulate(model):
                    accelerator.backward(F.cross_entropy(model(xb), yb))
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    out.append(snapshot(model))
            return out

        accelerator, model, optimizer, loader, scheduler = session()
        torch.manual_seed(2)
        out = train(accelerator, model, optimizer, scheduler, itertools.islice(loader, 2 * N))
        accelerator.save_state(str(tmp_path / f"accelerate-{dropout}"))
        accelerator, model, optimizer, loader, scheduler = session()  # a new process, as it were
        torch.manual_seed(123)
        accelerator.load_state(str(tmp_path / f"accelerate-{dropout}"))
        skipped = accelerator.skip_first_batches(loader, 2 * N)
        out += train(accelerator, model, optimizer, scheduler, skipped)
        out += train(accelerator, model, optimizer, scheduler, loader)  # the next epoch
        return out

    def port_resumed(dropout: float) -> list[Params]:
        step = port("no")

        def session() -> tuple[af.TrainState, ad.BatchLoader]:
            model, optimizer, scheduler = build(dropout=dropout)
            return af.TrainState(model, optimizer, scheduler=scheduler), port_loader(x, y, 16)

        state, loader = session()
        torch.manual_seed(2)
        batches = iter(loader)
        out = []
        for batch in itertools.islice(batches, 2):
            step(state, batch)
            out.append(snapshot(state.model))
        checkpointing.save(tmp_path / f"accelfn-{dropout}", state, loader=loader, step=step)
        state, loader = session()
        torch.manual_seed(123)
        checkpointing.load(tmp_path / f"accelfn-{dropout}", state, loader=loader, step=step)
        return out + run_port(step, state, loader, epochs=2)[:6]  # the epoch's rest, the next

    for dropout in (0.0, 0.1):
        theirs, _, _ = accelerate_loop(accelerate, "no", x, y, build_kw={"dropout": dropout})
        model, optimizer, scheduler = build(dropout=dropout)
        torch.manual_seed(2)
        ours = run_port(port("no"), af.TrainState(model, optimizer, scheduler=scheduler),
                        port_loader(x, y, 16), epochs=2)
        assert_bitwise(ours, theirs)  # the uninterrupted runs
        assert_bitwise(port_resumed(dropout), ours)
        resumed = accelerate_resumed(dropout)
        if dropout == 0.0:
            assert_bitwise(resumed, theirs)
        else:
            assert_bitwise(resumed[:2], theirs[:2])
            assert not all(torch.equal(p, q) for p, q in zip(resumed[2], theirs[2], strict=True))


def test_accelerate_evaluation_helpers_in_one_process(accelerate: Any) -> None:
    """`accelerator.autocast()` around an evaluation forward is `step.evaluate` (bitwise,
    model in eval mode); `gather_for_metrics` and `is_main_process` in one process are the
    tensor itself and `af.is_main_process()`; a scalar metric's `accelerator.reduce` mean is
    `af.reduce_metrics`."""
    x, y = dataset(32)
    model, optimizer, _ = build()
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model, optimizer = accelerator.prepare(model, optimizer)
    state = af.TrainState(model, optimizer)
    step = af.with_amp(dtype=torch.bfloat16)(loss_fn)
    model.eval()
    with torch.no_grad(), accelerator.autocast():
        losses = accelerator.gather_for_metrics(
            torch.stack([F.cross_entropy(model(x[i:i + 8]), y[i:i + 8]) for i in (0, 8)]))
    model.train()
    ours = torch.stack([step.evaluate(state, TensorDict({"x": x[i:i + 8], "y": y[i:i + 8]},
                                                        batch_size=[8]))["loss"] for i in (0, 8)])
    assert torch.equal(ours, losses)
    assert accelerator.is_main_process == af.is_main_process() is True
    reduced = af.reduce_metrics({"loss": losses[0]})["loss"]
    assert torch.equal(reduced, accelerator.reduce(losses[0], reduction="mean"))


# ----------------------------------------------------------------------------------- Fabric
def fabric_loop(precision: str, x: Tensor, y: Tensor, *, epochs: int = 2,
                build_kw: dict[str, Any] | None = None, micro: int = 4,
                grads: list[Params] | None = None) -> list[Params]:
    """The loop of Fabric's gradient-accumulation guide: the loss divided by n by hand,
    `no_backward_sync` on all but the last micro-batch, `clip_gradients`, the scheduler
    stepped by the loop. Returns the parameters after each update (and puts the gradients
    each update applied into `grads`)."""
    fabric_mod = pytest.importorskip("lightning.fabric")
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, precision=precision)
    fabric.launch()
    model, optimizer, scheduler = build(**(build_kw or {}))
    if grads is not None:
        record_gradients(optimizer, grads)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=micro))
    torch.manual_seed(2)
    out = []
    for _ in range(epochs):
        for i, (xb, yb) in enumerate(loader):
            accumulating = (i + 1) % N != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                fabric.backward(F.cross_entropy(model(xb), yb) / N)
            if not accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                out.append(snapshot(model))
    return out


@pytest.mark.parametrize("mode", ["split", "calls"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_accumulation_clipping_schedule_equals_the_port_bitwise(
        precision: str, mode: str) -> None:
    """`Fabric(precision=...)`, `setup`, `backward(loss / 4)`, `no_backward_sync`,
    `clip_gradients`, a scheduler, dropout: bitwise the port, in split mode (one batch per
    update) and in calls mode (one micro-batch per call)."""
    x, y = dataset(64)
    theirs = fabric_loop(precision, x, y)
    model, optimizer, scheduler = build()
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    loader = port_loader(x, y, 4 * N if mode == "split" else 4)
    torch.manual_seed(2)
    assert_bitwise(run_port(port(precision, mode=mode), state, loader, epochs=2), theirs)


def test_fabric_differences_stated_with_their_tolerances() -> None:
    """Where the arithmetic differs, the size of the difference:

    - calls mode with 3 samples per call weights each call by 3 and divides the window's sum
      by 12 (exact by samples, also for unequal calls), where the loop divides each loss by 4:
      float32 rounding of other products; the parameters after 8 updates within 1e-6
      relative to each tensor's largest entry (measured 1.2e-7). Split mode weighs each
      micro-batch of 3 by 3/12 = 1/4, exactly the loop's division: bitwise.
    - `bf16-mixed` casts the model's floating inputs to bf16 before the forward; autocast
      (accelfn, Accelerate) leaves them and casts per operation, so a first layer that autocast
      does not run in bf16 (a LayerNorm) sees other inputs. The first update's gradients, from
      the same weights, within 3e-2 relative (measured 1.1e-2; the same loop's bf16 and fp32
      gradients differ by 8e-3: it is bf16's rounding). Later updates are not compared: AdamW
      divides by the gradients' running magnitude, so entries near zero take steps of about
      `lr` in either direction on a last-bit difference.
    """
    x, y = dataset(48)
    theirs = fabric_loop("32-true", x, y, micro=3)
    for mode in ("split", "calls"):
        model, optimizer, scheduler = build()
        state = af.TrainState(model, optimizer, scheduler=scheduler)
        torch.manual_seed(2)
        ours = run_port(port("32-true", mode=mode), state,
                        port_loader(x, y, 3 * N if mode == "split" else 3), epochs=2)
        if mode == "split":
            assert_bitwise(ours, theirs)
        else:
            assert 0 < max_relative(ours, theirs) < 1e-6

    x, y = dataset(64)
    kw = {"first": "layernorm"}
    theirs_grads: list[Params] = []
    fabric_loop("bf16-mixed", x, y, build_kw=kw, grads=theirs_grads, epochs=1)
    model, optimizer, scheduler = build(**kw)
    ours_grads = record_gradients(optimizer)
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    torch.manual_seed(2)
    run_port(port("bf16-mixed"), state, port_loader(x, y, 16), epochs=1)
    assert 0 < max_relative(ours_grads[:1], theirs_grads[:1]) < 3e-2


def test_fabric_save_load_resume_equals_the_port(tmp_path: Path) -> None:
    """`fabric.save(path, {"model", "optimizer", "scheduler", "iteration"})` mid-epoch and
    `fabric.load(path, state)`, plus what Fabric leaves to the loop: the torch RNG state in the
    saved dict and skipping the epoch's consumed batches. With those, the resumed Fabric run
    equals the uninterrupted one and `checkpointing.save`/`load` with the loader, bitwise
    (no dropout: skipping batches by hand makes the new `iter()` draw a base seed that the
    uninterrupted run did not draw, see the Accelerate test)."""
    fabric_mod = pytest.importorskip("lightning.fabric")
    x, y = dataset(64)
    kw = {"dropout": 0.0}
    theirs = fabric_loop("32-true", x, y, build_kw=kw)

    def fabric_session() -> tuple[Any, nn.Module, Any, Any, Any]:
        fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, precision="32-true")
        model, optimizer, scheduler = build(**kw)
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=4))
        return fabric, model, optimizer, scheduler, loader

    def fabric_train(fabric: Any, model: nn.Module, optimizer: Any, scheduler: Any,
                     batches: Any, start: int) -> list[Params]:
        out = []
        for i, (xb, yb) in enumerate(batches, start):
            accumulating = (i + 1) % N != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                fabric.backward(F.cross_entropy(model(xb), yb) / N)
            if not accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                out.append(snapshot(model))
        return out

    fabric, model, optimizer, scheduler, loader = fabric_session()
    torch.manual_seed(2)
    resumed = fabric_train(fabric, model, optimizer, scheduler, itertools.islice(loader, 8), 0)
    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer,
                                           "scheduler": scheduler, "iteration": 8,
                                           "rng": torch.get_rng_state()})
    fabric, model, optimizer, scheduler, loader = fabric_session()
    torch.manual_seed(123)
    saved = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    rest = fabric.load(tmp_path / "fabric.ckpt", saved)
    torch.set_rng_state(rest["rng"])
    start = rest["iteration"]
    resumed += fabric_train(fabric, model, optimizer, scheduler,
                            itertools.islice(loader, start, None), start)
    resumed += fabric_train(fabric, model, optimizer, scheduler, loader, 0)
    assert_bitwise(resumed, theirs)

    step = port("32-true")
    model, optimizer, scheduler = build(**kw)
    state, loader = af.TrainState(model, optimizer, scheduler=scheduler), port_loader(x, y, 16)
    torch.manual_seed(2)
    ours = []
    for batch in itertools.islice(iter(loader), 2):
        step(state, batch)
        ours.append(snapshot(model))
    checkpointing.save(tmp_path / "accelfn", state, loader=loader, step=step)
    model, optimizer, scheduler = build(**kw)
    state, loader = af.TrainState(model, optimizer, scheduler=scheduler), port_loader(x, y, 16)
    torch.manual_seed(123)
    checkpointing.load(tmp_path / "accelfn", state, loader=loader, step=step)
    ours += run_port(step, state, loader, epochs=2)[:6]
    assert_bitwise(ours, theirs)


def test_fabric_helpers_in_one_process() -> None:
    """`fabric.all_reduce(t, reduce_op="mean")` is `af.reduce_metrics`; `fabric.autocast()`
    is the autocast `with_amp(dtype=torch.bfloat16)` enters (`step.evaluate`, bitwise);
    `fabric.is_global_zero` is `af.is_main_process()`."""
    fabric_mod = pytest.importorskip("lightning.fabric")
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    x, y = dataset(16)
    model, optimizer, _ = build()
    state = af.TrainState(model, optimizer)
    model.eval()
    with torch.no_grad(), fabric.autocast():
        theirs = F.cross_entropy(model(x), y)
    model.train()
    ours = af.with_amp(dtype=torch.bfloat16)(loss_fn).evaluate(
        state, TensorDict({"x": x, "y": y}, batch_size=[16]))["loss"]
    assert torch.equal(ours, theirs)
    assert torch.equal(af.reduce_metrics({"loss": ours})["loss"],
                       fabric.all_reduce(theirs, reduce_op="mean"))
    assert fabric.is_global_zero == af.is_main_process() is True
