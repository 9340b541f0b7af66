"""Attention masks for models without a varlen kernel (CPU, plain SDPA).

- `document_causal_mask`: for a packed row, token ``q`` may attend to token
  ``k`` only when both lie in the same sample and ``k <= q`` (block-diagonal
  causal). Memory: T x T booleans (64 MiB at T = 8,192); per-sample attention
  (loop over ``cu_seq_lens``) avoids it and does O(sum of L^2) work instead of T^2.
- `padding_causal_mask`: for right-padded rows, causal and no attention to padding.

Both return boolean masks (True = may attend) for
``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch

__all__ = ["document_causal_mask", "padding_causal_mask"]


def document_causal_mask(cu_seq_lens: torch.Tensor) -> torch.Tensor:
    """(T, T) bool: same sample and not in the future, from (n + 1,) ``cu_seq_lens``."""
    cu = cu_seq_lens.to(torch.int64)
    total = int(cu[-1])
    lengths = cu[1:] - cu[:-1]
    # shape (T,): the sample each token belongs to
    document = torch.repeat_interleave(torch.arange(lengths.shape[0], device=cu.device), lengths)
    position = torch.arange(total, device=cu.device)
    same = document[:, None] == document[None, :]
    return same & (position[None, :] <= position[:, None])


def padding_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(n, 1, L, L) bool from an (n, L) 0/1 padding mask: causal, keys must be real tokens.

    With right padding every query row keeps at least its row's first token, so no
    row is fully masked (which would make SDPA return NaN).
    """
    length = attention_mask.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    keys = attention_mask.to(torch.bool)[:, None, None, :]
    return causal[None, None] & keys
