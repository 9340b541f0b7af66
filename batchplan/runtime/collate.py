"""Collators: a micro-batch's dataset items -> the tensors a causal LM takes.

Both follow Hugging Face conventions, so models take their output as is:

- `PackCollator` (plans built with ``mode="pack"``): ``DataCollatorWithFlattening``.
  One row of ``T`` tokens: ``input_ids`` and ``labels`` (1, T) int64,
  ``position_ids`` (1, T) restarting at 0 per sample, ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` (n + 1,) int32 and ``max_length_q`` / ``max_length_k`` (int),
  also under the short names ``cu_seq_lens`` / ``max_length``.
- `PadCollator` (``mode="pad"``): ``input_ids`` / ``labels`` / ``attention_mask``
  (n, longest), right-padded.

Labels are the token ids (or the item's own ``labels``) with -100 at each sample's
first position and on padding, so after the model's shift no target crosses a
sample boundary: a sample of ``L`` tokens contributes ``L - 1`` loss tokens, the
plan's count. An empty micro-batch (planned so every rank runs the same number
of forwards) becomes a one-token dummy with no label: loss 0, gradients 0, every
collective still runs. Items are mappings with the token ids under ``input_key``
(list, numpy array or tensor) or the token ids themselves; `SpanItem` items
(from `PlanDataset`, for plans with spans) are sliced to their span first.

Both return a `PlanBatch`: a ``dict`` whose ``.record`` is the micro-batch's plan
record, taken from the `PlannedItems` that `PlanDataset` hands them.
`with_record` gives any other collate function the same.

Given a record, both check what they assemble against it before building tensors
(`batchplan.runtime.checks.check_items`): the items hold the tokens the plan counts
and every span lies inside its item. A dataset changed after planning (a sample
longer or shorter than its planned length) is a `PlanMismatchError` naming the step,
micro-batch, rank and sample, at the first micro-batch it touches: never a batch over
``max_tokens`` or a silently wrong loss scale. Cost: one sum over the items' lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from batchplan.errors import ConfigError, DatasetError
from batchplan.runtime.batch import PlanBatch
from batchplan.runtime.checks import check_items
from batchplan.runtime.records import MicroBatch, SpanItem

__all__ = ["IGNORE_INDEX", "PackCollator", "PadCollator", "with_record"]

IGNORE_INDEX = -100


class _Collator:
    def __init__(
        self,
        *,
        input_key: str = "input_ids",
        labels_key: str | None = "labels",
        pad_token_id: int = 0,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        self.input_key = input_key
        self.labels_key = labels_key
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index

    def _sequences(
        self, items: Sequence[Any], record: MicroBatch | None, *, padded: bool = False
    ) -> tuple[list[NDArray[np.int64]], list[NDArray[np.int64]]]:
        """Token ids and labels of each item, checked against ``record``, spans applied, first
        label ignored."""
        read = [self._read(item) for item in items]
        if record is not None:
            check_items(record, [tokens.shape[0] for tokens, _, _ in read], padded=padded)
        ids, labels = [], []
        for tokens, item_labels, span in read:
            if span is not None:
                tokens, item_labels = _slice_span(tokens, span), _slice_span(item_labels, span)
            if tokens.shape[0] == 0:
                raise DatasetError("a dataset item has no tokens; the plan only holds samples of length >= 1")
            item_labels = item_labels.copy()
            item_labels[0] = self.ignore_index  # the first token of a sample has no target
            ids.append(tokens)
            labels.append(item_labels)
        return ids, labels

    def _read(self, item: Any) -> tuple[NDArray[np.int64], NDArray[np.int64], tuple[int, int] | None]:
        """An item's whole token ids and labels, and its span (None: the whole item)."""
        span = None
        if isinstance(item, SpanItem):
            item, span = item.item, (item.start, item.length)
        tokens = _as_ids(item[self.input_key] if isinstance(item, Mapping) else item, self.input_key)
        labels_key = self.labels_key
        if not (isinstance(item, Mapping) and labels_key is not None and labels_key in item):
            return tokens, tokens, span
        labels = _as_ids(item[labels_key], labels_key)
        if labels.shape != tokens.shape:
            raise DatasetError(
                f"an item has {tokens.shape[0]} {self.input_key} but {labels.shape[0]} {labels_key}; "
                "they must have one label per token"
            )
        return tokens, labels, span


