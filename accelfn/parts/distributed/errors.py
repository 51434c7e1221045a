"""torch.distributed's common failures said in accelfn's terms, the original kept as the cause.

DDP's unused-parameter error names DDP's own keyword, gloo and NCCL report a process that
never arrived as a transport timeout (one that exited as a closed connection), and processes
that built different models fail in DDP's shape check with parameter indices.
:func:`translate` recognises these by their text and returns a :class:`DistributedError`
saying what happened and which accelfn option or habit fixes it; the ``distributed``
transform raises it ``from`` the original wherever it runs torch.distributed's code (wrapping
the model, each micro-batch's forward, the weight all-reduce). torch has no structured error
codes for these, so the recognition is by text, and anything not recognised passes through
unchanged. A timeout or a lost process also names the collective and the ranks that never
arrived (:func:`accelfn.core.hangs.name_hang`: this process's Flight Recorder entry, and the
word the processes leave each other in the store), and dumps the Flight Recorder for
``accelfn doctor --hang`` when ``init_distributed(hang_dir=...)`` asked for it.
"""

from __future__ import annotations

import re
from types import TracebackType
from typing import Any

from torch import nn

from ...core import hangs

__all__ = ["DistributedError", "Translating", "translate"]


class DistributedError(RuntimeError):
    """A torch.distributed failure, explained; the original error is its ``__cause__``.

    ``kind`` says which: ``"unused_parameters"``, ``"shape_mismatch"``, ``"timeout"``,
    ``"process_lost"`` (another process's connection closed: it failed or exited) or
    ``"mixed_dtensor"`` (a tensor-parallel parameter used outside its module's call).
    """

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


_UNUSED = "Expected to have finished reduction in the prior iteration"
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: "
                             r"([\d ]+)")
_UNUSED_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+: ([^\n]+)")
_SHAPES = ("appears not to match sizes of the same param in process",
           "DDP expects same model across all ranks",
           "Detected mismatch between collectives on ranks",
           "op.preamble.length <= op.nbytes")
_TIMEOUTS = hangs.TIMEOUT_TEXTS
_LOST = hangs.LOST_TEXTS
_MIXED = "got mixed torch.Tensor and DTensor"
_MILLISECONDS = re.compile(r"(?:waiting |Timeout\(ms\)=|after )(\d+) ?ms")


def _unused_names(text: str, model: nn.Module | None) -> list[str]:
    """The unused parameters' names, from DDP's message (by name, or by index into the
    model's trainable parameters in DDP's order)."""
    named = _UNUSED_NAMES.search(text)
    if named:  # DDP names them inside the module it wraps, which holds the model as "module"
        return [name.strip().removeprefix("module.") for name in named.group(1).split(",")
                if name.strip()]
    indices = _UNUSED_INDICES.search(text)
    if not indices:
        return []
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if not isinstance(inner, nn.Module):
        return [f"index {i}" for i in indices.group(1).split()]
    names = [name for name, p in inner.named_parameters() if p.requires_grad]
    return [names[int(i)] if int(i) < len(names) else f"index {i}"
            for i in indices.group(1).split()]


def _unused(text: str, model: nn.Module | None) -> str:
    names = _unused_names(text, model)
    which = f" ({', '.join(names)})" if names else ""
    return (
        f"some parameters got no gradient in the previous update{which}, and DDP waits for "
        "every parameter's gradient: build the step with "
        "af.distributed(find_unused_parameters=True) (DDP then finds them at every update, "
        "at some cost), or make the loss use every trainable parameter, or freeze those that "
        "take no part with requires_grad_(False) before the first step"
    )


def _shapes(where: str) -> str:
    return (
        f"the processes disagree on the shapes of a collective's tensors{where}: every process "
        "must build the same model (the same layers and shapes, none sized from the rank or "
        "from data that only one process read) before the step wraps it, and pass tensors of "
        "the same shapes to each collective (the same metric keys to reduce_metrics)"
    )


def _timeout(text: str, where: str) -> str:
    waited = _MILLISECONDS.search(text)
    how_long = f" {int(waited.group(1)) / 1000:g} s" if waited else ""
    return (
        f"a collective waited{how_long} for another process{where} and timed out (the process "
        "group's timeout): another process did not get there. Look first for an error in the "
        "other processes' output (this one only waited for them). Otherwise the processes "
        "ran different collectives: a different number of steps (shard the data so that every "
        "process gets as many batches: accelfn.data.from_dataloader or loader() under "
        "torchrun), or evaluation, metric reduction or a checkpoint on one process only "
        "(every process calls them); or one is slower than the timeout (a first compile, "
        "loading): pass a longer timeout= to torch.distributed.init_process_group (or "
        "accelfn.init_distributed)" + _named()
    )


def _mixed(text: str, where: str) -> str:
    op = text.split(":", 1)[0].strip()
    return (
        f"{op} got a sharded tensor (DTensor) and a plain one{where}: the step function used "
        "a tensor-parallel layer's parameter directly (e.g. F.linear(h, model.head.weight) "
        "with head in tensor_parallel=...), or a tensor made from one, outside the module's "
        "own call, where its inputs and outputs are redistributed. Call the module itself "
        "(model.head(h)), or leave that layer out of the tensor-parallel plan (FSDP2 alone "
        "gathers it for the whole step function)"
    )


def _lost(where: str) -> str:
    return (
        f"another process left the run{where} (its connection closed): look for its error in "
        "its own output; this process only lost it" + _named()
    )


def _named() -> str:
    """What this process knows of the hung collective (under a process group), as a
    sentence to append."""
    hang = hangs.name_hang()
    return f". Where: {hang.describe()}" if hang is not None else ""


def translate(error: BaseException, *, model: nn.Module | None = None,
              where: str = "") -> DistributedError | None:
    """The :class:`DistributedError` explaining ``error``, or None when it is not one of the
    torch.distributed failures it knows (unused parameters under DDP, processes disagreeing
    on shapes, a collective's timeout, a process lost). ``model`` (the model DDP
    synchronises) names unused parameters; ``where`` (e.g. ``" while wrapping the model"``)
    places the failure."""
    if not isinstance(error, RuntimeError) or isinstance(error, DistributedError):
        return None
    text = str(error)
    if _UNUSED in text:
        return DistributedError(_unused(text, model), "unused_parameters")
    if any(pattern in text for pattern in _SHAPES):
        return DistributedError(_shapes(where), "shape_mismatch")
    if any(pattern in text for pattern in _TIMEOUTS):
        return DistributedError(_timeout(text, where), "timeout")
    if any(pattern in text for pattern in _LOST):
        return DistributedError(_lost(where), "process_lost")
    if _MIXED in text:
        return DistributedError(_mixed(text, where), "mixed_dtensor")
    return None


class Translating:
    """A context raising :func:`translate`'s error ``from`` a known torch.distributed failure
    inside it; ``inner``, a context entered within it (DDP's ``no_sync``), may be None."""

    __slots__ = ("inner", "model", "where")

    def __init__(self, inner: Any = None, *, model: nn.Module | None = None,
                 where: str = "") -> None:
        self.inner = inner
        self.model = model
        self.where = where

    def __enter__(self) -> None:
        if self.inner is not None:
            self.inner.__enter__()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        if self.inner is not None and self.inner.__exit__(kind, error, traceback):
            return True
        if error is not None:
            translated = translate(error, model=self.model, where=self.where)
            if translated is not None:
                raise translated from error
        return False
