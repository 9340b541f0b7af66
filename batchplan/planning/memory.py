"""Refuse a build that would not fit in memory, before it starts, with an estimate.

A build holds every epoch in memory until the plan is written, and plans
``min(epochs, BATCHPLAN_THREADS or cores)`` epochs at once, each with its working
arrays. Peak resident memory is estimated as::

    base + entries x (fixed + epochs x held + at_once x work)
         + rows_per_epoch x epochs x row_held
         + at_once x kernel(max_tokens)
         [+ spans: entries x (span_fixed + epochs x span_held)]
         [+ cost model: entries x at_once x cost_work]

with the constants below, fitted by ``python -m bench.memory_fit`` to the peak resident set of
54 builds, each that build's own (``os.wait4`` of the child): the CLI's ``build`` of
``lengths.parquet`` with ``BATCHPLAN_THREADS=T`` and ``max_tokens`` C, ``mode`` M,
``world_size`` W, ``epochs`` E, ``oversize`` truncate or split, ``layout`` file or directory,
and ``hidden_size`` 4096 or none (``bench/memory_fit.py`` has the command line), on
lognormal lengths (``bench.scale.write_lognormal``: median 300 tokens, clipped at the cap,
or at 4 x the cap to split), varied one or two terms at a time around pack, 8,192, truncate
(no cuts), 1 epoch, 1 thread, 64 ranks, one file: 1e5 to 3e7 samples (1e8 for three builds),
1, 2 and 4 epochs, 1 and 2 threads, pack and pad, max_tokens 512, 2,048 and 8,192, split, the
cost model, plan directories (1 or 2 epochs held, as `MemoryEstimate.with_epochs` counts them)
and 1,024 ranks; batchplan 0.1.0, numpy 2.4, numba 0.68, pyarrow 26, Linux x86-64, 2 cores,
each build run once. The constants are the whole, non-negative numbers (HiGHS) that minimise
the worst relative error, an under-estimate (a build let through that runs out of memory)
counting three times an over-estimate. Every estimate is within `ESTIMATE_BAND` of its
measured peak: small builds err high (1e5 samples: 0.19 GiB measured, 0.26 GiB estimated), as
do pack 1e8 (1 epoch, 8,192: 1.24 GiB measured, 1.60 GiB estimated; 2 epochs in a directory:
+35 %) and split at 512 (+30 % at 3e7, 2 epochs); pack 512 at 3e7 (1.14 GiB measured, 1.01 GiB
estimated), pad with 2 epochs on 2 threads and split at 8,192 (-12 %) err low. Epochs of at
least 2^27 entries compress their bins while they are scheduled (`batchplan.planning.bins`), which
the form does not know: there it errs high (one epoch of 1e9: 7.2 GiB measured, 13.7 GiB
estimated). It is an estimate: other length distributions, library versions and the allocator
move it; docs/reliability.md has the table.

``kernel(max_tokens)`` is what the kernels allocate per length or capacity value:
pack ``16 x 2^ceil(log2(max_tokens + 1)) + 24 x (max_tokens + 2)`` bytes (a segment tree
and stacks over capacities, length offsets), pad ``8 x (max_tokens + 2)`` (the counts of a
counting sort, zeroed, so resident, whether or not the sort runs); measured within 2 % at
max_tokens 2^24 and 2^26 (0.9 and 3.5 GiB in pack mode); pad: +0.11 GiB at 2^24.

The available memory is what the system or the container can still give (``MemAvailable``,
or a cgroup limit less its working set) plus what this process already holds, since the
estimate is of the whole peak. Before the lengths are read only the sample count is known
(Parquet metadata), so the first check counts entries alone (a lower bound); the second,
once lengths are in memory and before planning, adds micro-batches and spans estimated
from the lengths.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from batchplan.config import PlanConfig
from batchplan.errors import ConfigError

__all__ = [
    "ESTIMATE_BAND",
    "SKIP_VARIABLE",
    "MemoryEstimate",
    "available_memory_bytes",
    "check_build_memory",
    "estimate_build_memory",
    "estimate_layout",
    "length_counts",
    "kernel_bytes",
]

SKIP_VARIABLE = "BATCHPLAN_MEMORY_CHECK"  # "0": build even when the estimate does not fit
ESTIMATE_BAND = "-12 %/+35 %"  # the worst errors of the fit below (`python -m bench.memory_fit`)

# Measured constants (bytes; see the module docstring for how).
BASE_BYTES = 265 * 2**20  # Python, numpy, pyarrow, numba, typer (~195 MiB measured at 1e5 samples) and margin
ENTRY_FIXED = 7  # lengths read, entries
ENTRY_HELD = 4  # per epoch, until the plan is written
ENTRY_WORK = 2  # per epoch planned at once
ROW_HELD = 23  # per micro-batch, per epoch (the fit puts per-micro-batch planning arrays here too)
SPAN_FIXED = 43  # per entry with oversize truncate or split cutting samples
SPAN_HELD = 0  # per entry per epoch (starts/lengths columns; the fit puts them in SPAN_FIXED)
COST_WORK = 1  # per entry per epoch planned at once, with a cost model
# Micro-batches per max_tokens of kept tokens: pack fills ~100 % of them, pad ~83 %.
ROWS_PER_CAP = {"pack": 1.0, "pad": 1.2}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """What a build will hold, and its estimated peak (`num_bytes`).

    Attributes:
        num_entries: samples (or pieces of split samples) to place.
        rows_per_epoch: micro-batches per epoch (0 before the lengths are read).
        epochs: epochs in the plan, all held until it is written.
        at_once: epochs planned at the same time (threads).
        has_spans: samples are truncated or split (span columns).
        has_cost: a cost model is used (``hidden_size`` / ``attention_coefficient``).
        kernel_bytes: what the kernels of one epoch allocate per value of max_tokens.
        complete: False before the lengths are read: a lower bound.
    """

    num_entries: int
    rows_per_epoch: int
    epochs: int
    at_once: int
    has_spans: bool = False
    has_cost: bool = False
    kernel_bytes: int = 0
    complete: bool = True

    @property
    def num_bytes(self) -> int:
        per_entry = ENTRY_FIXED + self.epochs * ENTRY_HELD + self.at_once * ENTRY_WORK
        if self.has_spans:
            per_entry += SPAN_FIXED + self.epochs * SPAN_HELD
        if self.has_cost:
            per_entry += self.at_once * COST_WORK
        per_row = self.epochs * ROW_HELD
        kernels = self.at_once * self.kernel_bytes
        return BASE_BYTES + self.num_entries * per_entry + self.rows_per_epoch * per_row + kernels

    def with_epochs(self, epochs: int, at_once: int) -> MemoryEstimate:
        return dataclasses.replace(self, epochs=epochs, at_once=max(1, min(epochs, at_once)))


def estimate_layout(
    lengths: NDArray[np.integer], config: PlanConfig, counts: tuple[int, int, NDArray[np.int64]] | None = None
) -> tuple[int, int, bool]:
    """``(entries, micro-batches per epoch, has spans)`` a build of ``lengths`` will make, estimated.

    Micro-batches: kept tokens / max_tokens (pad: x 1.2 for padding), and at least one
    per entry longer than max_tokens / 2 (no two of them share one). ``counts``: the
    lengths' `length_counts`, when known.
    """
    cap = config.max_tokens
    num_entries = int(lengths.shape[0])
    tokens, big, oversize = counts or length_counts(lengths, cap)
    # A sequence-length warmup also cuts samples (into more pieces early on: not counted).
    has_spans = (bool(oversize.size) and config.oversize in ("truncate", "split")) or config.has_seqlen_warmup
    if oversize.size and config.oversize == "drop":
        num_entries -= oversize.size
        tokens -= int(oversize.sum())
        big -= oversize.size
    elif oversize.size and config.oversize == "truncate":
        tokens -= int((oversize - cap).sum())
    elif oversize.size and config.oversize == "split":
        num_entries += int(((oversize + cap - 1) // cap - 1).sum())
        big += int((oversize // cap - 1).sum())  # full pieces beyond the first
    rows = max(int(np.ceil(tokens / cap * ROWS_PER_CAP[config.mode])), big) + config.world_size
    return num_entries, rows, has_spans


def length_counts(lengths: NDArray[np.integer], cap: int) -> tuple[int, int, NDArray[np.int64]]:
    """``(tokens, lengths above cap // 2, the lengths above cap)``, a chunk of `COUNT_CHUNK`
    at a time: comparing the whole array at once would write (and fault in) a boolean array
    as long as it, which costs more than the comparisons (~2 s against ~0.2 s at 10^9)."""
    tokens, big, oversize = 0, 0, [np.zeros(0, dtype=np.int64)]
    for start in range(0, lengths.shape[0], COUNT_CHUNK):
        chunk = lengths[start : start + COUNT_CHUNK]
        tokens += int(chunk.sum(dtype=np.int64))
        big += int(np.count_nonzero(chunk > cap // 2))
        if int(chunk.max()) > cap:
            oversize.append(chunk[chunk > cap].astype(np.int64))
    return tokens, big, np.concatenate(oversize)


COUNT_CHUNK = 1 << 20


def estimate_build_memory(
    num_samples: int,
    config: PlanConfig,
    *,
    num_threads: int,
    lengths: NDArray[np.integer] | None = None,
) -> MemoryEstimate:
    """Estimate the peak memory of building a plan of ``num_samples`` samples with ``config``.

    Args:
        num_samples: samples of the dataset (Parquet metadata row count).
        config: the build configuration.
        num_threads: threads planning epochs (`batchplan.config.num_threads`).
        lengths: the sample lengths, when read; without them micro-batches and spans
            are not counted and the estimate is a lower bound.
    """
    if lengths is None:
        num_entries, rows, has_spans = num_samples, 0, False
        tokens = num_samples  # a lower bound: lengths are >= 1 (empty samples are refused or dropped)
    else:
        counts = length_counts(np.asarray(lengths), config.max_tokens)
        num_entries, rows, has_spans = estimate_layout(np.asarray(lengths), config, counts)
        tokens = counts[0]
    estimate = MemoryEstimate(
        num_entries,
        rows,
        config.epochs,
        1,
        has_spans,
        config.cost_coefficient is not None,
        kernel_bytes(config, tokens),
        complete=lengths is not None,
    )
    return estimate.with_epochs(config.epochs, num_threads)


def kernel_bytes(config: PlanConfig, tokens: int | None = None) -> int:
    """Bytes the kernels of one epoch allocate in proportion to their capacity (see the module
    docstring). Pack packs with ``min(max_tokens, all the tokens)`` (``tokens``; unknown:
    at least one per sample was assumed by the caller); pad zeroes its counts of lengths
    (``max_tokens + 2`` of them) whether or not it sorts by counting."""
    if config.mode == "pad":
        return 8 * (config.max_tokens + 2)
    cap = config.max_tokens if tokens is None else max(1, min(config.max_tokens, tokens))
    return 16 * (1 << cap.bit_length()) + 24 * (cap + 2)  # 1 << bit_length: the power of 2 >= cap + 1


def available_memory_bytes() -> int | None:
    """Memory this process can use at its peak: what it holds now plus what is free
    (``MemAvailable``, capped by a container's cgroup limit less its working set).

    None when unknown (not Linux, unreadable files).
    """
    found = [value for value in (_meminfo_available(), _cgroup_available()) if value is not None]
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return min(found) + _resident_bytes()


def check_build_memory(estimate: MemoryEstimate) -> None:
    """Raise `ConfigError` when ``estimate`` exceeds the available memory.

    The message names the estimate, what is available, and what would fit: one epoch
    planned at a time (``BATCHPLAN_THREADS=1``), fewer epochs per plan.
    ``BATCHPLAN_MEMORY_CHECK=0`` skips the check (when the estimate is known to be wrong).
    """
    if os.environ.get(SKIP_VARIABLE) == "0":
        return
    free = available_memory_bytes()
    if free is None or estimate.num_bytes <= free:
        return
    fixes = []
    if estimate.at_once > 1:
        one = estimate.with_epochs(estimate.epochs, 1).num_bytes
        fixes.append(f"BATCHPLAN_THREADS=1 (one epoch planned at a time: ~{_gib(one)})")
    fitting = next(
        (e for e in range(estimate.epochs - 1, 0, -1) if estimate.with_epochs(e, estimate.at_once).num_bytes <= free), 0
    )
    if fitting:
        fixes.append(f"`epochs={fitting}` (a plan of fewer epochs)")
    fixes.append("a machine with more memory")
    at_least = "" if estimate.complete else "at least "
    per_epoch = f", ~{estimate.rows_per_epoch:,} micro-batches per epoch" if estimate.complete else ""
    raise ConfigError(
        f"this build needs an estimated {at_least}{_gib(estimate.num_bytes)} of memory "
        f"({estimate.num_entries:,} {'entries (samples and pieces)' if estimate.has_spans else 'samples'}"
        f"{per_epoch}, {estimate.epochs} epoch(s), {estimate.at_once} planned "
        f"at once) but {_gib(free)} is available; use {' or '.join(fixes)}; the estimate is within {ESTIMATE_BAND} "
        f"of measured peaks, set {SKIP_VARIABLE}=0 to build anyway"
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"


def _resident_bytes() -> int:
    """This process's resident set (0 when unknown)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available() -> int | None:
    """A container's memory limit less its working set (usage less reclaimable file cache)."""
    for limit_file, usage_file, inactive_key in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "inactive_file"),  # cgroup v2
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
            "total_inactive_file",
        ),  # cgroup v1
    ):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 2**60:  # no limit
                continue
            usage = int(Path(usage_file).read_text())
            stat = Path(limit_file).with_name("memory.stat").read_text().split()
            inactive = dict(zip(stat[::2], stat[1::2])).get(inactive_key, "0")
            return max(0, int(raw) - usage + int(inactive))
        except (OSError, ValueError):
            continue
    return None
