"""End-to-end `batchplan build` benchmark against the permutation yardstick.

    python -m bench.build --samples 1e7                  # lognormal lengths, pack, world size 64
    python -m bench.build --file ../shared/data/wikipedia_bert512.parquet --max-tokens 512
    python -m bench.build --samples 1e8 --epochs 1 --mode pad

For each case: write the lengths to Parquet (not timed), run `batchplan build` once to
warm the numba cache, then time it as a subprocess (wall time, peak resident memory
of that child, from os.wait4) and, in the same run, `numpy.random.default_rng(0).permutation(N)`:
the work no plan can avoid. Also timed: a build of 1,000 samples, the fixed cost of any
build (interpreter, imports, loading the cached numba kernels), reported beside the
ratio without it, and whether that build imports pandas (``imports_pandas``): training
images carry pandas, which pyarrow imports (0.35 s and more) for conversions batchplan
does not call; where pandas is installed, ``no`` means the fixed cost measured is what
such an image pays. Prints a table; --json for machines.

Timed builds follow one another, so each finds the memory the previous one freed still
at hand. ``--pause S`` sleeps S seconds before each timed build (the 1,000-sample ones
too) and each permutation (then run in a new process) instead: on a VM that hands freed
memory back to its host, what a first build on a quiet machine meets
(docs/benchmarks.md, "Fresh memory").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def lognormal_lengths(num_samples: int, max_tokens: int, seed: int = 0) -> np.ndarray:
    """Lognormal lengths, median 300 tokens, sigma 1, clipped to [1, max_tokens]."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(300), sigma=1.0, size=num_samples)
    return np.clip(lengths, 1, max_tokens).astype(np.int32)


def write_lengths(lengths: np.ndarray, path: Path) -> None:
    pq.write_table(pa.table({"length": lengths}), path, row_group_size=1 << 22)


def write_lognormal_lengths(path: str, num_samples: int, max_tokens: int) -> None:
    write_lengths(lognormal_lengths(num_samples, max_tokens), Path(path))


def run_in_child(function: str, *args: str | int) -> None:
    """``module.function(*args)`` (named ``"module:function"``) in a child process. Made here,
    large arrays and Arrow's buffers (kept by its memory pool) would stay resident in this
    process, and a build it starts afterwards would count them in its peak (`run_measured`)."""
    module, name = function.split(":")
    code = f"import json, sys; from {module} import {name}; {name}(*json.loads(sys.argv[1]))"
    subprocess.run(
        [sys.executable, "-c", code, json.dumps([str(a) if isinstance(a, Path) else a for a in args])], check=True
    )


