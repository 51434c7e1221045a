"""Will it fit? The peak memory of one update, estimated without allocating, by kind.

[`estimate_memory`][] runs the step on a copy of the state made of fake tensors (shapes,
dtypes and devices, no memory), so every transform of the stack acts as it would (bf16
autocast, activation checkpointing, the micro-batches of accumulation), and follows the
storage of every tensor the update creates: alive from the operator that made it until its
last reference goes (autograd's saved tensors included). The peak of the live bytes, and
what they held at that moment, is the estimate. torch offers the pieces (fake tensors,
dispatch modes) but no estimate of a training update, hence this module.

The peak is that of tensor storage, what ``torch.cuda.max_memory_allocated`` counts less
the allocator's rounding and the kernels' workspaces (cuBLAS, cuDNN): on a GPU keep a
margin of some percent. ``compiled`` is left out of the estimate (its fused kernels keep
less, so the eager estimate is an upper bound), and FSDP's sharded parameters, gradients and
optimizer state are divided by the world size (one block's gathered parameters are not
added back).
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core import compat_memory as compat
from ..core.batch import Batch
from ..core.state import TrainState
from ..step.engine import Step, lift

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_script", "format_estimate",
           "oom_advice"]

_LEFT_OUT = ("compiled", "distributed")  # not traced: compile, process groups


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes alive at the peak of one update, by kind (they sum to ``peak``).

    ``parameters`` (buffers included), ``gradients``, ``optimizer_state``, ``activations``
    (what autograd saved for backward), ``temporaries`` (everything else: the batch,
    outputs, intermediate results) of which ``largest_temporary`` is the largest one tensor;
    ``phase`` is where the peak falls: ``"backward"``, ``"optimizer"`` (its step) or
    ``"forward"`` (the rest of the update: forward, loss, clipping).
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    largest_temporary: int
    peak: int
    phase: str
    world_size: int = 1

    def kinds(self) -> dict[str, int]:
        """The peak's bytes by kind, largest first."""
        found = {"parameters": self.parameters, "gradients": self.gradients,
                 "optimizer state": self.optimizer_state, "activations": self.activations,
                 "temporaries": self.temporaries}
        return dict(sorted(found.items(), key=lambda kv: -kv[1]))

    def __str__(self) -> str:
        return format_estimate(self)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_estimate(estimate: MemoryEstimate) -> str:
    """One line: the peak, then its kinds, e.g. ``memory: peak 1.2 GiB per process in the
    backward (activations 700.0 MiB, parameters 300.0 MiB, ...)``."""
    kinds = ", ".join(f"{k} {_size(v)}" for k, v in estimate.kinds().items() if v)
    per = " per process" if estimate.world_size > 1 else ""
    return (f"memory: peak {_size(estimate.peak)}{per} in the {estimate.phase} ({kinds}; "
            f"largest temporary {_size(estimate.largest_temporary)})")


def oom_advice(estimate: MemoryEstimate, step: Step | Callable[..., Any]) -> str:
    """What filled the memory and the one-line changes that shrink the largest kinds, for
    the stack of ``step`` (appended to an out-of-memory error, or printed before training)."""
    names = {t.name: dict(t.options) for t in lift(step).transforms}
    fixes: list[str] = []
    kinds = estimate.kinds()
    for kind in kinds:
        if kind == "activations" or (kind == "temporaries" and estimate.phase != "optimizer"):
            acc = names.get("with_accumulation")
            n = int(acc["n"]) if acc else 1
            if not (acc and acc.get("adaptive")):
                fixes.append(f"with_accumulation({2 * n}) or with_accumulation({n}, "
                             "adaptive=True) (same update, smaller micro-batches)")
            if "checkpointed" not in names:
                fixes.append("checkpointed (recompute block activations in backward) or "
                             "checkpointed(offload='cpu')")
            if "with_amp" not in names and "with_float8" not in names:
                fixes.append("with_amp (bf16 activations take half the memory)")
            if kind == "temporaries":
                fixes.append("linear_cross_entropy for a language model's loss (no full "
                             "logits)")
        elif kind in ("optimizer state", "gradients", "parameters"):
            strategy = names.get("distributed", {}).get("strategy")
            if strategy not in ("fsdp", "hsdp"):
                fixes.append("distributed(strategy='fsdp') (parameters, gradients and "
                             "optimizer state sharded over the processes)")
            if kind == "optimizer state":
                fixes.append("an optimizer with less state (SGD with momentum, Adafactor) or "
                             "foreach=False (no temporaries the size of all parameters)")
    unique = list(dict.fromkeys(fixes))
    return f"{format_estimate(estimate)}. Try: {'; '.join(unique[:5]) or 'a smaller batch'}"


