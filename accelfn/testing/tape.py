"""TapeRecorder: a CUDA graph's semantics on the CPU, to test captured steps without a GPU.

A CUDA graph replays the device work it recorded, on the same memory, and none of the
Python that issued it. The tape does the same with torch's operators: ``record`` runs a
function once with every aten operator it dispatches written down (the tensors it read
and wrote, the outputs it made), then puts back every tensor the function wrote and the
random number generator's state (a recording applies nothing, as a capture); ``replay``
runs the operators again on the same tensors, the outputs of one feeding the next, and
copies the new values into the outputs the recording returned. Python state the function
changed is changed once, at the recording, as under CUDA graphs: a step whose update
depends on it differs from its eager run on the tape too.

Not recorded: operators that run no aten operator (inductor's compiled kernels: under a
recording torch.compile runs the model eagerly) and the profiler's markers. A host read
(an operator whose output is a Python number, ``.item()``) is refused, as a capture fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
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


def _mapped(value: Any, env: dict[int, Tensor]) -> Any:
    if isinstance(value, Tensor):
        return env.get(id(value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _mapped(v, env) for k, v in value.items()}
    return value


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
        self._tape: list[_Entry] = []
        self._outputs: list[Tensor] = []
        self._made: dict[int, Tensor] = {}  # every tensor made while recording, kept alive
        self.replays = 0

    @property
    def operators(self) -> int:
        return len(self._tape)

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
                if id(root) not in made and id(root) not in saved:
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
            with compat.aten_interceptor(handle):
                out = fn()
        finally:
            with torch.no_grad():
                for tensor, before in saved.values():
                    tensor.copy_(before)
            torch.set_rng_state(rng)
        self._tape, self._made = tape, made
        self._outputs = [t for t in _leaves(list(_values(out))) if isinstance(t, Tensor)
                         and id(t) in made]
        return out

    def replay(self) -> None:
        env: dict[int, Tensor] = {}
        with torch.no_grad():
            for op, args, kwargs, outputs in self._tape:
                result = op(*_mapped(args, env), **_mapped(kwargs, env))
                for old, new in zip(outputs, _leaves(result)):
                    if isinstance(old, Tensor):
                        env[id(old)] = new
            for tensor in self._outputs:
                new = env.get(id(tensor), tensor)
                if new is not tensor:
                    tensor.copy_(new)
        self.replays += 1


def _values(out: Any) -> list[Any]:
    """The leaves of what a recorded function returned (tuples, lists, mappings, objects
    with tensors in their mapping values)."""
    if isinstance(out, dict):
        return [leaf for v in out.values() for leaf in _values(v)]
    if isinstance(out, (list, tuple)):
        return [leaf for v in out for leaf in _values(v)]
    return [out]
