"""A tiny GPT and a random-token dataset, for the example, the tests and the benchmarks.

Not for real training: they exist so that the runtime can be exercised end to end
on CPU with the real length distributions of ``data/``. `TinyGPT` takes the
collators' batches as keyword arguments (``model(**batch)``) and keeps samples
apart in packed rows: per-sample attention (``attention="documents"``, a loop of
causal SDPA over ``cu_seq_lens``) or one block-diagonal mask (``"mask"``); padded
(right-padded) rows use plain causal SDPA, or the padding mask under ``"mask"``.
A sample therefore gets the same logits packed, padded or alone.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from torch import nn

from batchplan.runtime.attention import document_causal_mask, padding_causal_mask

__all__ = ["RandomTokens", "TinyGPT"]


class RandomTokens:
    """Map-style dataset: sample ``i`` is ``lengths[i]`` random token ids.

    Token ids of sample ``i`` come from ``SeedSequence([seed, i])``, so every
    process and worker sees the same sample without storing it.
    """

    def __init__(self, lengths: NDArray[np.integer], vocab_size: int, seed: int = 0) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int) -> dict[str, NDArray[np.int64]]:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, int(index)]))
        return {"input_ids": rng.integers(0, self.vocab_size, int(self.lengths[index]), dtype=np.int64)}


class TinyGPT(nn.Module):
    """A pre-norm decoder-only transformer with learned positions.

    Args:
        vocab_size: token ids are in ``0..vocab_size-1``.
        d_model: width.
        num_heads: attention heads (``d_model`` must be a multiple).
        num_layers: transformer blocks.
        max_positions: longest sample (positions restart per sample).
        attention: ``"documents"`` (packed rows: SDPA per sample; padded rows: causal
            SDPA) or ``"mask"`` (explicit block-diagonal / padding masks).
    """

    def __init__(
        self,
        vocab_size: int = 512,
        d_model: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        max_positions: int = 2048,
        attention: Literal["documents", "mask"] = "documents",
    ) -> None:
        super().__init__()
        self.attention = attention
        self.embed = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_positions, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seq_lens: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """Logits (batch, T, vocab) for a batch of `PackCollator` or `PadCollator`."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids) + self.positions(position_ids)
        attend = self._attend_spec(input_ids, attention_mask, cu_seq_lens)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))

    def _attend_spec(self, input_ids, attention_mask, cu_seq_lens) -> dict[str, Any]:
        if cu_seq_lens is not None and input_ids.shape[0] == 1:
            if self.attention == "documents":
                return {"bounds": cu_seq_lens.tolist()}
            return {"mask": document_causal_mask(cu_seq_lens)}
        if attention_mask is not None and self.attention == "mask":
            return {"mask": padding_causal_mask(attention_mask)}
        # Right padding: a real token's causal past holds only real tokens, so plain causal
        # attention gives them the same outputs (pads only see garbage, and carry no label).
        return {}


class _Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, attend: dict[str, Any]) -> torch.Tensor:
        x = x + self.out(self._attention(self.norm1(x), attend))
        return x + self.mlp(self.norm2(x))

    def _attention(self, x: torch.Tensor, attend: dict[str, Any]) -> torch.Tensor:
        batch, length, width = x.shape
        # shape (batch, heads, T, head_dim) for q, k and v
        q, k, v = (
            t.view(batch, length, self.num_heads, width // self.num_heads).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=-1)
        )
        if "bounds" in attend:
            bounds = attend["bounds"]
            pieces = [
                F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                for a, b in zip(bounds[:-1], bounds[1:])
            ]
            y = torch.cat(pieces, dim=2)
        elif "mask" in attend:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attend["mask"])
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(batch, length, width)
