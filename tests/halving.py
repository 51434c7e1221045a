"""A correct user transform for the contract kit tests (core/test_contract.py,
test_testing_kit.py): halving every gradient, the loop that does it by hand, and its loss."""

from __future__ import annotations

import torch.nn.functional as F

from accelfn.testing import plain_update


def loss_fn(model, batch):
    return {"loss": F.cross_entropy(model(batch["x"]), batch["y"])}


def halve(grads, params, state):
    """The gradient transform's update: every gradient times 0.5."""
    for g in grads:
        g.mul_(0.5)


def halved(model, optimizer, batch):
    """The reference: one plain update with the gradients halved by hand."""
    plain_update(model, optimizer, batch, loss_fn,
                 edit_grads=lambda m: [p.grad.mul_(0.5) for p in m.parameters()])
