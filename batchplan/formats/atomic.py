"""Files replaced atomically: written to a temporary beside the target, synced, renamed
onto it; a failed write leaves the previous file as it was, and temporaries of killed
writers are removed by the next write. A target that is a symbolic link is written
through: its target file is replaced and the link stays."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["atomic_path", "remove_stale_temporaries"]

# .NAME.PID.RANDOM.tmp, as atomic_path names them (mkstemp's RANDOM has no dot)
_TEMPORARY = re.compile(r"\.(.+)\.(\d+)\.[^.]+\.tmp")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (beside its target, if ``path`` is a symbolic link),
    renamed onto it on success, removed on failure."""
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    _remove_stale_temporaries(path)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    os.close(handle)
    temporary = Path(name)
    try:
        yield temporary
        with open(temporary, "rb+") as written:
            os.fsync(written.fileno())
        os.chmod(temporary, 0o666 & ~_current_umask())  # mkstemp made it 0600
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def remove_stale_temporaries(directory: Path, keep: Callable[[str], bool] = lambda _name: False) -> list[str]:
    """Delete the temporaries in ``directory`` whose writer is gone (a kill -9), except those
    of targets named ``name`` with ``keep(name)``; return the names deleted."""
    removed = []
    for child in directory.iterdir():
        match = _TEMPORARY.fullmatch(child.name)
        if match and not keep(match[1]) and not _process_alive(int(match[2])):
            child.unlink(missing_ok=True)
            removed.append(child.name)
    return removed


def _remove_stale_temporaries(path: Path) -> None:
    """Delete temporaries of earlier writes to ``path`` whose process is gone (a kill -9)."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = stale.name[len(path.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            stale.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OverflowError:  # not a process id
        return False
    return True


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