# ----------------------------------------------------------------------------- tracing
class _Live(compat.DispatchMode):  # type: ignore[misc,no-untyped-call]  # untyped in torch
    """Every storage the operators make, alive until its last reference goes; the peak of
    their bytes (``at_peak``: called with what is alive the first time the live bytes reach
    ``target``, a peak measured before)."""

    def __init__(self, fake: bool, target: int = -1,
                 at_stop: Callable[[dict[int, int]], None] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.fake = fake
        self.live: dict[int, int] = {}
        self.total = 0
        self.peak = 0
        self.target = target
        self.at_stop = at_stop

    def add(self, tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = size
        self.total += size
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        size = self.live.pop(key, None)
        if size is not None:
            self.total -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if self.fake and func is compat.local_scalar:  # .item() of a fake tensor: no value
            return _answer(args[0])
        out = func(*args, **(kwargs or {}))
        for leaf in compat.leaves(out):
            if isinstance(leaf, Tensor):
                self.add(leaf)
        if self.total > self.peak:
            self.peak = self.total
            if self.at_stop is not None and self.peak >= self.target:
                self.at_stop(dict(self.live))
                self.at_stop = None
        return out


def _answer(tensor: Tensor) -> bool | int | float:
    """What a host read of a fake value answers: 0 (a finite value, a flag not set: the
    update is applied), but 1 for an optimizer's step count (its bias corrections divide by
    ``1 - beta ** step``)."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            break
        if f"torch{os.sep}optim{os.sep}" in frame.f_code.co_filename:
            return 1.0 if tensor.is_floating_point() else 1
        frame = frame.f_back  # type: ignore[assignment]
    if tensor.dtype == torch.bool:
        return False
    return 0.0 if tensor.is_floating_point() else 0


def _fake_state(state: TrainState, mode: Any) -> TrainState:
    """A TrainState of fake tensors with the model, optimizers and their state of ``state``
    (schedulers left out: they keep no tensors)."""
    memo: dict[int, Any] = {}
    model = state.model
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(compat.fake_of(mode, p.detach()),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = compat.fake_of(mode, b)
    for optimizer in state.optimizers:
        for entry in optimizer.state.values():
            for value in entry.values():
                if isinstance(value, Tensor):
                    memo[id(value)] = compat.fake_of(mode, value)
    fake_model = copy.deepcopy(model, memo)
    optimizers = []
    for optimizer in state.optimizers:
        copied = copy.deepcopy(optimizer, memo)
        copied.__dict__.pop("step", None)  # a scheduler's wrapper of the original's step
        optimizers.append(copied)
    fake = TrainState(fake_model, optimizers)
    count = state.get_slot("accumulation")  # the micro-batch count adaptive accumulation found
    if count is not None and hasattr(count, "count"):
        fake.slot("accumulation", lambda: copy.copy(count))
    return fake


def _fakes(mode: Any) -> Iterator[Tensor]:
    for obj in gc.get_objects():
        if compat.is_fake(obj) and getattr(obj, "fake_mode", None) is mode:
            yield obj  # type: ignore[misc]


def _storage_keys(tensors: Iterator[Tensor | None] | list[Tensor | None]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, Tensor)}


def estimate_memory(step: Step | Callable[..., Any], state: TrainState, batch: Batch, *,
                    world_size: int | None = None) -> MemoryEstimate:
    """The peak memory of one update of ``step`` on ``batch``, by kind, without allocating.

    Equivalent to measuring the peak of live tensor storage during ``step(state, batch)``
    after a first update (so the optimizer's state exists), but traced with fake tensors:
    nothing is allocated on the device and ``state`` is not changed. ``batch`` is one
    process's batch; ``world_size`` (default: the running process group's, else 1) divides
    the sharded kinds under ``distributed(strategy='fsdp')``. Call it before training.
    """
    step = lift(step)
    if not isinstance(state, TrainState):
        raise TypeError(f"estimate_memory(step, state, batch) takes an accelfn.TrainState, got "
                        f"{type(state).__name__}")
    if world_size is None:
        dist = torch.distributed
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
            else 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"estimate_memory(world_size={world_size!r}) takes an int >= 1")
    names = {t.name: dict(t.options) for t in step.transforms}
    sharded = names.get("distributed", {}).get("strategy") in ("fsdp", "hsdp")
    traced = Step(step.fn, tuple(t for t in step.transforms if t.name not in _LEFT_OUT))
    mode = compat.fake_mode()
    with mode:
        fake = _fake_state(state, mode)
        fake_batch = _fake_batch(batch, mode)
        with _Live(fake=True):
            traced(fake, fake_batch)  # the first update makes the optimizer's state
        before = list(_fakes(mode))
        first = _Live(fake=True)
        for t in before:
            first.add(t)
        with first:
            traced(fake, fake_batch)
        seen: dict[str, Any] = {}
        saved: set[int] = set()
        phase = ["forward"]

        def pack(t: Tensor) -> Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in saved:  # forgotten when freed: its address is reused
                saved.add(storage._cdata)
                weakref.finalize(storage, saved.discard, storage._cdata)
            return t

        def at_peak(live: dict[int, int]) -> None:
            seen["live"] = live
            seen["phase"] = "backward" if compat.in_backward() else phase[0]
            params = list(fake.model.parameters())
            seen["parameters"] = _storage_keys([*params, *fake.model.buffers()])
            seen["gradients"] = _storage_keys([p.grad for p in params])
            seen["optimizer"] = _storage_keys([v for o in fake.optimizers
                                               for entry in o.state.values()
                                               for v in entry.values()])
            seen["saved"] = set(saved)

        second = _Live(fake=True, target=first.peak, at_stop=at_peak)
        for t in _fakes(mode):
            second.add(t)
        hooks = _phase_hooks(fake, phase)
        try:
            with second, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                traced(fake, fake_batch)
        finally:
            for hook in hooks:
                hook.remove()
    return _by_kind(seen, first.peak, world_size if sharded else 1, world_size)


def estimate_script(path: str | os.PathLike[str]) -> MemoryEstimate:
    """The estimate of a training script's update: the script (run as a module, not as
    ``__main__``, so its training does not start) defines ``memory_case()`` returning
    ``(step, state, batch)``; what ``accelfn doctor --memory SCRIPT`` shows."""
    import runpy
    import sys

    # its folder first on the path, as `python SCRIPT` puts it (the examples import siblings)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        found = runpy.run_path(os.fspath(path), run_name="accelfn_memory_case")
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    case = found.get("memory_case")
    if not callable(case):
        raise ValueError(f"{os.fspath(path)} defines no memory_case(): add a function "
                         "memory_case() that returns (step, state, batch) for one update, "
                         "built as the script's training builds them")
    made = case()
    if not isinstance(made, tuple) or len(made) != 3:
        raise ValueError(f"memory_case() of {os.fspath(path)} returned {type(made).__name__}; "
                         "return (step, state, batch)")
    return estimate_memory(*made)


def _phase_hooks(state: TrainState, phase: list[str]) -> list[Any]:
    """Hooks that mark the optimizer's step (the backward is autograd's own)."""
    return [o.register_step_pre_hook(lambda *a: phase.__setitem__(0, "optimizer"))
            for o in state.optimizers]


def _fake_batch(batch: Batch, mode: Any) -> Batch:
    if isinstance(batch, Tensor):
        return compat.fake_of(mode, batch)
    if isinstance(batch, Mapping) or hasattr(batch, "apply"):
        apply = getattr(batch, "apply", None)
        if apply is not None:
            return apply(lambda t: compat.fake_of(mode, t))  # type: ignore[no-any-return]
        return {k: _fake_batch(v, mode) if isinstance(v, (Tensor, Mapping)) else v
                for k, v in batch.items()}
    return batch


def _by_kind(seen: dict[str, Any], peak: int, shards: int, world_size: int) -> MemoryEstimate:
    live: dict[int, int] = seen.get("live", {})
    total = {"parameters": 0, "gradients": 0, "optimizer": 0, "saved": 0}
    rest: list[int] = []
    for key, size in live.items():
        for kind in ("parameters", "gradients", "optimizer", "saved"):
            if key in seen[kind]:
                total[kind] += size
                break
        else:
            rest.append(size)
    sharded = {k: total[k] // shards for k in ("parameters", "gradients", "optimizer")}
    saving = sum(total[k] - sharded[k] for k in sharded)
    return MemoryEstimate(
        parameters=sharded["parameters"], gradients=sharded["gradients"],
        optimizer_state=sharded["optimizer"], activations=total["saved"],
        temporaries=sum(rest), largest_temporary=max(rest, default=0),
        peak=peak - saving, phase=seen.get("phase", "forward"), world_size=world_size)
