"""channels_last: NHWC memory format for convolutional models and image batches, no-op elsewhere.

    model = af.channels_last(model)               # before building the optimizer/compiling
    loader = ad.loader(..., transform=ad.Compose(..., ad.ChannelsLast()))   # inputs, or:
    logits = model(af.channels_last(batch["image"]))                       # in the step fn
"""

from __future__ import annotations

from typing import TypeVar, overload

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn

from ..core import compat
from ..data.gpu import ChannelsLast

__all__ = ["channels_last", "is_channels_last"]

M = TypeVar("M", bound=nn.Module)


def _to_channels_last(t: Tensor) -> Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


@overload
def channels_last(obj: M) -> M: ...


@overload
def channels_last(obj: Tensor) -> Tensor: ...


@overload
def channels_last(obj: TensorDictBase) -> TensorDictBase: ...


def channels_last(obj: nn.Module | Tensor | TensorDictBase
                  ) -> nn.Module | Tensor | TensorDictBase:
    """Equivalent to ``model.to(memory_format=torch.channels_last)`` for a model with 4-D
    (2-D convolution) weights, and to ``x.contiguous(memory_format=torch.channels_last)``
    for a 4-D tensor; anything else is returned unchanged.

    - ``nn.Module``: every 4-D parameter and buffer is converted in place (the model is
      returned); a model without any (an MLP, a transformer) is left as it is, and 5-D
      tensors (3-D convolutions) are not touched. Convert before building the optimizer
      and before ``compiled``/``distributed`` prepare the model.
    - ``Tensor``: converted when it is 4-D (NCHW images), returned as is otherwise.
    - ``TensorDict`` batch: its 4-D top-level entries converted by
      [`accelfn.data.ChannelsLast`][]
      (the data pipeline's transform; use that one inside ``ad.loader(transform=...)``).

    Convolutions on NVIDIA tensor cores (fp16/bf16) run faster in this format; the values
    are unchanged, only the strides differ.
    """
    if isinstance(obj, nn.Module):
        tensors = [*obj.parameters(), *obj.buffers()]
        if not any(t.dim() == 4 for t in tensors):
            return obj
        compat.module_apply(obj, _to_channels_last)
        return obj
    if isinstance(obj, Tensor):
        return _to_channels_last(obj)
    if isinstance(obj, TensorDictBase):
        keys = [k for k, v in obj.items() if isinstance(v, Tensor) and v.dim() == 4]
        return ChannelsLast(keys=keys)(obj) if keys else obj
    raise TypeError(f"channels_last() takes a model, a tensor or a TensorDict batch, got "
                    f"{type(obj).__name__}")


def is_channels_last(obj: nn.Module | Tensor) -> bool:
    """Equivalent to ``t.is_contiguous(memory_format=torch.channels_last)`` for every 4-D
    parameter and buffer of a model (or for one 4-D tensor).

    False for a model or tensor without 4-D tensors.
    """
    if isinstance(obj, nn.Module):
        four = [t for t in [*obj.parameters(), *obj.buffers()] if t.dim() == 4]
        return bool(four) and all(
            t.is_contiguous(memory_format=torch.channels_last) for t in four)
    if isinstance(obj, Tensor):
        return obj.dim() == 4 and obj.is_contiguous(memory_format=torch.channels_last)
    raise TypeError(f"is_channels_last() takes a model or a tensor, got {type(obj).__name__}")