def run_measured(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one child process: its own maximum resident set
    (`os.wait4`), which also counts the pages of this process it held before it ran its
    program: keep this process small (`run_in_child`).

    Raises:
        subprocess.CalledProcessError: the child failed.
    """
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, command)
    return wall, usage.ru_maxrss / 2**20


_PERMUTATION = """
import sys, time
import numpy as np
start = time.perf_counter()
np.random.default_rng(0).permutation(int(sys.argv[1]))
print(time.perf_counter() - start)
"""


def permutation_in_child(num_samples: int) -> float:
    """Seconds of `numpy.random.default_rng(0).permutation(num_samples)` in a new process."""
    found = subprocess.run(
        [sys.executable, "-c", _PERMUTATION, str(num_samples)], check=True, capture_output=True, text=True
    )
    return float(found.stdout)


def time_permutation(num_samples: int, repeats: int = 3, pause: float = 0.0) -> float:
    """Best of ``repeats``; with a ``pause``, each in a new process after sleeping that long
    (as `run_build` then runs: on fresh memory)."""
    best = float("inf")
    for _ in range(repeats):
        if pause:
            time.sleep(pause)
            best = min(best, permutation_in_child(num_samples))
            continue
        start = time.perf_counter()
        np.random.default_rng(0).permutation(num_samples)
        best = min(best, time.perf_counter() - start)
    return best


def build_command(dataset: Path, output: Path, args) -> list[str]:
    """The `batchplan build` command line of a case."""
    return [
        "-m",
        "batchplan_cli.main",
        "build",
        str(dataset),
        "-o",
        str(output),
        "--max-tokens",
        str(args.max_tokens),
        "--mode",
        args.mode,
        "--world-size",
        str(args.world_size),
        "--epochs",
        str(args.epochs),
        "--oversize",
        "truncate",
        "-q",
    ]


def run_build(dataset: Path, output: Path, args) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB, `run_measured`) of one `batchplan build` subprocess,
    writing a new plan as a first build does (a plan left at ``output`` is deleted before the
    timer starts: replacing it would add the file system's delete of the old file, ~0.12 s
    for 652 MiB)."""
    output.unlink(missing_ok=True)
    return run_measured([sys.executable, *build_command(dataset, output, args)])


def build_imports_pandas(dataset: Path, output: Path, args) -> str:
    """Whether a `batchplan build` of ``dataset`` imports pandas (``python -X importtime``):
    ``"no"``, ``"yes"``, or ``"not installed"`` where pandas is not (the check then says nothing)."""
    if importlib.util.find_spec("pandas") is None:
        return "not installed"
    output.unlink(missing_ok=True)
    command = [sys.executable, "-X", "importtime", *build_command(dataset, output, args)]
    found = subprocess.run(command, check=True, capture_output=True, text=True)
    # Lines "import time: self | cumulative | module", the module indented by its depth.
    modules = {line.rsplit("|", 1)[-1].strip() for line in found.stderr.splitlines() if line.startswith("import time:")}
    return "yes" if "pandas" in modules else "no"


def _paused(pause: float, run, *args):
    time.sleep(pause)
    return run(*args)


def fill_of(plan: Path) -> float:
    from batchplan.formats.opening import open_plan
    from batchplan.reports.summary import summarize_plan

    return summarize_plan(open_plan(plan))["fill"]


def case_parser(description: str) -> argparse.ArgumentParser:
    """The options that pick a case (lengths, cap, mode, ranks) and ``--json``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=float, default=1e7, help="synthetic lognormal samples")
    parser.add_argument("--file", type=Path, help="a Parquet file with a `length` column instead")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--mode", default="pack")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    return parser


def print_row(row: dict, as_json: bool) -> None:
    """One result: a JSON line, or one ``key: value`` line per field."""
    if as_json:
        print(json.dumps(row))
        return
    for key, value in row.items():
        print(f"{key:>14}: {value}")


def main() -> None:
    parser = case_parser(__doc__)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="timed builds (best is reported)")
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="sleep this many seconds before each timed build and permutation (then run in a new "
        "process): memory the previous run freed is not at hand (see docs/benchmarks.md)",
    )
    args = parser.parse_args()
    if args.pause < 0:
        parser.error("--pause must be >= 0 seconds")

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        if args.file is None:
            dataset = tmp / "lengths.parquet"
            run_in_child("bench.build:write_lognormal_lengths", dataset, int(args.samples), args.max_tokens)
            name = f"lognormal {int(args.samples):.0e}"
        else:
            dataset, name = args.file, args.file.stem
        num_samples = pq.ParquetFile(dataset).metadata.num_rows
        plan = tmp / "plan.arrow"
        run_build(dataset, plan, args)  # warm the numba cache and the page cache
        timed = [_paused(args.pause, run_build, dataset, plan, args) for _ in range(args.repeats)]
        wall, peak = min(run[0] for run in timed), max(run[1] for run in timed)
        # The fixed cost of any build (interpreter, imports, loading the cached kernels).
        tiny = tmp / "tiny.parquet"
        write_lengths(lognormal_lengths(1000, args.max_tokens), tiny)
        startup = min(_paused(args.pause, run_build, tiny, tmp / "tiny.arrow", args)[0] for _ in range(3))
        pandas = build_imports_pandas(tiny, tmp / "tiny.arrow", args)  # not timed, nor in the peak
        permutation = time_permutation(num_samples, pause=args.pause)
        row = {
            "case": name,
            "samples": num_samples,
            "mode": args.mode,
            "max_tokens": args.max_tokens,
            "world_size": args.world_size,
            "epochs": args.epochs,
            "pause_s": args.pause,
            "build_s": round(wall, 3),
            "permutation_s": round(permutation, 3),
            "ratio": round(wall / permutation, 2),
            "startup_s": round(startup, 3),
            "imports_pandas": pandas,
            "ratio_after_startup": round((wall - startup) / permutation, 2),
            "peak_rss_gib": round(peak, 2),
            "fill": round(fill_of(plan), 5),
            "plan_mib": round(plan.stat().st_size / 2**20, 1),
        }
    print_row(row, args.json)


if __name__ == "__main__":
    main()
