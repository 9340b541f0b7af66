"""What a mixture costs against one dataset: build time, peak memory and fill.

    python -m bench.mixture --samples 1e7 --sources 50 [--pairs 3] [--json]
    python -m bench.mixture --samples 1e9 --sources 50 --mixture-only [--epochs E] [--stages]
    python -m bench.mixture --fill
    python -m bench.mixture --shares 40 [--seed 0]

The time and memory case writes ``--samples`` lognormal lengths (`bench.build`) as
``--sources`` Parquet files of Zipf-distributed sizes, and a mixture of them whose weights
are Zipf too and whose ``tokens`` are the lengths' total (small sources repeat, large ones
are cut); its planned uses are written as one dataset. Then it builds both with the same
options (pack, ``--max-tokens``, ``--world-size``, one epoch, truncate), each in a child
process (`bench.build.run_measured`: wall seconds and the child's own peak RSS),
interleaved A B A B for ``--pairs`` pairs, and prints each run, the median ratio of times
and of peaks, and the load average before each run. Both builds of a case of 20,000 samples
run first, untimed, so that no timed run compiles numba's kernels.

``--mixture-only`` builds only the mixture (a plan directory, ``--epochs`` parts), its sources
written by a child process (no uses computed, no one-dataset build): the wall time and peak
RSS of a mixture of ``--samples`` at scale (docs/scaling.md has one dataset's). With
``--stages`` the child is the library's build with each stage's seconds (a stage's own calls,
stages inside it included: scheduling holds laying out) and peak resident set (the stage
running when it peaked, innermost, polled every millisecond): reading, sizing, forming,
composing, scheduling, laying out, writing.

``--fill`` plans data/mixture.yaml (8,192, 8 ranks, 4 micro-batches, split) and the same
uses as one dataset, in-process, and prints each one's packed micro-batches and bound:
what packing every source's passes on their own costs.

``--shares N`` plans N random mixtures in-process (2-11 sources of lognormal lengths, weights
10^-3..1, ``tokens`` 0.5-3x the lengths' total, caps 512/2,048/8,192, pack or pad, 1-64 ranks,
1-4 micro-batches per step, a token target or the default, 1-2 epochs) and prints, for each,
the worst step's miss of its share bound (``|tokens - weight x step tokens| /
max(0.5 % of it, max_tokens)``, every step but an epoch's last: <= 1 holds) and the worst drift
against ``max(the epoch's mean step, max_tokens)`` (<= 1 holds); then the worst of each.
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

from bench.build import lognormal_lengths, run_in_child, run_measured, write_lengths

ROOT = Path(__file__).resolve().parent.parent


def write_case(directory: Path | str, num_samples: int, num_sources: int, max_tokens: int) -> tuple[Path, Path]:
    """The mixture file of the time case and the one-dataset file of the same uses."""
    directory = Path(directory)
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


def write_sources(directory: str, num_samples: int, num_sources: int, max_tokens: int) -> None:
    """The time case's sources and mixture file (`write_case`) without the uses: each source's
    lengths drawn on their own (seed: its index), so no array of every length is held."""
    ranks = np.arange(1, num_sources + 1, dtype=np.float64)
    sizes = np.maximum(1, np.floor(num_samples * (1 / ranks) / (1 / ranks).sum())).astype(np.int64)
    sizes[0] += num_samples - sizes.sum()
    weights = np.random.default_rng(1).permutation(1 / ranks)
    sources, total = [], 0
    for index in range(num_sources):
        lengths = lognormal_lengths(int(sizes[index]), max_tokens, seed=index)
        total += int(lengths.sum(dtype=np.int64))
        write_lengths(lengths, Path(directory) / f"source{index:03d}.parquet")
        del lengths
        name = f"s{index:03d}"
        sources.append({"name": name, "paths": [f"source{index:03d}.parquet"], "weight": float(weights[index])})
    (Path(directory) / "mixture.json").write_text(json.dumps({"sources": sources, "tokens": total}))


def mixture_only_case(args) -> dict:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        samples = int(float(args.samples))
        run_in_child("bench.mixture:write_sources", tmp, samples, args.sources, args.max_tokens)
        mixture, plan, report = Path(tmp) / "mixture.json", Path(tmp) / "plan", Path(tmp) / "stages.json"
        command = [
            sys.executable,
            "-m",
            "batchplan_cli.main",
            "build",
            "--mixture",
            str(mixture),
            "-o",
            str(plan),
            "--layout",
            "directory",
            "--epochs",
            str(args.epochs),
            *build_args(args),
        ]
        if args.stages:
            command = [
                sys.executable,
                "-c",
                "import sys; from bench.mixture import build_in_stages; build_in_stages(*sys.argv[1:])",
                str(mixture),
                str(plan),
                str(report),
                str(args.epochs),
                str(args.max_tokens),
                str(args.world_size),
            ]
        load = os.getloadavg()[0]
        seconds, peak = run_measured(command)
        stages = json.loads(report.read_text()) if args.stages else None
    return {
        "samples": samples,
        "sources": args.sources,
        "epochs": args.epochs,
        "seconds": seconds,
        "peak_gib": peak,
        "load": load,
        "stages": stages,
    }


# The build's stages: (module, function or Class.method) each; the innermost running one is
# the stage in force.
STAGES = {
    "reading": ("batchplan.formats.mixture_file", "read_mixture_lengths"),
    "sizing": ("batchplan.planning.mixture_entries", "prepare_mixture_entries"),
    "forming": ("batchplan.planning.mixture_epochs", "form_micro_batches"),
    "composing": ("batchplan.planning.mixture_epochs", "compose_epoch"),
    "scheduling": ("batchplan.planning.mixture_epochs", "schedule_epoch"),
    "laying out": ("batchplan.planning.parted_bins", "PartedBins.lay_out"),
    "writing": ("batchplan.formats.directory_writer", "DirectoryWriter.write_epoch"),
}


def build_in_stages(mixture: str, output: str, report: str, epochs: str, max_tokens: str, world_size: str) -> None:
    """The ``--stages`` child: `build_mixture_plan_file` into a plan directory (as the CLI
    builds it), each stage's seconds and peak resident set written to ``report`` (JSON)."""
    import importlib
    import threading
    import time

    from batchplan import PlanConfig
    from batchplan.operations.build_mixture import build_mixture_plan_file

    running, seconds, peaks, done = ["other"], dict.fromkeys(["other", *STAGES], 0.0), {}, threading.Event()

    def staged(name, function):
        def call(*args, **kwargs):
            running.append(name)
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - began
                running.pop()

        return call

    for name, (module, attribute) in STAGES.items():
        owner = importlib.import_module(module)
        *path, function = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, function, staged(name, getattr(owner, function)))

    def poll() -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not done.is_set():
            resident = int(Path("/proc/self/statm").read_text().split()[1]) * page / 2**30
            peaks[running[-1]] = max(peaks.get(running[-1], 0.0), resident)
            time.sleep(0.001)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    config = PlanConfig(max_tokens=int(max_tokens), world_size=int(world_size), epochs=int(epochs), oversize="truncate")
    build_mixture_plan_file(mixture, output, config, layout="directory")
    done.set()
    poller.join()
    rows = {name: {"seconds": round(seconds[name], 2), "peak_gib": round(peaks.get(name, 0.0), 2)} for name in STAGES}
    Path(report).write_text(json.dumps(rows))


