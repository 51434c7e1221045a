"""accelfn.core.plan: a call's Plan and the weighted Sums of its micro-batches."""

from __future__ import annotations

import pytest
import torch

from accelfn.core.plan import Plan, Sums


def test_sums_are_the_weighted_means_of_the_micro_batches():
    sums = Sums()
    assert sums.empty and sums.weight is None
    sums.add(3.0, {"loss": torch.tensor(2.0), "acc": torch.tensor(1.0)})
    sums.add(1.0, {"loss": torch.tensor(6.0), "acc": torch.tensor(0.0)})
    assert not sums.empty and sums.weight == 4.0
    out = sums.result(divide=True)
    assert out["loss"].item() == pytest.approx((3 * 2 + 6) / 4)
    assert out["acc"].item() == pytest.approx(3 / 4)
    assert sums.result(divide=False)["loss"].item() == pytest.approx(12.0)


def test_tensor_weights_are_summed_on_the_device_and_unweighted_terms_kept_as_they_are():
    sums = Sums()
    sums.add(torch.tensor(2.0), {"loss": torch.tensor(1.0)})
    sums.add(torch.tensor(6.0), {"loss": torch.tensor(3.0)})
    assert isinstance(sums.weight, torch.Tensor) and sums.weight.item() == 8.0
    assert sums.result(divide=True)["loss"].item() == pytest.approx((2 + 18) / 8)
    alone = Sums()
    alone.add(None, {"loss": torch.tensor(5.0, requires_grad=True)})
    result = alone.result(divide=True)["loss"]
    assert result.item() == 5.0 and not result.requires_grad  # detached


def test_a_plan_counts_its_calls_from_one():
    assert Plan(("batch",)).calls == 1 and Plan(("batch",)).update
    for calls in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="calls"):
            Plan(("batch",), calls=calls)
