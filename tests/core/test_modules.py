"""Module utilities (accelfn.core.modules): the repeated blocks `find_blocks` finds come in
the model's order, whatever their classes."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from accelfn.core.modules import find_blocks


class A(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


class B(A):
    pass


def in_model_order(model: nn.Module, names: list[str]) -> bool:
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return names == sorted(names, key=order.__getitem__)


def test_blocks_of_several_classes_come_in_model_order():
    # siblings of two classes, interleaved (a stage, then a downsampling layer, ...)
    model = nn.Sequential(A(), B(), A(), B(), A())
    assert [n for n, _ in find_blocks(model)] == ["0", "1", "2", "3", "4"]


def test_blocks_found_deeper_come_before_a_later_sibling_of_their_ancestor():
    # blocks inside the first child (model order: 0.0, 0.1), then the outer 1 and 2
    inner = nn.Sequential(nn.Sequential(A(), A()), nn.ReLU())
    model = nn.Sequential(inner, B(), B())
    names = [n for n, _ in find_blocks(model)]
    assert names == ["0.0.0", "0.0.1", "1", "2"]


@pytest.mark.parametrize("name", ["swin_t", "swin_v2_t", "mobilenet_v2", "efficientnet_b0",
                                  "densenet121", "resnet50", "convnext_tiny"])
def test_torchvision_blocks_come_in_model_order(name):
    with torch.device("meta"):  # no memory, no initialisation: only the structure matters
        model = getattr(torchvision.models, name)(weights=None)
    names = [n for n, _ in find_blocks(model)]
    assert len(names) >= 4
    assert in_model_order(model, names), names
