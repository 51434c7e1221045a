"""Small real datasets shipped inside the package, for examples and tests."""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["digits"]


def digits() -> TensorDict:
    """The 1,797 handwritten digits of the UCI "Optical Recognition of Handwritten Digits"
    test set (8x8 images, 17 grey levels, 10 balanced classes; CC BY 4.0).

    Returns a TensorDict with ``image`` (uint8, ``[N, 1, 8, 8]``, the 17 grey levels spread
    over 0..255 like any 8-bit image: pixel mean 0.30 and std 0.38 after dividing by 255) and
    ``label`` (int64, ``[N]``), batch size ``[1797]``.
    """
    with resources.files("accelfn.assets").joinpath("digits.npz").open("rb") as f:
        data = np.load(f)
        images, labels = data["images"], data["labels"]
    return TensorDict(
        {"image": (torch.from_numpy(images).int() * 255 // 16).to(torch.uint8).unsqueeze(1),
         "label": torch.from_numpy(labels).long()},
        batch_size=[len(labels)],
    )
