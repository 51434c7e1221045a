"""The non-finite guard: the decision that skips updates with NaN/Inf loss or gradients
(``with_nonfinite``'s options, the decision ``decide``, and the counters in the TrainState).

Every step has one: the engine's default is ``NonFinite()`` (``policy="skip",
max_consecutive=10``), and ``accelfn.with_nonfinite`` fills the place with other options.

The decision is taken on the gradients the optimizer will apply: it reuses clipping's norm,
or fp16's overflow flag when no gradient transform wrote the gradients after unscaling, and
checks the gradients itself otherwise. With a fused optimizer the skip happens on the device and the
flags are read one update later (:meth:`Guard.settle`); otherwise they are read before the
optimizer step (one host read per update).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import compat
from ..core.contexts import CallContext, UpdateContext
from ..core.state import TrainState
from ..core.syncs import GUARD_READ, deferred_read, labelled_read

__all__ = ["POLICIES", "Decision", "Guard", "NonFinite", "NonFiniteError", "Pending", "abort",
           "decide", "device_flags", "schedule"]

POLICIES = ("skip", "raise", "off")
SLOT = "nonfinite"
SkipIf = Callable[[Tensor, list[Tensor]], Tensor]


@dataclass(frozen=True, slots=True, repr=False)
class NonFinite:
    """``with_nonfinite``'s options: the ``policy`` (skip, raise, off), the updates in a row
    skipped before raising (``max_consecutive``), the user's ``skip_if(loss, grads)`` verdict,
    and ``advance`` (a skipped update still steps the schedulers and averages the EMA)."""

    policy: str = "skip"
    max_consecutive: int = 10
    skip_if: SkipIf | None = None
    advance: bool = False

    def __post_init__(self) -> None:
        policy, limit, skip_if = self.policy, self.max_consecutive, self.skip_if
        if policy not in POLICIES:
            raise ValueError(f"with_nonfinite(policy={policy!r}) is unknown; use one of "
                             f"{POLICIES}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"with_nonfinite(max_consecutive={limit!r}) must be an int >= 1")
        if skip_if is not None and not callable(skip_if):
            raise TypeError(f"with_nonfinite(skip_if={skip_if!r}) takes a function "
                            "skip_if(loss, grads) -> device bool tensor")

    def __repr__(self) -> str:
        extra = (", skip_if" if self.skip_if is not None else "") + (
            ", skipped=advance" if self.advance else "")
        if self.policy == "skip":
            return f"with_nonfinite(skip, max_consecutive={self.max_consecutive}{extra})"
        return f"with_nonfinite({self.policy}{extra})"


@dataclass(frozen=True, slots=True)
class Decision:
    """The non-finite decision of an update.

    ``skip`` is the decision taken on the host; or None to leave it to the device: then
    ``flags`` is a device bool tensor and the optimizer skips on ``flags.any()`` through its
    ``found_inf`` input (fused optimizers only), the guard settling its counters later
    (``TrainState.sync``). ``checked=False`` says nothing was checked: the update is applied
    and no ``skipped`` metric is reported.
    """

    skip: bool | None = False
    flags: Tensor | None = None
    checked: bool = True

    def __post_init__(self) -> None:
        if self.skip is None and self.flags is None:
            raise ValueError("Decision(skip=None) leaves the decision to the device and needs "
                             "the device flags: Decision(None, flags=...)")


@dataclass(frozen=True, slots=True)
class Pending:
    """A decision left to the device, read one update later: its flags (copied to host
    memory as they are computed), the CUDA event marking the copy, the update it decided,
    and the options it was taken with."""

    host: Tensor
    event: torch.cuda.Event | None
    update: int
    options: NonFinite


_PROCEED, _SKIP = Decision(False), Decision(True)  # decisions are values: these suffice
_UNCHECKED = Decision(checked=False)


_BUFFERS = (
    "buffers the forward updated, such as BatchNorm running statistics, are as the forward "
    "left them, as with torch.amp.GradScaler (if they are non-finite now, reset them with "
    "module.reset_running_stats() or resume from a checkpoint).")
_REFUSED = (
    "the update was not applied: parameters, optimizer state, scheduler, carry, EMA weights and "
    "loss scale are unchanged and the gradients were cleared; " + _BUFFERS)


class NonFiniteError(FloatingPointError):
    """Raised when the non-finite policy says a NaN/Inf loss or gradient must stop training."""


class Guard:
    """State of the non-finite guard: skipped updates in total and in a row."""

    def __init__(self) -> None:
        self.skipped = 0
        self.consecutive = 0
        self._pending: Pending | None = None

    def decide(self, flags: list[bool], update: int, policy: str, limit: int) -> bool:
        if not any(flags):  # the common case: nothing to count
            self.consecutive = 0
            return False
        return self._account(*_unpack_flags(flags), update, policy, limit)

    def defer(self, flags: Tensor, update: int, options: NonFinite) -> None:
        """Keep the device's decision of ``update`` to read at the next update."""
        event = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        else:
            host = flags
        self._pending = Pending(host, event, update, options)

    def forget(self, update: int) -> None:
        """Drop a decision deferred by ``update`` when that update failed (it applied
        nothing: the decision must not count it nor step the scheduler for it)."""
        if self._pending is not None and self._pending.update == update:
            self._pending = None

    def settle(self, state: TrainState) -> None:
        """Apply a deferred decision: count it, step the scheduler if the update was real."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        update, options = pending.update, pending.options
        with deferred_read():  # copied to pinned memory one update ago: no device wait
            if pending.event is not None:
                pending.event.synchronize()
            values = pending.host.tolist()
        skipped = self._account(*_unpack_flags(values), update, options.policy,
                                options.max_consecutive, done=True)
        try:
            schedule(options, state, skipped, settled=True)
        except BaseException as error:
            error.add_note(_settle_failed(update))
            raise

    def _account(self, loss_bad: bool, grads_bad: bool, overflow: bool, custom: bool,
                 update: int, policy: str, limit: int, done: bool = False) -> bool:
        """Count a bad update as skipped, or raise. A refused update is not counted (the call
        fails and leaves the guard as it was) unless ``done``: skipped on the device already.
        ``custom``: the ``skip_if`` check said to skip."""
        if not (loss_bad or grads_bad or overflow or custom):
            self.consecutive = 0
            return False
        if (overflow and not loss_bad) or policy == "off":
            # an fp16 overflow: the loss scale backs off, it is not divergence
            self.skipped += 1
            return True
        what = ("a non-finite loss" if loss_bad else "non-finite gradients" if grads_bad
                else "skip_if(loss, grads) true")
        if policy == "raise":  # decided on the host, never deferred: nothing was skipped
            raise NonFiniteError(
                f"{what} at update {update}; {_REFUSED} Lower the learning rate, clip "
                "gradients, or use with_nonfinite(policy='skip') to skip such updates")
        in_a_row = self.consecutive + 1
        if in_a_row < limit or done:
            self.skipped += 1
            self.consecutive = in_a_row
        if in_a_row >= limit:
            state = ("the last was skipped on the device; " + _BUFFERS if done
                     else f"the last was refused: {_REFUSED}")
            raise NonFiniteError(
                f"{in_a_row} updates in a row had {what} (the last at state.step == "
                f"{update}, counted from 0); training diverged: {state} Lower the learning "
                "rate or check the data")
        return True

    def state_dict(self) -> dict[str, int]:
        if self._pending is not None:
            raise RuntimeError("call state.sync() before saving (a decision is pending)")
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.skipped, self.consecutive = int(saved["skipped"]), int(saved["consecutive"])
        self._pending = None


def _settle_failed(update: int) -> str:
    return (f"accelfn: the scheduler step of update {update} raised when its deferred skip "
            f"decision was settled (a fused optimizer's flags are read one update later, by the "
            f"next call or state.sync()). Update {update} was applied and counted; its "
            "scheduler step did not run, as when a scheduler raises after an update decided "
            "on the host. This call applied nothing (its gradients were cleared): call it "
            "again, with the same batch")


def _unpack_flags(values: list[bool]) -> tuple[bool, bool, bool, bool]:
    return (values[0], values[1], values[2] if len(values) > 2 else False,
            values[3] if len(values) > 3 else False)


def grads_nonfinite(grads: list[Tensor], device: torch.device) -> Tensor:
    """A device flag: does any gradient hold NaN or Inf (one fused pass, values unchanged)."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    if not grads:
        return found.bool()
    one = torch.ones((), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        if g.layout != torch.strided:  # sparse (nn.Embedding(sparse=True)): its values
            g = _values(g)
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group in groups.items():
        flag = found if dev == device else torch.zeros((), device=dev)
        compat.non_finite_check_and_unscale_(group, flag, one.to(dev))
        if flag is not found:
            found += flag.to(device)
    return found > 0


def _values(grad: Tensor) -> Tensor:
    """The values a sparse gradient applies, as GradScaler checks them: duplicates of a COO
    gradient summed (``coalesce``), the stored values of a compressed one."""
    if grad.layout == torch.sparse_coo:
        return grad.coalesce().values()
    return grad.values()


Evidence = list[tuple[Tensor, bool]]  # (tensor, is_flag): a value is bad when non-finite


def _evidence(ctx: UpdateContext, overflow: Tensor | None, norm: Tensor | None,
              current: bool, check: bool) -> Evidence:
    """[loss, gradients] (and ``overflow``, the loss scaler's flag, when it reported): each a
    value that is bad when non-finite, or a flag that is bad when nonzero. ``current``: the
    overflow flag describes the gradients as they are now; ``norm``: their total norm."""
    if not check:
        assert overflow is not None
        zero = torch.scalar_tensor(0.0, device=ctx.device)
        return [(zero, False), (zero, False), (overflow, True)]
    loss = (ctx.loss, False)
    if overflow is not None and current:  # unscaling checked the gradients as they are
        return [loss, (overflow, True), (overflow, True)]
    # a NaN/Inf gradient makes the total norm NaN/Inf
    grads = (norm, False) if norm is not None else (
        grads_nonfinite(ctx.local_grads(), ctx.device), True)
    return [loss, grads] if overflow is None else [loss, grads, (overflow, True)]


def _device_flags(evidence: Evidence, device: torch.device) -> Tensor:
    # x * 0 is NaN exactly when x is NaN or +-Inf: two kernels where isfinite takes four
    return torch.stack([t.to(device).ne(0) if is_flag else t.float().mul(0).ne(0)
                        for t, is_flag in evidence])


def _host_flags(evidence: Evidence) -> list[bool]:
    with labelled_read(GUARD_READ):
        values = torch.stack([t for t, _ in evidence]).tolist()  # the one host read
    return [v != 0 if is_flag else not math.isfinite(v)
            for v, (_, is_flag) in zip(values, evidence)]


def _collected(options: NonFinite, ctx: UpdateContext, overflow: Tensor | None,
               norm: Tensor | None, current: bool) -> Evidence | None:
    """What the decision reads (None: nothing is checked, the update is applied)."""
    policy, skip_if = options.policy, options.skip_if
    if policy == "off" and overflow is None and skip_if is None:
        return None
    if overflow is None and policy == "off":  # only skip_if decides
        overflow = torch.zeros((), dtype=torch.bool, device=ctx.device)
    evidence = _evidence(ctx, overflow, norm, current, check=policy != "off")
    if skip_if is not None:  # the user's verdict, a device bool, at a place of its own
        if len(evidence) < 3:
            evidence.append((torch.zeros((), dtype=torch.bool, device=ctx.device), True))
        evidence.append((_verdict(skip_if, ctx), True))
    return evidence


def device_flags(options: NonFinite, ctx: UpdateContext, norm: Tensor | None) -> Tensor | None:
    """The decision's flags of a one-process update without loss scaling, left on the device
    (None: nothing is checked), with no host read and no change to the guard: what a
    captured update records; its guard defers them after each replay."""
    evidence = _collected(options, ctx, None, norm, True)
    return None if evidence is None else _device_flags(evidence, ctx.device)


def decide(options: NonFinite, ctx: UpdateContext, overflow: Tensor | None,
           norm: Tensor | None, current: bool) -> Decision:
    """The update's decision: fp16's ``overflow`` flag (``current``: no gradient transform
    wrote the gradients after it) and clipping's ``norm`` when it describes the gradients as
    the optimizers will see them (None otherwise: the gradients are checked here)."""
    policy, limit = options.policy, options.max_consecutive
    guard = ctx.state.slot(SLOT, Guard)
    if guard._pending is not None:
        guard.settle(ctx.state)  # the previous update's deferred decision
    evidence = _collected(options, ctx, overflow, norm, current)
    if evidence is None:
        return _UNCHECKED
    on_device = ctx.prepared.skips_on_device and policy != "raise"
    if ctx.distributed is None and not on_device:  # judged on the host, value by value
        flags = _host_flags(evidence)
        return _SKIP if guard.decide(flags, ctx.state.step, policy, limit) else _PROCEED
    device_flags = _device_flags(evidence, ctx.device)
    if ctx.distributed is not None:  # every process takes the same decision
        reduced = device_flags.to(torch.int32)
        dist.all_reduce(reduced, dist.ReduceOp.MAX, group=ctx.distributed)
        device_flags = reduced.bool()
    if on_device:
        guard.defer(device_flags, ctx.state.step, options)
        return Decision(None, flags=device_flags)
    with labelled_read(GUARD_READ):
        flags = device_flags.tolist()
    return _SKIP if guard.decide(flags, ctx.state.step, policy, limit) else _PROCEED


def schedule(options: NonFinite, state: TrainState, skip: bool | None,
             settled: bool = False) -> None:
    """Step the schedulers for an update, the one place they are stepped: after an applied
    update; after a skipped one too with ``advance`` (as loops stepping them unconditionally);
    for a decision left to the device (``skip`` None), when the next update or
    ``TrainState.sync()`` settles it (``settled``), unless ``advance`` stepped them already."""
    if options.advance:
        if not settled:
            state.step_scheduler()
    elif skip is False:
        state.step_scheduler()


def abort(ctx: CallContext) -> None:
    """After a failed call: forget a decision it deferred (no update to settle)."""
    guard = ctx.state.get_slot(SLOT)
    if isinstance(guard, Guard):
        guard.forget(ctx.state.step)


def _verdict(skip_if: SkipIf, ctx: UpdateContext) -> Tensor:
    flag = skip_if(ctx.loss, ctx.grads())
    if not isinstance(flag, Tensor) or flag.numel() != 1:
        raise TypeError(f"with_nonfinite(skip_if=...) returned {flag!r}; return a one-element "
                        "device tensor (a bool, e.g. loss > 10), not a Python value: reading it "
                        "on the host would wait for the device")
    return flag.reshape(()).to(device=ctx.device, dtype=torch.bool)
