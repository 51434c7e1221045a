"""The checks a step makes when it is built and prepared, and its out-of-memory advice."""

from __future__ import annotations

import torch

from ..core.state import TrainState
from ..parts.accumulation import FINEST_SPLIT
from ..parts.averaging import EVALUATE_OPTIONS, Averaging
from .extension import Transform
from .spec import Spec

__all__ = ["after_update_failed", "check_evaluate_options", "check_optimizer_holds_trainable",
           "check_state", "optimizer_failed", "optimizer_out_of_memory", "out_of_memory"]


def check_optimizer_holds_trainable(state: TrainState) -> None:
    held = {id(p) for o in state.optimizers for g in o.param_groups for p in g["params"]}
    missing = [n for n, p in state.model.named_parameters() if p.requires_grad
               and id(p) not in held]
    if missing:
        state.warn_once("missing", (
            f"{len(missing)} trainable parameter(s) of the model are not in the optimizer "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): they get "
            "gradients that nothing applies or clears, every update. Add them to the "
            "optimizer, or freeze them with requires_grad_(False) (accelfn.freeze)"))


def check_state(state: object) -> None:
    """Refuse a call whose state is not a TrainState."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"a step is called as step(state, batch) with an accelfn.TrainState, got "
            f"{type(state).__name__}")


def check_evaluate_options(averaging: Averaging | None, options: dict[str, object]) -> None:
    """Refuse ``evaluate()`` options that no transform of the step takes."""
    known = () if averaging is None else EVALUATE_OPTIONS
    unknown = sorted(set(options) - set(known))
    if unknown:
        offered = ", ".join(f"{o!r} (with_ema)" for o in sorted(known)) or "none"
        raise TypeError(f"evaluate() got unknown option(s) {unknown}; this step offers "
                        f"{offered}")




def out_of_memory(text: str, transforms: tuple[Transform, ...], spec: Spec,
                  error: BaseException) -> torch.OutOfMemoryError:
    """The advice for running out of memory in the forward or backward of the stack
    ``text``, ending in the allocator's own message (``error``'s)."""
    split = [t for t in transforms if t.part is spec.accumulation]
    options = dict(split[0].options) if split else {}
    n = int(options.get("n", 1))
    finest = getattr(error, FINEST_SPLIT, None)
    advice = []
    if finest is not None:
        where = (f"; with_accumulation(adaptive=True) already split the batch into {finest} "
                 f"micro-batch{'es' if finest != 1 else ''} of one sample each, so more "
                 "micro-batches cannot help")
    elif options.get("adaptive"):
        where = ("; with_accumulation(adaptive=True) retries with more micro-batches by "
                 "itself, and did not this time (another process failed)")
    else:
        where = ""
        advice.append(f"with_accumulation({2 * n}) (same update, half the activations)")
    if spec.checkpointing is None:
        advice.append("checkpointed (recompute block activations in backward)")
    if spec.precision is None and spec.float8 is None:
        advice.append("with_amp (bf16 activations take half the memory)")
    if finest is None:
        advice.append("a smaller batch")
    else:
        advice.append("shorter samples (sequence length, image size) or a smaller model; "
                      "distributed(strategy='fsdp') to shard parameters, gradients and "
                      "optimizer state over processes")
    return torch.OutOfMemoryError(
        f"out of memory in {text}{where}; the parameters, optimizer and scheduler are "
        f"unchanged and gradients were cleared (buffers the forward updated, such as BatchNorm "
        f"running statistics, are as it left them). Try: {'; '.join(advice)}. To see what "
        "filled it: accelfn.estimate_memory(step, state, batch) gives one update's peak by "
        "kind, and Monitor(memory_snapshot='oom.json') dumps what was alive at the error. "
        f"({error})")


def optimizer_failed(fresh: bool) -> str:
    """The note on an error the optimizer step raised (``fresh``: its first update)."""
    state = ("the optimizer had no state before this update and has none now; the "
             "parameters are unchanged unless it updated some before failing" if fresh else
             "the parameters and the optimizer's state are as the optimizer left them when it "
             "failed: unchanged if it failed before changing any, else partly updated (resume "
             "from the last checkpoint to be exact)")
    return (f"accelfn: the optimizer step raised; gradients were cleared and any loss scaler "
            f"reset, so the next call works; {state}")


def optimizer_out_of_memory(text: str, error: BaseException,
                            fresh: bool) -> torch.OutOfMemoryError:
    """The advice for running out of memory in the optimizer step, after backward."""
    return torch.OutOfMemoryError(
        f"out of memory in the optimizer step of {text} (after backward: the activations "
        f"are already freed, so a smaller batch or more micro-batches does not help); "
        f"{optimizer_failed(fresh).removeprefix('accelfn: the optimizer step raised; ')}. "
        "Try: foreach=False in the optimizer (its foreach kernels allocate temporaries the "
        "size of all parameters) or fused=True; an optimizer with less state (SGD, Adafactor); "
        f"distributed(...) with FSDP to shard its state over processes; "
        "accelfn.estimate_memory(step, state, batch) shows the optimizer state's share. "
        f"({error})")


def after_update_failed(update: int, skip: bool | None) -> str:
    """The note on an error raised after the optimizer step (scheduler, after-update work)."""
    if skip is True:
        applied = "the update was skipped (parameters and optimizer unchanged)"
    elif skip is False:
        applied = "the optimizer step was applied: parameters were updated, which cannot be undone"
    else:
        applied = ("the optimizer step ran: parameters were updated, which cannot be undone, "
                   "unless it skipped on the device on non-finite gradients")
    return (f"accelfn: this failed after the optimizer step; {applied}, and it counts as "
            f"update {update}. Gradients were cleared and any loss scaler reset, so the next "
            "call works; the scheduler step and after-update work (EMA, loss-scale update) "
            "that had not run yet did not run for this update")