# The small case built before the timed pairs (`time_case`): it compiles what a cold numba
# cache lacks, which the first pair would pay otherwise.
WARM_SAMPLES = 20_000


def build_args(args) -> list[str]:
    return ["--max-tokens", str(args.max_tokens), "--world-size", str(args.world_size), "--oversize", "truncate", "-q"]


def case_commands(args, directory: Path, samples: int) -> dict[str, list[str]]:
    """The time case of ``samples`` written into ``directory`` (by a child: what it holds would
    count in the builds' peaks, `run_measured`), and the commands that build it: the mixture,
    and the same uses as one dataset."""
    run_in_child("bench.mixture:write_case", str(directory), samples, args.sources, args.max_tokens)
    mixture, single = directory / "mixture.json", directory / "uses.parquet"
    cli = [sys.executable, "-m", "batchplan_cli.main", "build"]
    return {
        "mixture": [*cli, "--mixture", str(mixture), "-o", str(directory / "mixture.arrow"), *build_args(args)],
        "one dataset": [*cli, str(single), "-o", str(directory / "single.arrow"), *build_args(args)],
    }


def time_case(args) -> dict:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        directory = Path(tmp)
        # Both builds of a small case first, untimed: the numba cache warm before the first pair.
        (directory / "warm").mkdir()
        for command in case_commands(args, directory / "warm", WARM_SAMPLES).values():
            run_measured(command)
        commands = case_commands(args, directory, int(float(args.samples)))
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
        "samples": int(float(args.samples)),
        "sources": args.sources,
        "runs": runs,
        "time_ratio_median": statistics.median(time_ratios),
        "time_ratios": time_ratios,
        "peak_ratio_median": statistics.median(peak_ratios),
        "peak_ratios": peak_ratios,
    }


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


