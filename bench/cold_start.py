"""The first `batchplan build` (numba compiles the kernels) against the next ones (cached).

    python -m bench.cold_start                      # the README's demo, --tokens-per-step, --mode pad
    python -m bench.cold_start --checkout /tmp/old --checkout .   # two checkouts, interleaved
    python -m bench.cold_start --json
    python -m bench.cold_start --cases demo --kernels   # the demo alone, compile CPU per kernel

Each build runs as a subprocess (`batchplan build ... -q`, the README's demo command and two
variants of it) with ``NUMBA_CACHE_DIR`` set to a new, empty temporary directory: numba then
reads and writes every ``cache=True`` kernel there (its ``UserProvidedCacheLocator`` comes
before the ``__pycache__`` next to the sources), so a build starts as after a fresh install
while the repository's own cache stays as it is. Python's bytecode stays warm.

Per checkout, in this order:

- ``cold``: the demo in an empty cache; ``warm``: again, same cache; then, in that cache,
  ``after demo`` and ``warm`` for ``--tokens-per-step`` and for ``--mode pad`` (the first
  build of another kind after the demo, as a user meets it);
- ``cold``, in an empty cache of its own, for ``--tokens-per-step`` and for ``--mode pad``.

With several ``--checkout`` the sequences alternate, so load on the machine falls on each alike.
Every row has the 1-minute load average read just before its build, ``compiled``: the
specialisations numba wrote to the cache (``NUMBA_DEBUG_CACHE``'s "data saved" lines; 0 when
warm), ``cpu_s``: the child's CPU time (user + system), which other jobs on the machine stretch
less than wall time, and ``compile_cpu_s``: the CPU time of the compiling thread inside numba's
``numba:compile`` events (each function's own time, its callees' left out, summed). ``kernels``
(``--json``; ``--kernels`` prints it) splits that by the kernel called from Python, its callees
(numba's own implementations included) in it. ``--cases`` picks builds of the sequence.
Prints a table; ``--json`` for machines.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO = (
    "data/sharegpt_dialogues_cl100k.parquet --max-tokens 8192 --world-size 8 --epochs 2 "
    "--oversize split --hidden-size 4096 -q"
).split()
CASES = {
    "demo": DEMO,
    "tokens-per-step": [*DEMO, "--tokens-per-step", "131072"],
    "pad": [*DEMO, "--mode", "pad"],
}

# The child imports `batchplan` from its working directory (the checkout: the path finder comes
# before the editable install's) and `batchplan_cli` from the checkout's `cli/`. It writes one
# line per function numba compiles to $BENCH_COMPILE_LOG, as the compilation ends (the CLI ends
# the process with os._exit): nesting depth, name, CPU seconds of its own and with its callees.
_CHILD = """
import importlib.util, os, sys, threading, time
from numba.core import event

class _Timer(event.Listener):
    def __init__(self, path):
        self.log = open(path, "w", buffering=1)
        self.local = threading.local()

    def on_start(self, started):
        stack = self.local.__dict__.setdefault("stack", [])
        function = started.data["dispatcher"].py_func
        stack.append([f"{function.__module__}.{function.__qualname__}", time.thread_time(), 0.0])

    def on_end(self, ended):
        stack = self.local.stack
        name, begin, callees = stack.pop()
        total = time.thread_time() - begin
        if stack:
            stack[-1][2] += total
        self.log.write(f"{len(stack)}\\t{name}\\t{total - callees:.6f}\\t{total:.6f}\\n")

event.register("numba:compile", _Timer(os.environ["BENCH_COMPILE_LOG"]))
spec = importlib.util.spec_from_file_location("batchplan_cli", "cli/__init__.py", submodule_search_locations=["cli"])
module = importlib.util.module_from_spec(spec)
sys.modules["batchplan_cli"] = module
spec.loader.exec_module(module)
from batchplan_cli.main import main
sys.exit(main())
"""


def time_build(checkout: Path, case: str, cache: Path, output: Path) -> dict:
    """One `batchplan build` of ``case`` run from ``checkout`` with numba's cache in ``cache``."""
    log = output.with_suffix(".compile.tsv")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "NUMBA_DEBUG_CACHE": "1", "BENCH_COMPILE_LOG": str(log)}
    command = [sys.executable, "-c", _CHILD, "build", *CASES[case][:1], "-o", str(output), *CASES[case][1:]]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"build failed ({done.returncode}) in {checkout}: {done.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    compiled = sum("[cache] data saved" in line for line in done.stdout.splitlines())
    row = {"seconds": round(seconds, 2), "cpu_s": round(cpu, 2), "load_average": round(load, 2)}
    return {**row, "compiled": compiled, **compile_times(log)}


