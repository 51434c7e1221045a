"""Batch transforms that run on whole batches, on whichever device the batch is on.

Each transform is a callable ``t(batch, generator=None) -> batch`` over a TensorDict whose
image keys hold ``(batch, channels, height, width)`` tensors (uint8 or floating point). Random
transforms draw one set of parameters **per sample** from ``generator`` (a ``torch.Generator``
on the batch's device; the loader seeds one per batch from ``seed``, epoch and batch number),
with no per-sample Python loop: crops are index arithmetic + one ``gather``, resized crops a
separable resampling with per-sample weights (a row selection per filter tap and axis), flips
one masked select. When several keys are listed (e.g. an image and
its segmentation mask), they all get the same per-sample parameters.

The same code runs on the CPU (tests) and on CUDA, so both give the same distributions.
[`DecodeJPEG`][] is the exception to "on the device": it needs the encoded bytes on the
host and writes the decoded images to the device; the loader keeps its ``host_keys`` on the
CPU.

Compose them with [`Compose`][]; any callable ``f(batch) -> batch`` can be mixed in.

Modules: ``base`` (the protocol, [`Compose`][], shared checks), ``geometry`` (random crops
and flips), ``pixels`` (normalisation, dtype and memory-format casts), ``jpeg`` (decoding).
"""

from .base import BatchTransform, Compose, accepts_generator, host_keys
from .geometry import RandomCrop, RandomHorizontalFlip, RandomResizedCrop
from .jpeg import DecodeJPEG
from .pixels import ChannelsLast, Normalize, ToDtype

__all__ = [
    "BatchTransform",
    "ChannelsLast",
    "Compose",
    "DecodeJPEG",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "ToDtype",
    "accepts_generator",
    "host_keys",
]
