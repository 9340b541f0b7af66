"""Fit the build-memory model (`batchplan.planning.memory`) to measured peaks.

    python -m bench.memory_fit                 # 54 builds, ~8 min on 2 cores
    python -m bench.memory_fit --quick         # 10 builds, ~35 s
    python -m bench.memory_fit --json > fit.jsonl
    python -m bench.memory_fit --refit fit.jsonl   # fit again, no builds

Each case is one `batchplan build ... -q` subprocess (``BATCHPLAN_THREADS=T``,
``BATCHPLAN_MEMORY_CHECK=0`` so that the check being fitted refuses nothing) on lognormal
lengths (`bench.scale.write_lognormal`: median 300, clipped at the cap, or at 4 x the cap
with ``--oversize split``); its peak is that child's own maximum resident set (`os.wait4`).
A build of 1,000 samples with the same options first warms the numba cache, so that no
compilation is measured. The grid varies one term at a time around pack, max_tokens 8,192,
truncate (no cuts), 1 epoch, 1 thread, 64 ranks, ``--layout file``: samples 1e5 to 3e7
(1e8 for three cases), epochs 1/2/4, threads 1/2, pad, max_tokens 512/2,048, split,
``--hidden-size 4096``, ``--layout directory`` (1 or 2 epochs held), 1,024 ranks.

For each build the model's inputs are computed as `batchplan.operations.build` does
(`estimate_build_memory` on the lengths read back; a directory build holds
``min(epochs, threads)`` epochs: ``with_epochs``). The constants are the integer,
non-negative solution (HiGHS) that minimises the worst relative error, an under-estimate
counting three times an over-estimate, then (a 1 % tie-break) the mean such error; the
kernel term is not fitted (it is measured at huge max_tokens, see the module). Prints the
constants, every build's measured peak, estimate and error, and the worst errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from batchplan.config import PlanConfig
from batchplan.planning import memory
from bench.build import run_measured

UNDER_WEIGHT = 3  # an under-estimate (a build let through that runs out of memory) counts 3 times
TIE_BREAK = 0.01  # weight of the mean error beside the worst
# The fitted constants and what each multiplies (x = entries, r = micro-batches per epoch).
CONSTANTS = (
    "BASE_BYTES",
    "ENTRY_FIXED",
    "ENTRY_HELD",
    "ENTRY_WORK",
    "ROW_HELD",
    "SPAN_FIXED",
    "SPAN_HELD",
    "COST_WORK",
)


@dataclasses.dataclass(frozen=True)
class Case:
    samples: int
    mode: str = "pack"
    max_tokens: int = 8192
    oversize: str = "truncate"  # split: lengths clipped at 4 x max_tokens
    epochs: int = 1
    threads: int = 1
    hidden: bool = False
    layout: str = "file"
    world_size: int = 64

    @property
    def clip(self) -> int:
        return self.max_tokens * (4 if self.oversize == "split" else 1)

    def config(self) -> PlanConfig:
        return PlanConfig(
            max_tokens=self.max_tokens,
            mode=self.mode,
            world_size=self.world_size,
            epochs=self.epochs,
            oversize=self.oversize,
            hidden_size=4096 if self.hidden else None,
        )


VARIANTS = [  # around the base case, one or two terms at a time
    {},
    {"epochs": 2},
    {"epochs": 4},
    {"epochs": 2, "threads": 2},
    {"epochs": 4, "threads": 2},
    {"threads": 2},
    {"mode": "pad"},
    {"mode": "pad", "epochs": 2, "threads": 2},
    {"max_tokens": 512},
    {"max_tokens": 2048},
    {"max_tokens": 512, "oversize": "split"},
    {"max_tokens": 2048, "oversize": "split"},
    {"oversize": "split"},
    {"max_tokens": 512, "oversize": "split", "epochs": 2, "threads": 2},
    {"mode": "pad", "max_tokens": 2048, "oversize": "split", "epochs": 2, "threads": 2},
    {"hidden": True, "epochs": 2, "threads": 2},
    {"world_size": 1024},
    {"layout": "directory", "epochs": 2, "world_size": 1024},
    {"layout": "directory", "epochs": 4, "threads": 2, "world_size": 1024},
]


def grid(quick: bool) -> list[Case]:
    """The cases, grouped by lengths file (each written once)."""
    if quick:
        small = [
            {},
            {"mode": "pad"},
            {"max_tokens": 512, "oversize": "split"},
            {"epochs": 2, "threads": 2},
            {"hidden": True, "epochs": 2, "threads": 2},
        ]
        large = [
            {},
            {"epochs": 4, "threads": 2},
            {"max_tokens": 2048, "oversize": "split"},
            {"layout": "directory", "epochs": 2, "world_size": 1024},
        ]
        return [Case(10**5)] + [Case(10**6, **v) for v in small] + [Case(10**7, **v) for v in large]
    cases = [Case(10**5), Case(10**5, mode="pad"), Case(10**5, max_tokens=512, oversize="split")]
    cases += [Case(10**6, **v) for v in VARIANTS[::2]]
    cases += [Case(samples, **v) for samples in (10**7, 3 * 10**7) for v in VARIANTS]
    cases += [
        Case(10**8),
        Case(10**8, mode="pad"),
        Case(10**8, layout="directory", epochs=2, threads=2, world_size=1024),
    ]
    return sorted(cases, key=lambda c: (c.samples, c.clip))


def command(case: Case, dataset: Path, output: Path) -> list[str]:
    line = [
        sys.executable,
        "-m",
        "batchplan_cli.main",
        "build",
        str(dataset),
        "-o",
        str(output),
        "--max-tokens",
        str(case.max_tokens),
        "--mode",
        case.mode,
        "--world-size",
        str(case.world_size),
        "--epochs",
        str(case.epochs),
        "--oversize",
        case.oversize,
        "--layout",
        case.layout,
        "-q",
    ]
    return line + (["--hidden-size", "4096"] if case.hidden else [])


def peak_gib(case: Case, dataset: Path, output: Path) -> float:
    """The build's own peak resident set (GiB), its output deleted afterwards."""
    env = {**os.environ, "BATCHPLAN_THREADS": str(case.threads), "BATCHPLAN_MEMORY_CHECK": "0"}
    try:
        return run_measured(command(case, dataset, output), env=env)[1]
    finally:
        shutil.rmtree(output, ignore_errors=True) if output.is_dir() else output.unlink(missing_ok=True)