class PackCollator(_Collator):
    """Concatenates a micro-batch's samples into one row (``DataCollatorWithFlattening``).

    Args:
        input_key: key of the token ids in a dataset item (items may also be the ids).
        labels_key: key of per-token labels (-100 = no loss), used when an item has it
            (SFT); otherwise labels are the token ids.
        pad_token_id: token id of the dummy for an empty micro-batch.
        ignore_index: label value that carries no loss.
        use_cache: passed to the model as ``use_cache`` (None leaves the key out).
            ``False`` by default because Hugging Face models find the samples of a
            packed row from ``position_ids`` only without a KV cache; with one, the
            samples attend to each other.
    """

    def __init__(self, *, use_cache: bool | None = False, **options: Any) -> None:
        super().__init__(**options)
        self.use_cache = use_cache

    def __call__(self, items: Sequence[Any]) -> PlanBatch:
        record = getattr(items, "record", None)
        if len(items) == 0:
            ids = [np.array([self.pad_token_id], dtype=np.int64)]
            labels = [np.array([self.ignore_index], dtype=np.int64)]
        else:
            ids, labels = self._sequences(items, record)
        lengths = np.array([a.shape[0] for a in ids], dtype=np.int64)
        cu_seq_lens = np.concatenate([[0], np.cumsum(lengths)])
        # shape (T,): position of each token within its own sample
        positions = np.arange(cu_seq_lens[-1], dtype=np.int64) - np.repeat(cu_seq_lens[:-1], lengths)
        cu = torch.from_numpy(cu_seq_lens.astype(np.int32))
        max_length = int(lengths.max())
        batch = {
            "input_ids": torch.from_numpy(np.concatenate(ids)).unsqueeze(0),
            "labels": torch.from_numpy(np.concatenate(labels)).unsqueeze(0),
            "position_ids": torch.from_numpy(positions).unsqueeze(0),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max_length,
            "max_length_k": max_length,
            "cu_seq_lens": cu,
            "max_length": max_length,
        }
        if self.use_cache is not None:
            batch["use_cache"] = self.use_cache
        return PlanBatch(batch, record)


class PadCollator(_Collator):
    """Pads a micro-batch's samples to the longest, on the right.

    Returns ``input_ids``, ``labels`` (-100 on padding and at each row's first
    position) and ``attention_mask`` (1 = real token), each (n, longest) int64. An
    empty micro-batch becomes one row of one pad token with mask 1 (a fully masked
    row would make attention NaN) and label -100.

    Args: as `PackCollator`, without ``use_cache`` (a padding mask needs none).
    """

    def __call__(self, items: Sequence[Any]) -> PlanBatch:
        record = getattr(items, "record", None)
        if len(items) == 0:
            dummy = torch.full((1, 1), self.pad_token_id, dtype=torch.int64)
            return PlanBatch(
                {
                    "input_ids": dummy,
                    "labels": torch.full((1, 1), self.ignore_index, dtype=torch.int64),
                    "attention_mask": torch.ones((1, 1), dtype=torch.int64),
                },
                record,
            )
        ids, labels = self._sequences(items, record, padded=True)
        longest = max(a.shape[0] for a in ids)
        input_ids = np.full((len(ids), longest), self.pad_token_id, dtype=np.int64)
        padded_labels = np.full((len(ids), longest), self.ignore_index, dtype=np.int64)
        mask = np.zeros((len(ids), longest), dtype=np.int64)
        for row, (tokens, row_labels) in enumerate(zip(ids, labels)):
            input_ids[row, : tokens.shape[0]] = tokens
            padded_labels[row, : tokens.shape[0]] = row_labels
            mask[row, : tokens.shape[0]] = 1
        return PlanBatch(
            {
                "input_ids": torch.from_numpy(input_ids),
                "labels": torch.from_numpy(padded_labels),
                "attention_mask": torch.from_numpy(mask),
            },
            record,
        )


class with_record:  # noqa: N801 - used like a function: with_record(collate_fn)
    """Wraps any collate function so its batches carry the plan record (a `PlanBatch`).

    ``collate_fn`` receives the items as a plain ``list`` and must return a mapping
    (a dict, or a ``BatchEncoding``) of model inputs.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Mapping[str, Any]]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: Sequence[Any]) -> PlanBatch:
        batch = self.collate_fn(list(items))
        if not isinstance(batch, Mapping):
            raise ConfigError(
                f"with_record needs a collate function that returns a mapping of model inputs; "
                f"{self.collate_fn!r} returned {type(batch).__name__}"
            )
        return PlanBatch(batch, getattr(items, "record", None))


def _as_ids(values: Any, key: str) -> NDArray[np.int64]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise DatasetError(f"{key} of a dataset item has shape {array.shape}; expected a flat sequence of token ids")
    return array.astype(np.int64, copy=False)


def _slice_span(values: NDArray[np.int64], span: tuple[int, int]) -> NDArray[np.int64]:
    start, length = span
    piece = values[start : start + length]
    if piece.shape[0] != length:
        raise DatasetError(
            f"the plan takes tokens [{start}, {start + length}) of a sample that has only "
            f"{values.shape[0]}; the dataset does not match the lengths the plan was built from"
        )
    return piece
