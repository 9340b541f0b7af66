"""Micro-batches of the packers against the lower bound, on real and synthetic lengths.

    python -m bench.bound                       # every file, every cap, docmix 1e6 and 1e7
    python -m bench.bound --no-docmix --caps 384 512
    python -m bench.bound --json

Cases: every Parquet file (``length`` column) in ``data/`` and ``../shared/data/`` (a
file name seen once), at caps 256, 384, 512, 1,024, 2,048, 4,096, 8,192 and 32,768, a
sample longer than the cap split into pieces of the cap and one of the rest; and
"docmix" lengths (`docmix_lengths`) of 10^6 and 10^7 samples at 4,096 and 8,192.

Per case: samples, cap, the bound (`lower_bound`) and its kind, the micro-batches of
best fit decreasing and of `pack_histogram`, whether ``new <= slack(bound)`` (=
max(bound + 1, bound x 1.0001)), and the seconds of each (same process, warm kernels:
compare ratios, not absolute times across runs). A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from batchplan.kernels.pack import _best_fit_decreasing
from batchplan.planning.cutting_stock import lower_bound, pack_histogram, slack

CAPS = (256, 384, 512, 1024, 2048, 4096, 8192, 32768)
DOCMIX_CAPS = (4096, 8192)
DOCMIX_SAMPLES = (10**6, 10**7)


def docmix_lengths(num_samples: int, seed: int = 0) -> np.ndarray:
    """A pretraining mix: 70 % short documents, lognormal with median 300 tokens and sigma
    0.6, and 30 % long ones, lognormal with median 1,800 and sigma 0.6; rounded, at least 1
    (mean about 900 tokens, 0.6 % above 4,096)."""
    rng = np.random.default_rng(seed)
    long = rng.random(num_samples) < 0.3
    short_docs = rng.lognormal(np.log(300), 0.6, num_samples)
    long_docs = rng.lognormal(np.log(1800), 0.6, num_samples)
    return np.maximum(np.rint(np.where(long, long_docs, short_docs)), 1).astype(np.int64)


def split_histogram(lengths: np.ndarray, max_tokens: int) -> np.ndarray:
    """Counts of lengths 0..max_tokens after splitting each sample into pieces of
    ``max_tokens`` and one of the rest (none when it divides)."""
    histogram = np.bincount(lengths % max_tokens, minlength=max_tokens + 1).astype(np.int64)
    histogram[0] = 0
    histogram[max_tokens] += int((lengths // max_tokens).sum())
    return histogram


def best_fit_bins(histogram: np.ndarray, max_tokens: int) -> int:
    """Micro-batches of best fit decreasing (the packer `pack_histogram` must not lose to)."""
    empty = np.empty(0, dtype=np.int64)
    return _best_fit_decreasing(histogram, max_tokens, empty, None, None, None, None)[1].shape[0] - 1


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def run_case(name: str, lengths: np.ndarray, max_tokens: int) -> dict:
    """One row of the table."""
    histogram = split_histogram(lengths, max_tokens)
    bound, bound_s = timed(lower_bound, histogram, max_tokens)
    best_fit, best_fit_s = timed(best_fit_bins, histogram, max_tokens)
    packing, new_s = timed(pack_histogram, histogram, max_tokens)
    bound = max(bound, packing.bound, key=lambda b: b.bins)  # the packer's may be an LP's
    new = packing.offsets.shape[0] - 1
    return {
        "case": name,
        "samples": int(lengths.shape[0]),
        "cap": max_tokens,
        "bound": bound.bins,
        "kind": bound.kind,
        "bfd": best_fit,
        "new": int(new),
        "ok": new <= slack(bound.bins),
        "bound_s": round(bound_s, 3),
        "bfd_s": round(best_fit_s, 3),
        "new_s": round(new_s, 3),
    }


def cases(folders: list[Path], caps: tuple[int, ...], docmix: bool):
    """``(name, lengths, cap)`` for every case."""
    seen = set()
    for folder in folders:
        for path in sorted(folder.glob("*.parquet")):
            if path.name in seen:
                continue
            seen.add(path.name)
            lengths = pq.read_table(path, columns=["length"]).column("length").to_numpy().astype(np.int64)
            lengths = lengths[lengths > 0]
            for cap in caps:
                yield path.stem, lengths, cap
    if docmix:
        for num_samples in DOCMIX_SAMPLES:
            lengths = docmix_lengths(num_samples)
            for cap in DOCMIX_CAPS:
                yield f"docmix {num_samples:.0e}", lengths, cap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, nargs="*", default=[Path("data"), Path("../shared/data")])
    parser.add_argument("--caps", type=int, nargs="*", default=list(CAPS))
    parser.add_argument("--no-docmix", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pack_histogram(split_histogram(np.array([3, 5, 9]), 8), 8)  # load the kernels
    columns = ("case", "samples", "cap", "bound", "kind", "bfd", "new", "ok", "bound_s", "bfd_s", "new_s")
    if not args.json:
        print(" | ".join(columns))
    for name, lengths, cap in cases([p for p in args.data if p.is_dir()], tuple(args.caps), not args.no_docmix):
        row = run_case(name, lengths, cap)
        print(json.dumps(row) if args.json else " | ".join(str(row[c]) for c in columns), flush=True)


if __name__ == "__main__":
    main()
