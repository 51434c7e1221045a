"""accelfn.parts.nonfinite: the non-finite decision's counting and the device check of gradients
(the decision inside a step is tested against hand-written loops in
tests/transforms/test_nonfinite.py)."""

from __future__ import annotations

import pytest
import torch

from accelfn.parts.nonfinite import Guard, NonFinite, NonFiniteError, grads_nonfinite

CLEAN, LOSS, GRADS, OVERFLOW = [False, False], [True, False], [False, True], [False, False, True]


def test_a_clean_update_resets_the_run_of_skips():
    guard = Guard()
    assert guard.decide(GRADS, 1, "skip", 10) is True
    assert (guard.skipped, guard.consecutive) == (1, 1)
    assert guard.decide(CLEAN, 2, "skip", 10) is False
    assert (guard.skipped, guard.consecutive) == (1, 0)


def test_skip_raises_at_the_limit_in_a_row_without_counting_the_refused_one():
    guard = Guard()
    for update in range(1, 3):
        assert guard.decide(LOSS, update, "skip", 3)
    with pytest.raises(NonFiniteError, match="3 updates in a row had a non-finite loss"):
        guard.decide(LOSS, 3, "skip", 3)
    assert (guard.skipped, guard.consecutive) == (2, 2)  # the refused update is not counted


def test_raise_refuses_the_first_and_an_overflow_alone_is_only_counted():
    guard = Guard()
    with pytest.raises(NonFiniteError, match="non-finite gradients at update 5"):
        guard.decide(GRADS, 5, "raise", 10)
    assert guard.skipped == 0
    assert guard.decide(OVERFLOW, 6, "raise", 10) is True  # fp16's scale backs off
    assert (guard.skipped, guard.consecutive) == (1, 0)


def test_state_round_trips_and_refuses_to_save_a_pending_decision():
    guard = Guard()
    guard.decide(GRADS, 1, "skip", 10)
    again = Guard()
    again.load_state_dict(guard.state_dict())
    assert (again.skipped, again.consecutive) == (1, 1)
    guard.defer(torch.tensor([False, True]), 2, NonFinite())
    with pytest.raises(RuntimeError, match=r"state\.sync"):
        guard.state_dict()
    guard.forget(2)
    assert guard.state_dict() == {"skipped": 1, "consecutive": 1}


def test_grads_nonfinite_finds_nan_and_inf_in_any_dtype_and_leaves_the_values():
    device = torch.device("cpu")
    finite = [torch.ones(3), torch.zeros(2, dtype=torch.float64)]
    assert not grads_nonfinite(finite, device)
    assert not grads_nonfinite([], device)
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads = [torch.ones(3), torch.tensor([1.0, bad], dtype=torch.float64)]
        kept = [g.clone() for g in grads]
        assert grads_nonfinite(grads, device)
        for g, k in zip(grads, kept):
            assert torch.equal(g, k) or (torch.isnan(g) == torch.isnan(k)).all()
