"""accelfn.data: torchdata pipelines yielding TensorDict batches, preprocessing finished on the GPU.

``loader(source, batch_size=..., device=..., transform=...)`` is the one-call entry point; the
nodes it composes (``IndexBatchSampler``, ``TensorDictGather``, ``SampleCollator``,
``PoolMapper``, ``ToDevice``, ``ApplyTransform``) are ``torchdata.nodes`` building blocks
that can be recombined and wrapped in a ``BatchLoader``. ``preload`` writes a dataset once to
a memory-mapped TensorDict; ``accelfn.data.gpu`` holds the batch transforms.
"""

from .gpu import (
    ChannelsLast,
    Compose,
    DecodeJPEG,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
    ToDtype,
)
from .pipeline import ApplyTransform, BatchLoader, ToDevice, loader
from .preload import (
    ImageFiles,
    find_images,
    open_preloaded,
    preload,
    preload_image_folder,
    preload_info,
)
from .sampling import IndexBatchSampler, epoch_indices, mix_seed, resolve_shard
from .sources import (
    IterableBatcher,
    PoolMapper,
    SampleCollator,
    SampleSpec,
    TensorDictGather,
)

__all__ = [
    "ApplyTransform",
    "BatchLoader",
    "ChannelsLast",
    "Compose",
    "DecodeJPEG",
    "ImageFiles",
    "IndexBatchSampler",
    "IterableBatcher",
    "Normalize",
    "PoolMapper",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "SampleCollator",
    "SampleSpec",
    "TensorDictGather",
    "ToDevice",
    "ToDtype",
    "epoch_indices",
    "find_images",
    "loader",
    "mix_seed",
    "open_preloaded",
    "preload",
    "preload_image_folder",
    "preload_info",
    "resolve_shard",
]
