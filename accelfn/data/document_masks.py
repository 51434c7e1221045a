"""Attention masks for packed rows: causal within each document, nothing across documents.

    from torch.nn.attention.flex_attention import flex_attention
    import accelfn.data as ad

    def forward(self, x, document_ids):          # in the model, on the device
        mask = ad.document_block_mask(document_ids)          # flex_attention's BlockMask
        y = flex_attention(q, k, v, block_mask=mask)
        # or, with PyTorch's fused attention and an explicit mask:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=ad.document_causal_mask(document_ids))

A position of a packed row attends to the positions at or before it that belong to the same
document, so each document's outputs are those it would have alone (tested to 1e-6 in fp32,
eager and under ``accelfn.compiled``).

Why this module is in ``accelfn.data``: the masks are used model-side (the step builds them
on the device from the batch), but they are the other half of the packed layout that
``accelfn.data.packing`` writes (``document_ids``: 0, 1, ... per row, -1 at padding) and
need nothing but torch. Kept beside that layout, they change with it; ``accelfn.data``
imports nothing of accelfn beyond core, so models, recipes and examples can all import them.
(In ``accelfn.recipes`` they would depend on ``accelfn.data`` for the layout anyway.)

Padding (``document_ids == -1``) is a document of its own: its positions attend to each
other, never to a real token, and no real token attends to them; their targets are ignored.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

__all__ = ["document_block_mask", "document_causal_mask"]


def _check(document_ids: Tensor) -> None:
    if not isinstance(document_ids, Tensor) or document_ids.dim() != 2:
        raise ValueError(
            "document_ids must be a (batch, seq_len) tensor, the batch's 'document_ids' "
            f"entry; got {getattr(document_ids, 'shape', type(document_ids).__name__)}"
        )


def document_causal_mask(document_ids: Tensor) -> Tensor:
    """The boolean mask ``(batch, 1, seq_len, seq_len)`` for
    ``F.scaled_dot_product_attention(..., attn_mask=mask)``: ``True`` where query ``q`` may
    attend to key ``k``, i.e. ``k <= q`` in the same document. Broadcasts over heads.

    It holds ``batch * seq_len**2`` booleans, and PyTorch's flash kernel does not take a mask
    (the memory-efficient or math kernel runs instead); for long rows on a GPU use
    [`document_block_mask`][] with ``flex_attention``.
    """
    _check(document_ids)
    t = document_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal).unsqueeze(1)


def document_block_mask(document_ids: Tensor, *, block_size: int = 128) -> BlockMask:
    """The ``BlockMask`` for ``torch.nn.attention.flex_attention.flex_attention``: causal
    within documents (``k <= q`` and the same document), for every head.

    Blocks of ``block_size`` positions that cross no document boundary are skipped or run
    unmasked by flex attention's kernel, so the cost follows the documents' lengths, not the
    row's. Eagerly it is computed on ``document_ids``' device; inside ``torch.compile``
    (``accelfn.compiled``) it is compiled with the model.
    """
    _check(document_ids)
    b, t = document_ids.shape

    def mask_mod(batch: Tensor, head: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        same = document_ids[batch, q] == document_ids[batch, kv]
        return same & (kv <= q)

    return create_block_mask(mask_mod, b, None, t, t, device=document_ids.device,
                             BLOCK_SIZE=block_size)