def shares_case(count: int, seed: int) -> list[dict]:
    from batchplan import PlanConfig
    from batchplan.mixture import Mixture, MixtureSource
    from batchplan.planning.epochs import PreparedEntries, plan_epochs
    from batchplan.planning.mixture_epochs import prepare_mixture_entries

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        num_sources, cap = int(rng.integers(2, 12)), int(rng.choice([512, 2048, 8192]))
        lengths = [
            np.clip(rng.lognormal(rng.uniform(3, 7), rng.uniform(0.3, 1.2), rng.integers(50, 20000)), 1, cap).astype(
                np.int32
            )
            for _ in range(num_sources)
        ]
        weights = 10 ** rng.uniform(-3, 0, num_sources)
        world_size, mode, kind = int(rng.choice([1, 2, 8, 16, 64])), str(rng.choice(["pack", "pad"])), rng.integers(3)
        options = {"max_tokens": cap, "world_size": world_size, "mode": mode, "epochs": int(rng.integers(1, 3))}
        if kind == 0:
            options["micro_batches"] = int(rng.integers(1, 5))
        elif kind == 1:
            options["tokens_per_step"] = int(world_size * cap * rng.integers(2, 6))
        tokens = int(sum(int(part.sum()) for part in lengths) * rng.uniform(0.5, 3))
        config = PlanConfig(**options)
        mixture = Mixture(
            sources=tuple(MixtureSource(name=f"s{i}", paths=("x",), weight=float(w)) for i, w in enumerate(weights)),
            tokens=tokens,
        )
        joined = np.concatenate(lengths)
        offsets = np.concatenate([[0], np.cumsum([part.shape[0] for part in lengths])])
        prepared = prepare_mixture_entries(mixture, joined, offsets, config)
        weight = np.array([selection.weight for selection in prepared.selections])
        worst = drift = composed = 0.0
        for epoch in plan_epochs(PreparedEntries.of_mixture(joined.shape[0], prepared), config):
            per_step = np.zeros((epoch.num_steps, num_sources))
            held = epoch.source >= 0
            np.add.at(per_step, (epoch.step[held], epoch.source[held]), epoch.tokens[held])
            totals = per_step.sum(axis=1)
            if epoch.num_steps > 1:
                bound = np.maximum(0.005 * totals[:-1], cap)[:, None]
                worst = max(worst, float((np.abs(per_step[:-1] - weight * totals[:-1, None]) / bound).max()))
            lag = np.abs(np.cumsum(per_step, axis=0) - weight * np.cumsum(totals)[:, None])
            drift = max(drift, float(lag.max() / max(totals.mean(), cap)))
            # Less what the epoch's own tokens per source miss their weight by (sizing and the epoch's
            # cut are in whole documents): the lag the composition adds.
            miss = np.abs(per_step.sum(axis=0) - weight * totals.sum())
            composed = max(composed, float((lag - miss[None, :]).max() / max(totals.mean(), cap)))
        rows.append(
            {
                **options,
                "sources": num_sources,
                "worst_share_miss": worst,
                "worst_drift": drift,
                "worst_composed_drift": composed,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", default="1e7")
    parser.add_argument("--sources", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--fill", action="store_true", help="the demo mixture's packing against one dataset's")
    parser.add_argument("--shares", type=int, default=0, help="plan this many random mixtures: shares and drift")
    parser.add_argument("--seed", type=int, default=0, help="the random mixtures' seed (--shares)")
    parser.add_argument("--mixture-only", action="store_true", help="build only the mixture, as a plan directory")
    parser.add_argument("--epochs", type=int, default=1, help="the mixture's epochs (--mixture-only)")
    parser.add_argument("--stages", action="store_true", help="each stage's seconds and peak (--mixture-only)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.mixture_only:
        result = mixture_only_case(args)
        print(
            json.dumps(result, indent=1)
            if args.json
            else f"{result['samples']:,} samples over {result['sources']} sources, {result['epochs']} epoch(s): "
            f"{result['seconds']:.1f} s, peak {result['peak_gib']:.2f} GiB (load {result['load']:.2f})"
        )
        for name, row in ({} if args.json else result["stages"] or {}).items():
            print(f"  {name:11s} {row['seconds']:7.1f} s  peak {row['peak_gib']:5.2f} GiB")
        return
    if args.shares:
        rows = shares_case(args.shares, args.seed)
        for row in [] if args.json else rows:
            print(
                " ".join(
                    f"{key}={value:.4f}" if isinstance(value, float) else f"{key}={value}" for key, value in row.items()
                )
            )
        keys = ("worst_share_miss", "worst_drift", "worst_composed_drift")
        worst = {key: max(row[key] for row in rows) for key in keys}
        print(
            json.dumps({"mixtures": rows, **worst}, indent=1)
            if args.json
            else f"{len(rows)} mixtures: worst share miss {worst['worst_share_miss']:.4f}, worst drift "
            f"{worst['worst_drift']:.4f}, less the epoch's own miss {worst['worst_composed_drift']:.4f} "
            "(<= 1 holds)"
        )
        return
    result = fill_case() if args.fill else time_case(args)
    if args.json:
        print(json.dumps(result, indent=1))
    elif args.fill:
        for name, row in result.items():
            print(
                f"{name:12s} {row['micro_batches']:,} micro-batches (bound {row['bound']:,}, {row['kind']}), "
                f"fill {row['fill']:.3%}"
            )
    else:
        print(
            f"{result['samples']:,} samples over {result['sources']} sources: mixture / one dataset: time "
            f"{result['time_ratio_median']:.2f}x (median of {args.pairs}), peak {result['peak_ratio_median']:.2f}x"
        )


if __name__ == "__main__":
    main()
