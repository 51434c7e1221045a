"""with_nonfinite: the policy for NaN/Inf losses and gradients."""

from __future__ import annotations

import torch

from ..core.engine import configurable

__all__ = ["with_nonfinite"]

_POLICIES = ("skip", "raise", "off")


class _NonFinite:
    name = "with_nonfinite"

    def __init__(self, policy: str, max_consecutive: int) -> None:
        self.nonfinite = (policy, max_consecutive)  # read by the step engine's guard

    def validate(self, transforms: tuple) -> None:
        fp16 = any(getattr(t, "name", None) == "with_amp" and getattr(t, "dtype", None)
                   == torch.float16 for t in transforms)
        if fp16 and self.nonfinite[0] == "off":
            raise ValueError(
                "with_nonfinite(policy='off') cannot be combined with "
                "with_amp(dtype=torch.float16): fp16 loss scaling must skip overflowing updates; "
                "use policy='skip' (overflows do not count towards max_consecutive) or bf16"
            )

    def __repr__(self) -> str:
        policy, limit = self.nonfinite
        return f"with_nonfinite({policy}, max_consecutive={limit})" if policy == "skip" else (
            f"with_nonfinite({policy})")


def _build_nonfinite(*, policy: str = "skip", max_consecutive: int = 10) -> _NonFinite:
    """Equivalent to checking ``torch.isfinite`` of the loss and of every gradient before
    ``optimizer.step()`` and acting on the answer.

    Every step already guards by default with ``policy="skip", max_consecutive=10``: an update
    whose loss or gradients hold NaN/Inf is skipped (parameters, optimizer state and scheduler
    untouched; metric ``skipped`` is 1) and after ``max_consecutive`` such updates in a row the
    step raises :class:`accelfn.NonFiniteError`. ``policy="raise"`` raises at the first one
    (state untouched); ``policy="off"`` removes the check and its one host read per update.
    fp16 loss-scale overflows are always skipped and do not count towards the limit, so
    ``policy="off"`` together with ``with_amp(dtype=torch.float16)`` is refused.
    """
    if policy not in _POLICIES:
        raise ValueError(f"with_nonfinite(policy={policy!r}) is unknown; use one of {_POLICIES}")
    if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) \
            or max_consecutive < 1:
        raise ValueError(f"with_nonfinite(max_consecutive={max_consecutive!r}) must be an int >= 1")
    return _NonFinite(policy, max_consecutive)


with_nonfinite = configurable("with_nonfinite", _build_nonfinite)
