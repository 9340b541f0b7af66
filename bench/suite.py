"""The test suite's wall and CPU time, several checkouts interleaved, each run from an empty numba cache.

    python -m bench.suite --checkout /tmp/old --checkout .            # two checkouts, A B A B
    python -m bench.suite --checkout /tmp/old --checkout .@d1a23d6    # ., only the test files of d1a23d6
    python -m bench.suite --checkout . --rounds 1 --quick             # the quick tier (-m "not slow")
    python -m bench.suite --checkout /tmp/old --checkout . --json

Each checkout needs its own ``.venv`` (its README's test command installs one). A run is
``.venv/bin/python -m pytest -q -n 2 -p no:cacheprovider`` in the checkout, as CI runs it, with
``NUMBA_CACHE_DIR`` set to a new, empty temporary directory: every kernel compiles as on a clean
clone, and the checkout's own numba cache stays as it is (Python's bytecode stays warm). Its
hypothesis database (``.hypothesis``) is removed first: a clean clone has none.

``PATH@COMMIT`` runs only the test files that existed at ``COMMIT`` (renames since followed by
``git diff -M``): today's tests of what the suite covered then. Rounds alternate the checkouts,
so that load on the machine falls on each alike. Every row has the 1-minute load average read
just before it, pytest's own time, the wall time of the command and its CPU time (user + system
of pytest and every process it started). Prints a table; ``--json`` for machines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYTEST = ["-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"]


def files_at(checkout: Path, commit: str) -> list[str]:
    """The test files of ``checkout`` that existed at ``commit``, under their names today."""

    def git(*args: str) -> list[str]:
        return subprocess.run(["git", *args], cwd=checkout, check=True, capture_output=True, text=True).stdout.split()

    then = {name for name in git("ls-tree", "--name-only", commit, "tests/") if re.match(r"tests/test_.*\.py$", name)}
    status = git("diff", "-M", "--name-status", commit, "HEAD", "--", "tests/")
    renamed = {status[i + 1]: status[i + 2] for i, field in enumerate(status) if field.startswith("R")}
    return sorted(renamed.get(name, name) for name in then if (checkout / renamed.get(name, name)).is_file())


def run_suite(checkout: Path, files: list[str], quick: bool) -> dict:
    """One run of the suite in ``checkout`` from an empty numba cache."""
    shutil.rmtree(checkout / ".hypothesis", ignore_errors=True)
    command = [str(checkout / ".venv" / "bin" / "python"), *PYTEST, *(["-m", "not slow"] if quick else []), *files]
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-suite-numba-") as cache:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        done = subprocess.run(
            command, cwd=checkout, env={**os.environ, "NUMBA_CACHE_DIR": cache}, capture_output=True, text=True
        )
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    found = re.search(r"(\d+) passed.* in ([\d.]+)s", summary)
    return {
        "load_1min": round(load, 2),
        "returncode": done.returncode,
        "passed": int(found.group(1)) if found else None,
        "pytest_s": float(found.group(2)) if found else None,
        "wall_s": round(wall, 1),
        "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
        "summary": summary,
    }


def describe(checkout: Path) -> str:
    done = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=checkout, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", required=True, help="PATH or PATH@COMMIT (repeat)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help='the quick tier: -m "not slow"')
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs = []
    for spec in args.checkout:
        path, _, commit = spec.partition("@")
        checkout = Path(path).resolve()
        if not (checkout / ".venv" / "bin" / "python").is_file():
            parser.error(f"{checkout} has no .venv: run its README's test command there first")
        files = files_at(checkout, commit) if commit else []
        label = f"{describe(checkout)} ({len(files)} files of {commit})" if commit else describe(checkout)
        runs.append((label, checkout, files))
    rows = []
    for round_ in range(args.rounds):
        for label, checkout, files in runs:
            row = {"round": round_ + 1, "checkout": label, **run_suite(checkout, files, args.quick)}
            rows.append(row)
            if not args.json:
                print(
                    f"round {row['round']}  {label:<32} load {row['load_1min']:>5}  {row['passed']} passed  "
                    f"pytest {row['pytest_s']} s  wall {row['wall_s']} s  cpu {row['cpu_s']} s",
                    flush=True,
                )
            if row["returncode"] != 0:
                print(f"{label}: pytest failed: {row['summary']}", file=sys.stderr)
    if args.json:
        print(json.dumps({"command": " ".join(["python -m bench.suite", *sys.argv[1:]]), "runs": rows}, indent=2))
    return 0 if all(row["returncode"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
