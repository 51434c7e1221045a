"""How one call is computed ([`Plan`][], the accumulation's answer) and the weighted sums of its
micro-batches' losses and metrics ([`Sums`][])."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .batch import Batch

__all__ = ["Plan", "Sums"]


class Sums:
    """Weighted sums of loss and metrics over micro-batches, kept on the device.

    Terms are collected as they come and summed once, when the result is read (one stack
    and one sum per metric, not an addition per micro-batch).
    """

    __slots__ = ("_coefs", "_terms", "_weights", "keys", "weighted")

    def __init__(self) -> None:
        self._terms: dict[str, list[Tensor]] = {}
        self._coefs: list[Tensor | float] = []
        self._weights: list[Tensor] = []
        #: the metric names and whether a "weight" came with the first micro-batch (None:
        #: none yet); every later one of the update, in any call, must return the same
        self.keys: frozenset[str] | None = None
        self.weighted: bool | None = None

    def add_weight(self, weight: Tensor) -> None:
        """Note the ``"weight"`` a micro-batch's step function returned (its token count)."""
        self._weights.append(weight.detach())

    def returned_weight(self) -> Tensor | None:
        """The sum of the weights the step function returned (None when it returned none):
        the update's token count, reported as its ``"weight"`` metric."""
        weights = self._weights
        if not weights:
            return None
        return weights[0] if len(weights) == 1 else torch.stack(weights).sum()

    def add(self, coef: Tensor | float | None, values: Mapping[str, Tensor],
            weighted: Mapping[str, Tensor] | None = None) -> None:
        """Add ``coef * value`` for each of ``values`` (detached), and the terms of
        ``weighted`` as they are (already multiplied by ``coef``). ``coef=None``: one
        unweighted micro-batch."""
        terms = self._terms
        for key, value in values.items():
            term = value.detach() if coef is None else value.detach() * coef
            terms.setdefault(key, []).append(term)
        for key, value in (weighted or {}).items():
            terms.setdefault(key, []).append(value.detach())
        if coef is not None:
            self._coefs.append(coef)

    def loss_terms(self) -> tuple[list[Tensor], list[Tensor | float]]:
        """The lists the engine appends a plain micro-batch loss to: its weighted loss
        (detached) and its coefficient (unless None), as ``add(coef, {}, {"loss": weighted})``
        does, without a mapping and a call per micro-batch."""
        terms = self._terms.get("loss")
        if terms is None:
            terms = self._terms["loss"] = []
        return terms, self._coefs

    @property
    def empty(self) -> bool:
        """Whether nothing was added yet (the first micro-batch of a window)."""
        return not self._terms

    @property
    def weight(self) -> Tensor | float | None:
        """The sum of the coefficients added so far (None when unweighted)."""
        coefs = self._coefs
        if not coefs:
            return None
        if len(coefs) == 1:
            return coefs[0]
        if any(isinstance(c, Tensor) for c in coefs):
            return torch.stack([torch.as_tensor(c, dtype=torch.float32) for c in coefs]).sum()
        return sum(coefs)  # type: ignore[arg-type]

    def result(self, divide: bool) -> dict[str, Tensor]:
        """The sums, divided by the total weight when ``divide`` (the weighted means); 0
        where the total is 0 (this process' rows all padding: its terms are 0, the others'
        update goes on), on the device."""
        out = {k: v[0] if len(v) == 1 else torch.stack(v).sum(0) for k, v in self._terms.items()}
        weight = self.weight if divide else None
        if weight is None:
            return out
        if isinstance(weight, Tensor):
            weight = torch.where(weight == 0, 1.0, weight)
        return {k: v / weight for k, v in out.items()}


@dataclass(frozen=True, slots=True)
class Plan:
    """How one call is computed: the accumulation part's answer (one micro-batch without it).

    ``micros`` are run forward and backward in order. ``update`` says whether the call ends
    with an optimizer update. ``sums`` carries the running metric sums across calls (a
    call-counting split keeps them in its state; None: fresh for this call). ``absolute``
    weights micro-batches by their sample count (or ``"weight"``) and divides the gradients
    by the total at the update, instead of weighting by the share of this call's batch.
    ``dim`` is the batch dimension samples are counted along (1 for time-major batches).
    ``sizes``, when the split knows them, are the micro-batches' sample counts along ``dim``
    (the engine counts them otherwise). ``calls`` is how many calls one update spans (a
    call-counting split gives its ``n``): under loss scaling the engine counts absolute
    weights in a power of two near an update's total, estimated once as the first
    micro-batch's weight times micro-batches times calls (``accelfn.core.units``).
    """

    micros: Sequence[Batch]
    update: bool = True
    sums: Sums | None = None
    absolute: bool = False
    dim: int = 0
    sizes: Sequence[int] | None = None
    calls: int = 1

    def __post_init__(self) -> None:
        if type(self.calls) is not int or self.calls < 1:
            raise ValueError(f"Plan(calls={self.calls!r}) must be an int >= 1: the calls one "
                             "update spans (1 unless the split counts calls)")
