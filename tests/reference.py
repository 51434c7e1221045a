"""The one reference oracle of the tests: ``accelfn.testing.reference``, the plain PyTorch
update that imports nothing from accelfn (tests/core/test_layering.py checks it), under the
names the tests use. ``reference_update`` returns what it recorded: each micro-batch's loss
(``"losses"``) and the clip's norm (``"grad_norm"``)."""

from __future__ import annotations

from typing import Any

from accelfn.testing.reference import chunks, full_batch_grads, plain_update

__all__ = ["chunks", "full_batch_grads", "reference_update"]


def reference_update(model, optimizer, batch, loss_fn, **options: Any) -> dict:
    """``plain_update(...)``, returning its record."""
    record: dict = {}
    plain_update(model, optimizer, batch, loss_fn, record=record, **options)
    return record
