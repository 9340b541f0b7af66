"""Run a function on several real processes, deterministically.

Each rank runs ``fn(rank, *args)`` in a spawned process and leaves with
``os._exit``: torch's gloo sometimes aborts a process while the interpreter tears
down (SIGABRT after the work is done), so exit codes are not the verdict. A rank
that raises writes its traceback to ``error{rank}.txt`` in ``out_dir``; `launch`
re-raises it, and reports a rank that neither finished nor raised. Workers save
their own results; tests judge those.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

_DONE = "done{rank}"


def launch(
    fn,
    args: tuple,
    world_size: int = 2,
    timeout_s: float = 240.0,
    out_dir: str | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Spawn ``fn(rank, *args)`` on ``world_size`` processes and wait for all of them.

    Args:
        out_dir: where ranks mark themselves done (default: the last of ``args``).
        env: environment variables for every rank (``RANK``/``LOCAL_RANK`` are set per rank
            when ``env`` has ``WORLD_SIZE``: what torchrun gives Trainer and Accelerate).

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or exited without
            finishing; TimeoutError: a rank hung.
    """
    out = Path(out_dir if out_dir is not None else args[-1])
    out.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    processes = [context.Process(target=_run, args=(fn, rank, args, str(out), env or {})) for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(deadline - time.monotonic(), 0.1))
    if any(p.is_alive() for p in processes):
        for process in processes:
            process.kill()
        raise TimeoutError(f"processes did not finish in {timeout_s:.0f} s (a rank hung?)")
    errors = [out / f"error{rank}.txt" for rank in range(world_size)]
    for rank, error in enumerate(errors):
        if error.exists():
            raise AssertionError(f"rank {rank} raised:\n{error.read_text()}")
    for rank, process in enumerate(processes):
        if not (out / _DONE.format(rank=rank)).exists():
            raise AssertionError(f"rank {rank} exited with code {process.exitcode} before finishing")


def run_ranks(fn, args: tuple, directory, world_size: int = 2, timeout_s: float = 600.0) -> list:
    """`launch` ``fn(rank, *args, str(directory))`` as torchrun would (``MASTER_ADDR``/``PORT``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, and ``OMP_NUM_THREADS=1`` unless
    set); return what each rank saved as ``rank{r}.pt``.

    Accelerate (under Trainer too) sets torch's threads to the physical cores over
    ``LOCAL_WORLD_SIZE`` when ``OMP_NUM_THREADS`` is unset: without torchrun's two variables
    each rank of a tiny model would run 2 threads on 2 shared cores, several times slower."""
    import torch
    from _ddp_plans import free_port

    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    launch(fn, (*args, str(directory)), world_size, timeout_s=timeout_s, env=env)
    return [torch.load(Path(directory) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _run(fn, rank: int, args: tuple, out_dir: str, env: dict[str, str]) -> None:
    code = 0
    try:
        # Ranks are spawned, and loader workers would inherit spawn (each re-importing torch,
        # transformers, Lightning: ~15 s); torchrun's ranks fork their workers, as here.
        multiprocessing.set_start_method("fork", force=True)
        os.environ.update(env)
        if "WORLD_SIZE" in env:
            os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
        fn(rank, *args)
        Path(out_dir, _DONE.format(rank=rank)).touch()
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        code = 1
    finally:
        os._exit(code)


# What gloo prints when it aborts a process at random (torch 2.13 CPU), the only failure
# `run_documented` runs a command again for.
GLOO_ABORT = "terminate called without an active exception"


def run_documented(command: str, cwd: Path, env: dict[str, str], tries: int = 3):
    """Run a documented shell command as pasted (``torchrun ...`` included) and assert it
    succeeds. The launched scripts are the documentation's own, so they cannot leave with
    ``os._exit`` as `launch`'s workers do: a run that gloo aborted (`GLOO_ABORT` on stderr) is
    run again, at most ``tries`` times in all; any other failure fails at once."""
    import subprocess

    for attempt in range(tries):
        done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode == 0 or GLOO_ABORT not in done.stderr or attempt == tries - 1:
            break
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def documented_steps(page: Path, *, fragments: bool = False) -> list[tuple[str, str | None, str]]:
    """``(command, file, content)`` for each runnable piece of a docs page, in order: each line
    of a ```sh block, and each ```python block that opens with ``# <file>: <command>`` (a script
    to write, then run). With ``fragments``, a python block whose first line starts ``# fragment
    of `` is left out; any other python block must be a script."""
    import re

    script = re.compile(r"# (?P<file>[\w.-]+\.py): (?P<command>.+)")
    out = []
    for kind, body in re.findall(r"```(python|sh)\n(.*?)```", page.read_text(), re.S):
        if kind == "sh":
            out += [(line, None, "") for line in body.splitlines() if line.strip()]
            continue
        first = body.splitlines()[0]
        if fragments and first.startswith("# fragment of "):
            continue
        header = script.match(first)
        what = "neither a script nor a fragment" if fragments else "does not open with '# <file>: <command>'"
        assert header, f"a python block of {page.name} {what}:\n{body[:200]}"
        out.append((header["command"], header["file"], body))
    return out


def not_ignored(directory: Path, linked: tuple[str, ...] = (".venv",)) -> list[str]:
    """What a documented run left in ``directory`` (folders end in /; the ``linked`` names
    aside) that the repository's .gitignore does not ignore: a page's output must not show up
    in ``git status`` of a user who ran it in the repository root."""
    import subprocess

    left = sorted(path.name + ("/" if path.is_dir() else "") for path in directory.iterdir() if path.name not in linked)
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=Path(__file__).resolve().parent.parent,
        input="\n".join(left),
        capture_output=True,
        text=True,
    )
    ignored = set(done.stdout.splitlines())
    return [name for name in left if name not in ignored]