def model_inputs(case: Case, lengths: np.ndarray) -> memory.MemoryEstimate:
    """The estimate's inputs, as `batchplan.operations.build` computes them."""
    estimate = memory.estimate_build_memory(lengths.shape[0], case.config(), num_threads=case.threads, lengths=lengths)
    if case.layout == "directory":  # a directory holds the epochs in planning
        estimate = estimate.with_epochs(min(case.epochs, case.threads), case.threads)
    return estimate


def prepare(cases: list[Case], tmp: Path) -> list[dict]:
    """Write the cases' lengths (and 1,000 of them to warm with); their model inputs. Runs in a
    worker process: a child's peak counts the resident set of the process that starts it."""
    import pyarrow.parquet as pq

    from bench.scale import write_lognormal

    first = cases[0]
    write_lognormal(tmp / f"lengths-{first.samples}-{first.clip}.parquet", first.samples, first.clip)
    if not (tmp / f"tiny-{first.clip}.parquet").exists():
        write_lognormal(tmp / f"tiny-{first.clip}.parquet", 1000, first.clip)
    lengths = pq.read_table(tmp / f"lengths-{first.samples}-{first.clip}.parquet").column("length").to_numpy()
    found = [dataclasses.asdict(model_inputs(case, lengths)) for case in cases]
    return [{k: v for k, v in inputs.items() if k != "complete"} for inputs in found]


def measure(cases: list[Case], tmp: Path, log) -> list[dict]:
    rows, warmed = [], set()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as worker:
        for (samples, clip), group in itertools.groupby(cases, key=lambda c: (c.samples, c.clip)):
            group = list(group)
            dataset = tmp / f"lengths-{samples}-{clip}.parquet"
            for case, inputs in zip(group, worker.submit(prepare, group, tmp).result()):
                warm = dataclasses.replace(case, samples=1000)
                if warm not in warmed:  # compile (or load) this case's kernels outside the measured build
                    peak_gib(warm, tmp / f"tiny-{clip}.parquet", tmp / "tiny-plan")
                    warmed.add(warm)
                plan = {("plan_epochs" if k == "epochs" else k): v for k, v in dataclasses.asdict(case).items()}
                estimate = memory.MemoryEstimate(**inputs).num_bytes / 2**30
                row = {**plan, "peak_gib": peak_gib(case, dataset, tmp / "plan"), "model_gib": estimate, **inputs}
                rows.append(row)
                log(row)
            dataset.unlink()
    return rows


