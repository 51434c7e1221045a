"""Models whose step computes the loss outside ``forward`` (the torchtune/torchtitan habit),
and step functions that reach them through submodules, a method, or a parameter read
directly. Shared by the tests that check a step hands the function the user's own model."""

from __future__ import annotations

import torch.nn.functional as F
from helpers import Net


class Hidden:
    """A ``hidden(x)`` method: the hidden states before the head (``inp``, then ``blocks``)."""

    def hidden(self, x):
        h = self.inp(x)  # type: ignore[attr-defined]
        for block in self.blocks:  # type: ignore[attr-defined]
            h = block(h)
        return h


class TrunkNet(Hidden, Net):
    """``Net`` with a ``hidden`` method (the same parameters, initialised alike)."""


def _metrics(logits, batch):
    loss = F.cross_entropy(logits, batch["y"])
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["y"]).float().mean()}


def via_submodule(model, batch):
    """The loss outside ``forward``: each submodule called, the head's weight read directly."""
    h = model.inp(batch["x"])
    for block in model.blocks:
        h = block(h)
    return _metrics(F.linear(h, model.head.weight, model.head.bias), batch)


def via_method(model, batch):
    """The hidden states through a method, then the head called."""
    return _metrics(model.head(model.hidden(batch["x"])), batch)


def via_forward(model, batch):
    """The same computation through ``model(...)``."""
    return _metrics(model(batch["x"]), batch)