def compile_times(log: Path) -> dict:
    """``compile_cpu_s`` (every compiled function's own CPU time, summed) and ``kernels``: the
    CPU time of each function compiled at depth 0 (a kernel called from Python), callees in it,
    summed over its specialisations, largest first."""
    own = 0.0
    kernels: dict[str, float] = {}
    for line in log.read_text().splitlines():
        depth, name, self_s, total_s = line.split("\t")
        own += float(self_s)
        if depth == "0":
            kernels[name] = kernels.get(name, 0.0) + float(total_s)
    ranked = sorted(kernels.items(), key=lambda item: -item[1])
    return {"compile_cpu_s": round(own, 2), "kernels": {name: round(seconds, 3) for name, seconds in ranked}}


def run_checkout(checkout: Path, tmp: Path, cases: list[str]) -> list[dict]:
    """The sequence of builds the module docstring lists, for one checkout and ``cases``."""
    rows = []

    def build(case: str, state: str, cache: Path) -> None:
        row = {"checkout": str(checkout), "case": case, "state": state}
        row.update(time_build(checkout, case, cache, tmp / "plan.arrow"))
        line = f"{case:<16} {state:<11} {row['seconds']:>7.2f} s  cpu {row['cpu_s']:>6.2f} s"
        line += f"  compiled {row['compiled']:>3}  load {row['load_average']:.2f}"
        print(f"  {line}  ({checkout})", file=sys.stderr)
        rows.append(row)

    shared = Path(tempfile.mkdtemp(dir=tmp, prefix="numba-cache-"))
    if "demo" in cases:
        build("demo", "cold", shared)
        build("demo", "warm", shared)
    variants = [case for case in ("tokens-per-step", "pad") if case in cases]
    for case in variants if "demo" in cases else []:
        build(case, "after demo", shared)
        build(case, "warm", shared)
    for case in variants:
        build(case, "cold", Path(tempfile.mkdtemp(dir=tmp, prefix="numba-cache-")))
    return rows


def print_table(rows: list[dict], kernels: bool) -> None:
    print(
        f"{'checkout':<28} {'build':<16} {'state':<11} {'seconds':>8} {'cpu s':>7} {'compile cpu s':>14} "
        f"{'compiled':>9} {'load avg':>9}"
    )
    for row in rows:
        print(
            f"{row['checkout'][-28:]:<28} {row['case']:<16} {row['state']:<11} {row['seconds']:>8.2f} "
            f"{row['cpu_s']:>7.2f} {row['compile_cpu_s']:>14.2f} {row['compiled']:>9} {row['load_average']:>9.2f}"
        )
    for row in rows if kernels else []:
        if row["kernels"]:
            print(f"\ncompile CPU by kernel: {row['case']} {row['state']} ({row['checkout']})")
            for name, seconds in row["kernels"].items():
                print(f"  {seconds:6.2f} s  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkout", action="append", type=Path, help="A checkout to time (default: this one); repeat to interleave."
    )
    parser.add_argument("--repeats", type=int, default=1, help="Sequences per checkout.")
    parser.add_argument(
        "--cases", nargs="+", choices=list(CASES), default=list(CASES), help="Builds to run (default: all)."
    )
    parser.add_argument("--kernels", action="store_true", help="Print each build's compile CPU by kernel.")
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    args = parser.parse_args()
    checkouts = [path.resolve() for path in args.checkout or [Path(__file__).resolve().parent.parent]]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        for _ in range(args.repeats):
            for checkout in checkouts:
                rows += run_checkout(checkout, Path(tmp), args.cases)
    if args.json:
        versions = f"Python {platform.python_version()}, numba {importlib.metadata.version('numba')}"
        machine = f"{os.cpu_count()} cores, {versions}"
        print(json.dumps({"machine": machine, "rows": rows}, indent=1))
    else:
        print_table(rows, args.kernels)


if __name__ == "__main__":
    main()
