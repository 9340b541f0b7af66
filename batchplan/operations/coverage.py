"""Exactly-once coverage of one epoch, counted one rank's entries at a time.

What holds when `EpochCoverage.check` finds nothing:
- no sample listed as dropped (``empty``, ``oversize``) is planned or was trained before the
  plan's first step (a resharded plan's ``consumed``);
- plans without spans: every other sample is planned exactly once, counting what was trained
  before, and samples dropped by ``drop_last`` not at all;
- plans with spans: the planned pieces, the pieces dropped by ``drop_last`` and the pieces
  trained before never overlap and tile each kept sample's tokens from token 0 (truncate keeps
  the first ``max_tokens``); without the dataset's lengths, every kept sample has a piece.

Memory: one byte per sample (a counter), one rank's entries, and the pieces: entries that hold
part of a sample (of a split sample; a truncated sample's one entry holds all it keeps), a
minority, 24 bytes each while counted and about 45 while sorted. An entry that holds a whole
sample costs a store into the counter, and a duplicate shows as fewer samples counted than
entries stored. Only the pieces are sorted, with the whole entries of samples that have pieces
too (a second pass over the ranks, which a sound plan checked with the dataset's lengths never
needs). A plan without spans whose samples repeat is counted again exactly
(`batchplan.reduce.add_counts`) to name them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
from numpy.typing import NDArray

from batchplan.reduce import add_counts

__all__ = ["EpochCoverage", "RankEntries"]

# One rank's entries: samples, then starts and lengths (None in a plan without spans).
RankEntries = tuple[np.ndarray, np.ndarray | None, np.ndarray | None]

# Counter values the final scan skips: samples with pieces (checked by sorting), and dropped ones.
_SPLIT, _DROPPED = 3, 4
_CHUNK = 1 << 18  # samples per step of the final scan: its temporaries stay near 1 MiB


class EpochCoverage:
    """Counts an epoch's entries (`add`, rank after rank), then checks them (`check`).

    Args:
        num_samples: the dataset's rows.
        has_spans: whether the plan has ``starts``/``lengths``.
        lengths: the dataset's lengths, or None (then coverage by length is not checked).
        cap: ``max_tokens`` when oversize samples are truncated (the tokens an epoch covers), else None.
        trained_whole: samples trained whole before the plan's first step (bool per sample), or None.
        trained_spans: shape (n, 3): ``[sample, start, length]`` pieces trained before it.
    """

    def __init__(
        self,
        num_samples: int,
        has_spans: bool,
        lengths: NDArray[np.integer] | None,
        cap: int | None,
        trained_whole: NDArray[np.bool_] | None,
        trained_spans: NDArray[np.int64],
    ) -> None:
        self.has_spans, self.lengths, self.cap = has_spans, lengths, cap
        self.trained_whole, self.trained_spans = trained_whole, trained_spans
        self.counts = np.zeros(num_samples, dtype=np.uint8)  # whole entries per sample: 0, 1, 2 = more
        self.num_whole = 0  # whole entries stored into ``counts``
        self.num_entries = 0  # entries added: the next one's position in the epoch
        self.pieces: tuple[list[np.ndarray], ...] = ([], [], [], [])  # sample, start, length, position: per rank
        self.whole_again = False  # a planned entry of a sample trained whole before

    def add(self, samples: np.ndarray, starts: np.ndarray | None = None, lengths: np.ndarray | None = None) -> None:
        """One rank's entries, in the plan's order (ranks in order)."""
        position = self.num_entries
        self.num_entries += samples.shape[0]
        if self.has_spans:
            assert starts is not None and lengths is not None  # a plan with spans: every rank's entries have them
            if self.trained_whole is not None and self.trained_whole[samples].any():
                self.whole_again = True
            whole = self._whole(samples, starts, lengths)
            if not whole.all():
                where = np.flatnonzero(~whole)
                for column, values in zip(
                    self.pieces, (samples[where], starts[where], lengths[where], position + where)
                ):
                    column.append(values)
                samples = samples[whole]
        self.counts[samples] = 1  # a repeat stores 1 again: ``num_whole`` tells
        self.num_whole += samples.shape[0]

    def check(
        self,
        always: NDArray[np.int64],
        last: NDArray[np.int64],
        last_spans: NDArray[np.int64],
        reread: Callable[[], Iterable[RankEntries]],
    ) -> str | None:
        """The first coverage violation, or None.

        Args:
            always: samples dropped from every epoch (empty, oversize).
            last: samples this epoch's ``drop_last`` leaves out.
            last_spans: shape (n, 3): the pieces it leaves out (plans with spans).
            reread: every rank's entries again, in the order they were added (read only for
                a plan that needs a second pass).
        """
        if self._held(always):
            return "a sample listed as dropped is in the plan (or was trained before it)"
        if self.has_spans:
            return self._check_pieces(always, last, last_spans, reread)
        if self.trained_spans.size:
            return "pieces of samples are listed as consumed in a plan without spans"
        return self._check_once(always, last, reread)

    def _whole(self, samples, starts, lengths) -> NDArray[np.bool_]:
        """Which entries hold a whole (kept) sample; without the dataset, which start it."""
        whole = (starts == 0) & (lengths >= 1)
        if self.lengths is not None:
            whole &= lengths == self._kept(samples)
        return whole

    def _kept(self, index) -> np.ndarray:
        """Tokens an epoch covers of the samples at ``index`` (an array or a slice); with the dataset only."""
        assert self.lengths is not None  # the callers check
        kept = self.lengths[index]
        # The cap as int64: a Python int above the lengths' dtype (uint16) would not convert.
        return kept if self.cap is None else np.minimum(kept, np.int64(self.cap))

    def _held(self, samples: NDArray[np.int64]) -> bool:
        """Whether any of ``samples`` is planned or was trained before the first step."""
        if (self.counts[samples] > 0).any():
            return True
        if self.trained_whole is not None and self.trained_whole[samples].any():
            return True
        self.counts[samples] = _DROPPED  # their counts are 0: mark them to look them up among the pieces
        found = any((self.counts[part] == _DROPPED).any() for part in (*self.pieces[0], self.trained_spans[:, 0]))
        self.counts[samples] = 0
        return found

    def _check_once(self, always, last, reread) -> str | None:
        """Plans without spans: every sample kept is planned or was trained exactly once."""
        if np.count_nonzero(self.counts) != self.num_whole:  # a sample repeats: count exactly
            self.counts[:] = 0
            for samples, _, _ in reread():
                add_counts(self.counts, samples, 2)
        last_held = self._held(last)
        self.counts[always] = _DROPPED
        self.counts[last] = _DROPPED
        wrong, first = self._scan(self._not_once)
        if wrong:
            return (
                f"{wrong:,} samples are not planned exactly once "
                f"(sample {first:,} appears {self._times(first, reread)} times)"
            )
        if last_held:
            return "a sample dropped by drop_last is in the plan (or was trained before it)"
        return None

    def _not_once(self, part: slice) -> NDArray[np.bool_]:
        """Which samples of ``part`` (not dropped) are planned or were trained other than once."""
        counts = self.counts[part]
        held = counts if self.trained_whole is None else counts + self.trained_whole[part]
        return (counts != _DROPPED) & (held != 1)

    def _unplanned(self, part: slice) -> NDArray[np.bool_]:
        """Which samples of ``part`` (neither split nor dropped) have no whole entry and were not
        trained whole."""
        unplanned = self.counts[part] == 0
        return unplanned if self.trained_whole is None else unplanned & ~self.trained_whole[part]

    def _times(self, sample: int, reread) -> int:
        """How many times ``sample`` is planned or was trained."""
        before = 0 if self.trained_whole is None else int(self.trained_whole[sample])
        if self.counts[sample] < 2:
            return int(self.counts[sample]) + before
        return sum(int(np.count_nonzero(samples == sample)) for samples, _, _ in reread()) + before

    def _check_pieces(self, always, last, last_spans, reread) -> str | None:
        """Plans with spans: pieces tile each kept sample exactly (see the module docstring)."""
        if not np.array_equal(np.unique(last_spans[:, 0]), np.unique(last)):
            return "drop_last lists other samples than its dropped pieces"
        whole = self.trained_whole
        if whole is not None and (
            self.whole_again or whole[last_spans[:, 0]].any() or whole[self.trained_spans[:, 0]].any()
        ):
            return "a sample trained whole before the plan's first step is planned again"
        sample, start, length = self._sorted_pieces(last_spans, reread)
        same = sample[1:] == sample[:-1]
        repeated = np.count_nonzero(self.counts) != self.num_whole  # two whole entries of a sample
        if repeated or (same & (start[1:] < start[:-1] + length[:-1])).any():
            return "two pieces of a sample overlap"
        first = np.ones(sample.shape[0], dtype=bool)  # each sample's first piece
        first[1:] = ~same
        split = sample[first]
        self.counts[split] = _SPLIT
        self.counts[always] = _DROPPED
        if self.lengths is None:
            if self._scan(self._unplanned)[0]:
                return "a sample is neither planned, trained before, nor listed as dropped"
            return None
        kept = self._kept(sample)
        if (start + length > kept).any():
            return "a piece reaches past the end of its sample"
        if (start[first] != 0).any():
            return "a sample's first piece does not start at token 0"
        # Without overlaps, from token 0 and never past the end: equal totals mean no gap.
        covered = np.add.reduceat(length, np.flatnonzero(first)) if length.size else length
        wrong = split[(covered != kept[first]) & (self.counts[split] != _DROPPED)]
        count, earliest = self._scan(lambda part: self._unplanned(part) & (self._kept(part) != 0))
        if count + wrong.size:
            earliest = min(x for x in (earliest, int(wrong[0]) if wrong.size else -1) if x >= 0)
            return f"{count + wrong.size:,} samples are not covered exactly once (sample {earliest:,})"
        return None

    def _sorted_pieces(self, last_spans, reread) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every piece (planned, dropped, trained before), with the whole entries of samples
        that have pieces too, sorted by (sample, start, position): (sample, start, length).
        Memory: the pieces as int64, joined one column at a time, and the order."""
        position = self.num_entries
        for spans in (last_spans, self.trained_spans):
            for column, values in zip(self.pieces, (*spans.T, position + np.arange(spans.shape[0]))):
                column.append(values)
            position += spans.shape[0]
        if any((self.counts[part] > 0).any() for part in self.pieces[0]):  # a sample with both
            split = np.unique(np.concatenate(self.pieces[0]))
            for found in self._whole_entries_of(split, reread):
                for column, values in zip(self.pieces, found):
                    column.append(values)
        columns = []
        for column in self.pieces:  # each column joined, and its parts freed, in turn
            columns.append(np.concatenate(column, dtype=np.int64))
            column.clear()
        samples, starts, lengths, positions = columns
        del columns
        order = np.lexsort((positions, starts, samples))
        del positions
        samples = samples[order]  # each column sorted, and the unsorted one freed, in turn
        starts = starts[order]
        lengths = lengths[order]
        return samples, starts, lengths

    def _whole_entries_of(self, split: NDArray[np.int64], reread) -> Iterator[tuple[np.ndarray, ...]]:
        """The whole entries of the samples ``split`` (sorted), as pieces: (sample, start, length,
        position), rank by rank."""
        base = 0
        for samples, starts, lengths in reread():
            where = np.flatnonzero(self._whole(samples, starts, lengths))
            found = np.searchsorted(split, samples[where]).clip(max=split.shape[0] - 1)
            where = where[split[found] == samples[where]]
            yield samples[where], starts[where], lengths[where], base + where
            base += samples.shape[0]

    def _scan(self, bad: Callable[[slice], NDArray[np.bool_]]) -> tuple[int, int]:
        """How many samples ``bad`` (a mask over a slice of samples) holds, and the first (-1 if none)."""
        count, first = 0, -1
        for begin in range(0, self.counts.shape[0], _CHUNK):
            mask = bad(slice(begin, begin + _CHUNK))
            found = int(np.count_nonzero(mask))
            if found and first < 0:
                first = begin + int(np.argmax(mask))
            count += found
        return count, first
