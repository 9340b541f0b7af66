"""Pretraining scale: one epoch of 10⁶ .. 10⁹ samples written as a plan directory, against a
numpy permutation of as many indices, and what a rank pays to open its slice.

    python -m bench.scale --samples 1e7 1e8 --world-size 1024              # 3 pairs each
    python -m bench.scale --samples 1e9 --world-size 1024 --tmp DIR        # 2 pairs, ~13 GB on disk
    python -m bench.scale --samples 1e8 --open-world-sizes 64 1024 4096

For each sample count: lognormal lengths (`bench.build.lognormal_lengths`, median 300, clipped at
the cap), written to Parquet in chunks of 10⁷ (bounded memory; not timed); then, interleaved
(build, permutation, build, permutation, ... for ``--pairs`` pairs: 3 below 10⁹, 2 at 10⁹ by
default), each its own subprocess: `batchplan build --layout directory --epochs 1` (pack, the
cap, the world size) with its wall time and peak resident memory (getrusage of the child), and
`numpy.random.default_rng(0).permutation(N)` (the yardstick). Before each run the 1-minute load
average is read, after waiting up to ``--settle`` seconds (60) for it to fall below
``--quiet-load`` (a build's own threads lift it for a minute after it ends); a row reports the
median build, the median permutation, the median of the pairs' ratios with their spread
(min..max), the highest load seen, and ``quiet`` (every load below ``--quiet-load``, 1.0 by
default): a row that is not quiet is not to be quoted.

The build's fixed cost (interpreter, imports, the numba cache, writing a manifest) is measured
once per run as the median of three builds of 1,000 samples (``startup_s``); each row also
gives ``ns_per_sample``: (median build - startup) / N, the planning time per sample, which is
what should stay flat from 10⁷ to 10⁹. A build of 1,000 samples first warms the numba cache.

With ``--open-world-sizes``, a plan is built per world size (once, not interleaved) and, for a
few ranks, a fresh process imports ``batchplan.runtime`` (not timed), then times
``PlanSampler(plan, rank=r, world_size=W)`` and its first batch (open the manifest, map the
epoch's file, read and check the rank's rows: what a training process does before its first
batch) and lists the plan files it has mapped or open. The files were just written, so they are
in the page cache: on a cold network file system add its latency per file (two files: the
manifest and the epoch's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.build import lognormal_lengths, permutation_in_child, run_in_child, run_measured

CHUNK = 10**7

_OPEN = """
import json, os, sys, time
from batchplan.runtime import PlanSampler
path, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start = time.perf_counter()
sampler = PlanSampler(path, rank=rank, world_size=world)
first = next(iter(sampler))  # the rank's rows of the epoch are read here
seconds = time.perf_counter() - start
names = {line.split()[-1] for line in open("/proc/self/maps") if path in line}
for fd in os.listdir("/proc/self/fd"):
    try:
        names.add(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
print(json.dumps({"seconds": seconds, "plan_files": sorted(os.path.basename(n) for n in names if path in n)}))
"""


def write_lognormal(path: Path, num_samples: int, max_tokens: int) -> None:
    """``num_samples`` lognormal lengths in chunks of 10⁷ (chunk ``i`` drawn with seed ``i``)."""
    schema = pa.schema([("length", pa.int32())])
    with pq.ParquetWriter(path, schema) as writer:
        for index, start in enumerate(range(0, num_samples, CHUNK)):
            lengths = lognormal_lengths(min(CHUNK, num_samples - start), max_tokens, seed=index)
            writer.write_table(pa.table({"length": lengths}, schema=schema), row_group_size=1 << 22)


def build(dataset: Path, output: Path, max_tokens: int, world_size: int) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB, `bench.build.run_measured`) of one directory build."""
    return run_measured(
        [
            sys.executable,
            "-m",
            "batchplan_cli.main",
            "build",
            str(dataset),
            "-o",
            str(output),
            "--max-tokens",
            str(max_tokens),
            "--world-size",
            str(world_size),
            "--epochs",
            "1",
            "--layout",
            "directory",
            "-q",
        ]
    )


def open_seconds(plan: Path, rank: int, world_size: int) -> dict:
    found = subprocess.run(
        [sys.executable, "-c", _OPEN, str(plan), str(rank), str(world_size)], check=True, capture_output=True, text=True
    )
    return json.loads(found.stdout)


def directory_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.iterdir()) / 2**20


