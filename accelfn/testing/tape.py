"""TapeRecorder: a CUDA graph's semantics on the CPU, to test captured steps without a GPU.

A CUDA graph replays the device work it recorded, on the same memory, and none of the
Python that issued it. The tape does the same with torch's operators: ``record`` runs a
function once with every aten operator it dispatches written down (the tensors it read
and wrote, the tensors it made), then puts back every tensor that existed before and that
the function wrote, and the random number generator's state (a recording applies nothing,
as a capture); ``replay(i)`` runs the ``i``-th recording's operators again on the same
tensors, each writing its results into the tensors it made when recorded (the same
memory), so a later recording reads an earlier one's results as on a GPU. Python state the
function changed is changed once, at the recording, as under CUDA graphs: a step whose
update depends on it differs from its eager run on the tape too.

Not recorded: operators that run no aten operator (inductor's compiled kernels: under a
recording torch.compile runs the model eagerly) and the profiler's markers. A host read
(an operator whose output is a Python number, ``.item()``) is refused, as a capture fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..core import compat
from ..parts.capture import host_read_error

__all__ = ["TapeRecorder"]

T = TypeVar("T")
_Entry = tuple[Any, Any, Any, list[Any]]  # (operator, args, kwargs, outputs flattened)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _written(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors ``op`` writes into (its schema's ``Tensor(a!)`` arguments)."""
    out: list[Tensor] = []
    for i, argument in enumerate(compat.op_schema(op).arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        out.extend(t for t in _leaves(value) if isinstance(t, Tensor))
    return out


class TapeRecorder:
    """Records a call's aten operators and replays them on the same tensors (see the module).
    ``replays`` counts the replays; ``operators`` is the length of the tape."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._tapes: list[list[_Entry]] = []
        self._made: dict[int, Tensor] = {}  # every tensor made while recording, kept alive
        self.replays = 0

    @property
    def operators(self) -> int:
        return sum(len(tape) for tape in self._tapes)

    def warming(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record(self, fn: Callable[[], T]) -> T:
        tape: list[_Entry] = []
        made: dict[int, Tensor] = {}
        saved: dict[int, tuple[Tensor, Tensor]] = {}  # what the recording wrote: put back

        def handle(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if op.namespace == "profiler":  # markers: no device work
                return op(*args, **kwargs)
            error = host_read_error(op, args, kwargs)
            if error is not None:
                raise error
            for tensor in _written(op, args, kwargs):
                root = tensor if tensor._base is None else tensor._base
                if id(root) not in made and id(root) not in self._made and id(
                        root) not in saved:
                    saved[id(root)] = (root, root.detach().clone())
            result = op(*args, **kwargs)
            outputs = _leaves(result)
            if any(o is not None and not isinstance(o, Tensor) for o in outputs):
                raise RuntimeError(f"TapeRecorder: {op} returned a Python value, a host read "
                                   "that a replay cannot repeat")
            for o in outputs:
                if isinstance(o, Tensor):
                    made[id(o)] = o
            tape.append((op, args, kwargs, outputs))
            return result

        rng = torch.get_rng_state()
        try:
            with compat.aten_interceptor(handle), _capturing_optimizers():
                out = fn()
        finally:
            with torch.no_grad():
                for tensor, before in saved.values():
                    tensor.copy_(before)
            torch.set_rng_state(rng)
        self._tapes.append(tape)
        self._made.update(made)
        return out

    def replay(self, index: int) -> None:
        """Run the ``index``-th recording's operators again, each writing its outputs into
        the tensors it made when recorded (the same memory, as a graph's replay)."""
        with torch.no_grad():
            for op, args, kwargs, outputs in self._tapes[index]:
                result = op(*args, **kwargs)
                for old, new in zip(outputs, _leaves(result)):
                    if isinstance(old, Tensor) and not _same_memory(old, new):
                        old.copy_(new)
        self.replays += 1


@contextlib.contextmanager
def _capturing_optimizers() -> Iterator[None]:
    """An optimizer's step inside the recording refused unless its groups are capturable, as
    torch refuses it while a CUDA stream captures (its check looks for a capturing stream of
    an accelerator, which the CPU has not)."""
    name = compat.OPTIMIZER_CAPTURE_CHECK
    if name is None:
        yield
        return
    check = getattr(torch.optim.Optimizer, name)

    def capturing(self: torch.optim.Optimizer) -> None:
        if not all(group.get("capturable", False) for group in self.param_groups):
            raise RuntimeError(f"Attempting graph capture of step() for an instance of "
                               f"{type(self).__name__} but param_groups' capturable is False.")

    setattr(torch.optim.Optimizer, name, capturing)
    try:
        yield
    finally:
        setattr(torch.optim.Optimizer, name, check)


def _same_memory(old: Tensor, new: Any) -> bool:
    """Whether ``new`` is ``old``'s memory already (an in-place result, a view)."""
    return (isinstance(new, Tensor)
            and new.untyped_storage().data_ptr() == old.untyped_storage().data_ptr())
