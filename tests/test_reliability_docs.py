"""docs/reliability.md says what the code does: each claim checked here runs the code."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import torch
from helpers import Net, classify, make_batch

import accelfn as af

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def _bad_input_row(name: str) -> str:
    """The error column of the bad-input table's row ``name``."""
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] == name:
            return cells[1]
    raise AssertionError(f"docs/reliability.md has no bad-input row {name!r}")


def test_a_batch_smaller_than_the_micro_batch_count_is_as_the_docs_say():
    said = _bad_input_row("batch smaller than the number of micro-batches")
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reference = copy.deepcopy(state)
    batch = make_batch(n=2)
    import accelfn.parts.accumulation as accumulation

    accumulation._warned_small = False  # once per process: this test's own
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        af.with_accumulation(4)(classify)(state, batch)  # trains: no error
    assert "ValueError" not in said
    assert re.search(r"warn", said) and "mode=\"calls\"" in said.replace("'", '"')
    assert [w for w in caught if "mode='calls'" in str(w.message)]  # the warning it names
    af.with_accumulation(1)(classify)(reference, batch)  # the full batch's update
    for a, b in zip(state.model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(a, b)
    assert "full batch" in said or "whole batch" in said