def load_average() -> float:
    """The 1-minute load average (what `uptime` shows first)."""
    return os.getloadavg()[0]


def settled_load(quiet_load: float, settle: float) -> float:
    """The load average once it is below ``quiet_load``, waiting at most ``settle`` seconds
    (a build's own threads lift it for a minute after it ends)."""
    deadline = time.monotonic() + settle
    while load_average() >= quiet_load and time.monotonic() < deadline:
        time.sleep(5)
    return load_average()


def interleaved(dataset: Path, plan: Path, samples: int, args) -> dict:
    """Build and permutation alternated for the row's pairs; medians, the ratios' spread, loads."""
    builds, permutations, peaks, loads = [], [], [], []
    for _ in range(args.pairs or (2 if samples >= 10**9 else 3)):
        loads.append(settled_load(args.quiet_load, args.settle))
        wall, peak = build(dataset, plan, args.max_tokens, args.world_size)
        builds.append(wall)
        peaks.append(peak)
        _remove(plan)
        loads.append(settled_load(args.quiet_load, args.settle))
        permutations.append(permutation_in_child(samples))
    ratios = [b / p for b, p in zip(builds, permutations)]
    build_s = statistics.median(builds)
    return {
        "samples": samples,
        "world_size": args.world_size,
        "pairs": len(builds),
        "build_s": round(build_s, 2),
        "permutation_s": round(statistics.median(permutations), 2),
        "ratio": round(statistics.median(ratios), 2),
        "ratio_spread": f"{min(ratios):.2f}..{max(ratios):.2f}",
        "ns_per_sample": round((build_s - args.startup_s) / samples * 1e9, 1),
        "peak_rss_gib": round(max(peaks), 2),
        "max_load": round(max(loads), 2),
        "quiet": max(loads) < args.quiet_load,
    }


def startup_seconds(tmp: Path, max_tokens: int) -> float:
    """Median wall time of three builds of 1,000 samples: the build's fixed cost."""
    run_in_child("bench.scale:write_lognormal", tmp / "tiny.parquet", 1000, max_tokens)
    build(tmp / "tiny.parquet", tmp / "tiny", max_tokens, 8)  # warm the numba cache
    times = []
    for _ in range(3):
        _remove(tmp / "tiny")
        times.append(build(tmp / "tiny.parquet", tmp / "tiny", max_tokens, 8)[0])
    return statistics.median(times)


def opened(dataset: Path, plan_base: Path, samples: int, args) -> list[dict]:
    """One row per world size of ``--open-world-sizes``: a build, and what three ranks pay to open it."""
    rows = []
    for world_size in args.open_world_sizes:
        plan = plan_base.with_name(f"{plan_base.name}-{world_size}")
        wall, peak = build(dataset, plan, args.max_tokens, world_size)
        opens = [open_seconds(plan, rank, world_size) for rank in (0, world_size // 2, world_size - 1)]
        rows.append(
            {
                "samples": samples,
                "world_size": world_size,
                "build_s": round(wall, 2),
                "peak_rss_gib": round(peak, 2),
                "plan_mib": round(directory_mib(plan), 1),
                "open_ms": [round(o["seconds"] * 1000, 1) for o in opens],
                "files_read": opens[0]["plan_files"],
            }
        )
        _remove(plan)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=None, help="build/permutation pairs (default 3, 2 at 1e9)")
    parser.add_argument("--quiet-load", type=float, default=1.0, help="a row is quiet below this load average")
    parser.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="seconds to wait, before each run, for the load to fall below --quiet-load",
    )
    parser.add_argument("--open-world-sizes", type=int, nargs="*", default=[])
    parser.add_argument("--tmp", type=Path, default=None, help="where to write lengths and plans")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        tmp = Path(tmp)
        args.startup_s = startup_seconds(tmp, args.max_tokens)
        print(
            json.dumps({"startup_s": round(args.startup_s, 2)}) if args.json else f"startup_s={args.startup_s:.2f}",
            flush=True,
        )
        for samples in map(int, args.samples):
            dataset = tmp / f"lengths-{samples}.parquet"
            run_in_child("bench.scale:write_lognormal", dataset, samples, args.max_tokens)
            plan = tmp / f"plan-{samples}"
            rows = (
                opened(dataset, plan, samples, args)
                if args.open_world_sizes
                else [interleaved(dataset, plan, samples, args)]
            )
            for row in rows:
                print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            dataset.unlink()


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