def features(row: dict) -> tuple[list[float], float]:
    """What each constant multiplies in ``row``'s estimate (BASE_BYTES in MiB), and the kernel bytes."""
    entries, epochs, at_once = row["num_entries"], row["epochs"], row["at_once"]
    spans, cost = float(row["has_spans"]), float(row["has_cost"])
    x = [
        2**20,
        entries,
        entries * epochs,
        entries * at_once,
        row["rows_per_epoch"] * epochs,
        entries * spans,
        entries * epochs * spans,
        entries * at_once * cost,
    ]
    return [float(v) for v in x], float(at_once * row["kernel_bytes"])


def fit(rows: list[dict]) -> list[int]:
    """Integer constants >= 0 minimising max(over, 3 x under) relative error (+ 1 % of the mean)."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    n, k = len(rows), len(CONSTANTS)
    for _ in range(k):
        h.addVar(0.0, 1e6)
    h.addVar(0.0, highspy.kHighsInf)  # t: the worst weighted error
    for _ in range(n):
        h.addVar(0.0, highspy.kHighsInf)  # s_i: row i's weighted error
    h.changeColCost(k, 1.0)
    for i in range(k):
        h.changeColIntegrality(i, highspy.HighsVarType.kInteger)
    for i, row in enumerate(rows):
        h.changeColCost(k + 1 + i, TIE_BREAK / n)
        x, kern = features(row)
        measured = row["peak_gib"] * 2**30
        rel = np.array(x) / measured  # relative error = rel . c + kern / measured - 1
        offset = kern / measured - 1.0
        for weight in (1.0, -UNDER_WEIGHT):  # weight x error <= s_i <= t
            idx = np.array([*range(k), k + 1 + i], dtype=np.int32)
            h.addRow(-highspy.kHighsInf, -weight * offset, k + 1, idx, np.append(weight * rel, -1.0))
        h.addRow(-highspy.kHighsInf, 0.0, 2, np.array([k + 1 + i, k], dtype=np.int32), np.array([1.0, -1.0]))
    h.run()
    return [round(v) for v in h.getSolution().col_value[:k]]


def estimate_gib(row: dict, constants: list[int]) -> float:
    x, kern = features(row)
    return (float(np.dot(x, constants)) + kern) / 2**30


def describe(case: dict) -> str:
    extra = [
        "split" if case["oversize"] == "split" else "",
        "hidden" if case["hidden"] else "",
        f"dir(held {case['epochs']})" if case["layout"] == "directory" else "",
    ]
    return (
        f"{case['samples']:.0e} {case['mode']} {case['max_tokens']:>5} E{case['plan_epochs']}"
        f" T{case['threads']} W{case['world_size']:<4} {' '.join(e for e in extra if e)}"
    )


def report(rows: list[dict], constants: list[int]) -> None:
    print(
        "constants: "
        + ", ".join(
            f"{name}={value}" + (" MiB" if name == "BASE_BYTES" else "") for name, value in zip(CONSTANTS, constants)
        )
    )
    print(f"{'build':<44} {'measured':>9} {'estimate':>9} {'error':>7}")
    errors = []
    for row in rows:
        estimate = estimate_gib(row, constants)
        errors.append(estimate / row["peak_gib"] - 1)
        print(f"{describe(row):<44} {row['peak_gib']:>8.3f}G {estimate:>8.3f}G {errors[-1]:>+7.1%}")
    worst_under, worst_over = min(errors), max(errors)
    print(
        f"worst under-estimate {worst_under:+.1%} ({describe(rows[errors.index(worst_under)]).strip()}); "
        f"worst over-estimate {worst_over:+.1%} ({describe(rows[errors.index(worst_over)]).strip()}); "
        f"{len(rows)} builds"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10 builds of 1e5 to 1e7 samples")
    parser.add_argument("--json", action="store_true", help="print each build as a JSON line, then the fit")
    parser.add_argument("--refit", type=Path, help="fit the JSON lines of an earlier --json run; no builds")
    parser.add_argument("--tmp", type=Path, default=None, help="where to write lengths and plans")
    args = parser.parse_args()
    if args.refit:
        rows = [json.loads(line) for line in args.refit.read_text().splitlines() if line.startswith("{")]
    else:
        log = (
            (lambda row: print(json.dumps(row), flush=True))
            if args.json
            else (lambda row: print(f"{describe(row):<44} {row['peak_gib']:.3f} GiB", file=sys.stderr, flush=True))
        )
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            rows = measure(grid(args.quick), Path(tmp), log)
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"this process's own peak: {own:.3f} GiB (every measured peak is at least that)", file=sys.stderr)
    report(rows, fit(rows))


if __name__ == "__main__":
    main()
