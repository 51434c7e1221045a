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

    Returns a TensorDict with ``image`` (uint8, ``[N, 1, 8, 8]``, values 0..16) and
    ``label`` (int64, ``[N]``), batch size ``[1797]``.
    """
    with resources.files("accelfn.assets").joinpath("digits.npz").open("rb") as f:
        data = np.load(f)
        images, labels = data["images"], data["labels"]
    return TensorDict(
        {"image": torch.from_numpy(images).unsqueeze(1).contiguous(),
         "label": torch.from_numpy(labels).long()},
        batch_size=[len(labels)],
    )
