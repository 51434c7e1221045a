"""benchmarks/overhead.py's operator count: the ATen operators each side dispatches per
update, a figure that does not move with the machine's load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import overhead

# accelfn's bookkeeping over the plain loop's 262 operators (fp32) is 5: the loss metric's
# stack and sum, the guard's one read of loss and norm (a stack, read with tolist) and the
# `lr` and `skipped` metrics (scalar_tensor each): 267, x1.019


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_accelfn_dispatches_within_two_percent_of_the_plain_loops_operators(bf16):
    counted = overhead.count_operators("tiny", bf16, updates=2)
    per_update = counted["operators_per_update"]
    assert per_update["plain"] > 200  # four micro-batches' forward and backward, AdamW
    assert counted["accelfn_ratio"] == round(per_update["accelfn"] / per_update["plain"], 4)
    # what accelfn adds over the plain loop is named, and nothing else differs
    differ = counted["accelfn_differs_from_plain"]
    assert all(ops[0] != ops[1] for ops in differ.values())
    assert "stack" in differ  # the metrics' loss sum
    # torch's profiled calls, optimizer.step() and zero_grad(), run once each, as in the loop
    assert "_record_function_enter_new" not in differ
    assert counted["accelfn_ratio"] <= 1.02, differ
