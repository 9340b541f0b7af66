"""The first `batchplan build` (numba compiles the kernels) against the next ones (cached).

    python -m bench.cold_start                      # the README's demo, --tokens-per-step, --mode pad
    python -m bench.cold_start --checkout /tmp/old --checkout .   # two checkouts, interleaved
    python -m bench.cold_start --json

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
Every row has the 1-minute load average read just before its build and ``compiled``: the
specialisations numba wrote to the cache (``NUMBA_DEBUG_CACHE``'s "data saved" lines; 0 when
warm). Prints a table; ``--json`` for machines.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
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
# before the editable install's) and `batchplan_cli` from the checkout's `cli/`.
_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("batchplan_cli", "cli/__init__.py", submodule_search_locations=["cli"])
module = importlib.util.module_from_spec(spec)
sys.modules["batchplan_cli"] = module
spec.loader.exec_module(module)
from batchplan_cli.main import main
sys.exit(main())
"""


def time_build(checkout: Path, case: str, cache: Path, output: Path) -> dict:
    """One `batchplan build` of ``case`` run from ``checkout`` with numba's cache in ``cache``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "NUMBA_DEBUG_CACHE": "1"}
    command = [sys.executable, "-c", _CHILD, "build", *CASES[case][:1], "-o", str(output), *CASES[case][1:]]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"build failed ({done.returncode}) in {checkout}: {done.stderr[-2000:]}")
    compiled = sum("[cache] data saved" in line for line in done.stdout.splitlines())
    return {"seconds": round(seconds, 2), "load_average": round(load, 2), "compiled": compiled}


def run_checkout(checkout: Path, tmp: Path) -> list[dict]:
    """The sequence of builds the module docstring lists, for one checkout."""
    rows = []

    def build(case: str, state: str, cache: Path) -> None:
        row = {"checkout": str(checkout), "case": case, "state": state}
        row.update(time_build(checkout, case, cache, tmp / "plan.arrow"))
        line = f"{case:<16} {state:<11} {row['seconds']:>7.2f} s  compiled {row['compiled']:>3}"
        print(f"  {line}  load {row['load_average']:.2f}  ({checkout})", file=sys.stderr)
        rows.append(row)

    shared = Path(tempfile.mkdtemp(dir=tmp, prefix="numba-cache-"))
    build("demo", "cold", shared)
    build("demo", "warm", shared)
    for case in ("tokens-per-step", "pad"):
        build(case, "after demo", shared)
        build(case, "warm", shared)
    for case in ("tokens-per-step", "pad"):
        build(case, "cold", Path(tempfile.mkdtemp(dir=tmp, prefix="numba-cache-")))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'checkout':<28} {'build':<16} {'state':<11} {'seconds':>8} {'compiled':>9} {'load avg':>9}")
    for row in rows:
        print(
            f"{row['checkout'][-28:]:<28} {row['case']:<16} {row['state']:<11} {row['seconds']:>8.2f} "
            f"{row['compiled']:>9} {row['load_average']:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkout", action="append", type=Path, help="A checkout to time (default: this one); repeat to interleave."
    )
    parser.add_argument("--repeats", type=int, default=1, help="Sequences per checkout.")
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    args = parser.parse_args()
    checkouts = [path.resolve() for path in args.checkout or [Path(__file__).resolve().parent.parent]]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        for _ in range(args.repeats):
            for checkout in checkouts:
                rows += run_checkout(checkout, Path(tmp))
    if args.json:
        versions = f"Python {platform.python_version()}, numba {importlib.metadata.version('numba')}"
        machine = f"{os.cpu_count()} cores, {versions}"
        print(json.dumps({"machine": machine, "rows": rows}, indent=1))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
