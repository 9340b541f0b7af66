"""What a mixture costs against one dataset: build time, peak memory and fill.

    python -m bench.mixture --samples 1e7 --sources 50 [--pairs 3] [--json]
    python -m bench.mixture --fill

The time and memory case writes ``--samples`` lognormal lengths (`bench.build`) as
``--sources`` Parquet files of Zipf-distributed sizes, and a mixture of them whose weights
are Zipf too and whose ``tokens`` are the lengths' total (small sources repeat, large ones
are cut); its planned uses are written as one dataset. Then it builds both with the same
options (pack, ``--max-tokens``, ``--world-size``, one epoch, truncate), each in a child
process (`bench.build.run_measured`: wall seconds and the child's own peak RSS),
interleaved A B A B for ``--pairs`` pairs, and prints each run, the median ratio of times
and of peaks, and the load average before each run.

``--fill`` plans data/mixture.yaml (8,192, 8 ranks, 4 micro-batches, split) and the same
uses as one dataset, in-process, and prints each one's packed micro-batches and bound:
what packing every source's passes on their own costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.build import lognormal_lengths, run_measured, write_lengths

ROOT = Path(__file__).resolve().parent.parent


def write_case(directory: Path, num_samples: int, num_sources: int, max_tokens: int) -> tuple[Path, Path]:
    """The mixture file of the time case and the one-dataset file of the same uses."""
    from batchplan import PlanConfig
    from batchplan.formats.mixture_file import read_mixture, read_mixture_lengths
    from batchplan.planning.mixture_epochs import prepare_mixture_entries

    lengths = lognormal_lengths(num_samples, max_tokens)
    ranks = np.arange(1, num_sources + 1, dtype=np.float64)
    sizes = np.maximum(1, np.floor(num_samples * (1 / ranks) / (1 / ranks).sum())).astype(np.int64)
    sizes[0] += num_samples - sizes.sum()
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    weights = np.random.default_rng(1).permutation(1 / ranks)  # Zipf weights, not in size order
    sources = []
    for index in range(num_sources):
        path = directory / f"source{index:03d}.parquet"
        write_lengths(lengths[bounds[index] : bounds[index + 1]], path)
        sources.append({"name": f"s{index:03d}", "paths": [path.name], "weight": float(weights[index])})
    mixture = directory / "mixture.json"
    mixture.write_text(json.dumps({"sources": sources, "tokens": int(lengths.sum(dtype=np.int64))}))
    read = read_mixture_lengths(read_mixture(mixture))
    config = PlanConfig(max_tokens=max_tokens, oversize="truncate")
    uses = prepare_mixture_entries(read_mixture(mixture), read.lengths, read.offsets, config).entries
    single = directory / "uses.parquet"
    write_lengths(uses.length.astype(np.int32), single)
    return mixture, single


def build_args(args) -> list[str]:
    return ["--max-tokens", str(args.max_tokens), "--world-size", str(args.world_size), "--oversize", "truncate",
            "-q"]  # fmt: skip


def time_case(args) -> dict:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        directory = Path(tmp)
        mixture, single = write_case(directory, int(float(args.samples)), args.sources, args.max_tokens)
        cli = [sys.executable, "-m", "batchplan_cli.main", "build"]
        commands = {
            "mixture": [*cli, "--mixture", str(mixture), "-o", str(directory / "mixture.arrow"), *build_args(args)],
            "one dataset": [*cli, str(single), "-o", str(directory / "single.arrow"), *build_args(args)],
        }
        runs = {name: [] for name in commands}
        for _ in range(args.pairs):
            for name, command in commands.items():
                load = os.getloadavg()[0]
                seconds, peak = run_measured(command)
                runs[name].append({"seconds": seconds, "peak_gib": peak, "load": load})
                print(f"{name:12s} {seconds:7.2f} s  peak {peak:5.2f} GiB  (load {load:.2f})", file=sys.stderr)
    time_ratios = [m["seconds"] / s["seconds"] for m, s in zip(runs["mixture"], runs["one dataset"])]
    peak_ratios = [m["peak_gib"] / s["peak_gib"] for m, s in zip(runs["mixture"], runs["one dataset"])]
    return {
        "samples": int(float(args.samples)), "sources": args.sources, "runs": runs,
        "time_ratio_median": statistics.median(time_ratios), "time_ratios": time_ratios,
        "peak_ratio_median": statistics.median(peak_ratios), "peak_ratios": peak_ratios,
    }  # fmt: skip


def fill_case() -> dict:
    from batchplan import PlanConfig
    from batchplan.formats.mixture_file import read_mixture, read_mixture_lengths
    from batchplan.planning.epochs import PreparedEntries, build_plan, plan_epochs
    from batchplan.planning.mixture_epochs import prepare_mixture_entries

    mixture = read_mixture(ROOT / "data" / "mixture.yaml")
    read = read_mixture_lengths(mixture)
    config = PlanConfig(max_tokens=8192, world_size=8, micro_batches=4, oversize="split")
    prepared = prepare_mixture_entries(mixture, read.lengths, read.offsets, config)
    mixed = next(plan_epochs(PreparedEntries.of_mixture(read.num_samples, prepared), config)).packing
    single = build_plan(prepared.entries.length, PlanConfig(max_tokens=8192, world_size=8, micro_batches=4))
    together = single.epochs[0].packing
    rows = {"mixture": mixed, "one dataset": together}
    return {
        name: {"micro_batches": p.micro_batches, "bound": p.bound, "kind": p.kind, "fill": p.fill(8192)}
        for name, p in rows.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="1e7")
    parser.add_argument("--sources", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--fill", action="store_true", help="the demo mixture's packing against one dataset's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = fill_case() if args.fill else time_case(args)
    if args.json:
        print(json.dumps(result, indent=1))
    elif args.fill:
        for name, row in result.items():
            print(f"{name:12s} {row['micro_batches']:,} micro-batches (bound {row['bound']:,}, {row['kind']}), "
                  f"fill {row['fill']:.3%}")  # fmt: skip
    else:
        print(f"{result['samples']:,} samples over {result['sources']} sources: mixture / one dataset: time "
              f"{result['time_ratio_median']:.2f}x (median of {args.pairs}), peak {result['peak_ratio_median']:.2f}x")


if __name__ == "__main__":
    main()
