"""accelfn.data: torchdata pipelines yielding TensorDict batches, preprocessing finished on the GPU.

``loader(source, batch_size=..., device=..., transform=...)`` is the one-call entry point; the
nodes it composes (``IndexBatchSampler``, ``TensorDictGather``, ``SampleCollator``,
``PoolMapper``, ``ToDevice``, ``ApplyTransform``) are ``torchdata.nodes`` building blocks
that can be recombined and wrapped in a ``BatchLoader``. ``preload`` writes a dataset once to
a memory-mapped TensorDict; ``accelfn.data.gpu`` holds the batch transforms.

Modules, in the order a batch passes them: ``sampling`` (indices per batch, epoch and rank),
``gather`` (TensorDict sources), ``collate`` (per-sample sources, their draws seeded per
sample by ``rng``), ``workers`` (persistent
thread / process pools), ``stages`` (device copy, seeded batch transform), ``gpu`` (the batch
transforms), ``batch_loader`` (iteration, position, data wait), ``epochs`` (the epoch and
position protocol the nodes and the loader share), ``pipeline`` (``loader()``, which wires
them); ``adapter`` (``from_dataloader()``: an existing DataLoader's batches as
TensorDicts on the device, timed and checkpointable); ``preloading`` (memory-mapped datasets,
image files) and ``datasets`` (small bundled datasets) stand apart.

Language-model data: ``tokens`` (``TokenFiles``: nanoGPT's raw ``.bin`` and llm.c /
modded-nanogpt shards, read in windows; ``write_tokens``), ``packing`` (documents packed
into rows, greedy or best-fit, with ``document_ids`` and ``positions``), ``token_batches``
(``token_loader()``: random windows or packed rows, sharded, exactly resumable) and
``document_masks`` (the attention masks of packed rows, for ``flex_attention`` and
``scaled_dot_product_attention``).
"""

from .adapter import DataLoaderAdapter, batch_to_tensordict, from_dataloader
from .batch_loader import BatchLoader
from .collate import IterableBatcher, SampleCollator, SampleSpec
from .document_masks import document_block_mask, document_causal_mask
from .gather import TensorDictGather
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
from .pipeline import loader
from .preloading import (
    ImageFiles,
    find_images,
    open_preloaded,
    preload,
    preload_image_folder,
    preload_info,
)
from .sampling import (
    DataLoaderRNG,
    EpochBatch,
    IndexBatchSampler,
    epoch_indices,
    mix_seed,
    resolve_shard,
)
from .stages import ApplyTransform, ToDevice
from .token_batches import token_loader
from .tokens import TokenFiles, write_tokens
from .workers import PoolMapper

__all__ = [
    "ApplyTransform",
    "BatchLoader",
    "ChannelsLast",
    "Compose",
    "DataLoaderAdapter",
    "DataLoaderRNG",
    "DecodeJPEG",
    "EpochBatch",
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
    "TokenFiles",
    "batch_to_tensordict",
    "document_block_mask",
    "document_causal_mask",
    "epoch_indices",
    "find_images",
    "from_dataloader",
    "loader",
    "mix_seed",
    "open_preloaded",
    "preload",
    "preload_image_folder",
    "preload_info",
    "resolve_shard",
    "token_loader",
    "write_tokens",
]
