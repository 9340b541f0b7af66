"""Plan directories under attack: a rebuild killed at any point, a full disk, a read-only or
symlinked output, concurrent builds, and damaged directories. The previous plan survives
every interrupted rebuild byte for byte, and every reader refuses a damaged directory with
one line."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import batchplan
from batchplan import PlanConfig, build_plan_file, open_plan, validate_plan
from batchplan.errors import BatchPlanError, ConfigError, PlanFormatError
from batchplan.formats import directory_writer
from batchplan.formats.plan_format import dump_json, hash_text, metadata_crc
from batchplan_cli.main import app

DATA = Path(__file__).resolve().parent.parent / "data"
SQUAD = DATA / "squad11_bert384.parquet"
CONFIG = PlanConfig(max_tokens=1024, world_size=2, epochs=3)
REBUILD = PlanConfig(max_tokens=1024, world_size=2, epochs=3, seed=9)
CLI_OPTIONS = ["--max-tokens", "1024", "--world-size", "2", "--epochs", "3", "-q"]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def listed(directory: Path) -> list[str]:
    """The manifest and the epoch files it lists."""
    manifest = json.loads((directory / "manifest.json").read_bytes())
    return sorted([*(f["name"] for f in manifest["epoch_files"]), "manifest.json"])


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """A complete plan directory, the plan every rebuild below must not destroy."""
    directory = tmp_path_factory.mktemp("previous") / "plan"
    build_plan_file(SQUAD, directory, CONFIG, layout="directory")
    return directory


@pytest.fixture
def plan(previous, tmp_path) -> Path:
    return Path(shutil.copytree(previous, tmp_path / "plan"))


# --- a rebuild killed at a point chosen by a hook --------------------------------------------

# The build pauses at `os.replace` onto a name matching PATTERN, before or after the rename,
# and says so by writing MARKER: the test then sends its signal.
_PAUSING_BUILD = """
import os, re, sys, time
from pathlib import Path
pattern, when, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
replace = os.replace
def pause():
    marker.write_text("paused")
    time.sleep(600)
def paused_replace(source, target, *args, **kwargs):
    hit = re.fullmatch(pattern, os.path.basename(target))
    if hit and when == "before":
        pause()
    replace(source, target, *args, **kwargs)
    if hit and when == "after":
        pause()
os.replace = paused_replace
from batchplan_cli.main import main
sys.argv = ["batchplan", *sys.argv[4:]]
main()
"""

# (name pattern, before/after its rename, the plan the directory holds after the kill)
POINTS = {
    "writing-epoch-0": (r"epoch-00000\..*\.arrow", "before", "previous"),
    "writing-epoch-1": (r"epoch-00001\..*\.arrow", "before", "previous"),
    "writing-manifest": (r"manifest\.json", "before", "previous"),
    "after-the-switch": (r"manifest\.json", "after", "new"),
}


def kill_build_at(output: Path, point: tuple[str, str, str], signum: int, *options: str) -> int:
    """Run ``batchplan build SQUAD -o output --seed 9 ...``, signal it at ``point``; its exit code."""
    pattern, when, _ = point
    marker = output.parent / "paused"
    marker.unlink(missing_ok=True)
    build = ["build", str(SQUAD), "-o", str(output), *CLI_OPTIONS, "--seed", "9", *options]
    command = [sys.executable, "-c", _PAUSING_BUILD, pattern, when, str(marker), *build]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None, process.communicate()[1].decode()
        assert time.monotonic() < deadline, "the build never reached the point"
        time.sleep(0.02)
    process.send_signal(signum)
    process.communicate(timeout=60)
    return process.returncode


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("point", list(POINTS), ids=list(POINTS))
def test_a_killed_rebuild_leaves_a_whole_plan_and_the_next_build_cleans_up(plan, point, signum):
    before = snapshot(plan)
    code = kill_build_at(plan, POINTS[point], signum, "--layout", "directory")
    assert code == (143 if signum == signal.SIGTERM else -signal.SIGKILL)
    if POINTS[point][2] == "previous":
        assert {name: data for name, data in snapshot(plan).items() if name in before} == before
        assert open_plan(plan).metadata["seed"] == 0
        if signum == signal.SIGTERM:  # unwinds: removes what it wrote
            assert snapshot(plan) == before
    else:
        assert open_plan(plan).metadata["seed"] == 9
    assert validate_plan(open_plan(plan), SQUAD) == []
    build_plan_file(SQUAD, plan, REBUILD, layout="directory")
    assert sorted(p.name for p in plan.iterdir()) == listed(plan)  # no temporaries, no other plan's files
    assert validate_plan(open_plan(plan), SQUAD) == []


@pytest.mark.slow
def test_a_killed_rebuild_of_a_plan_file_keeps_the_previous_file(tmp_path):
    path = tmp_path / "plan.arrow"
    build_plan_file(SQUAD, path, CONFIG)
    before = path.read_bytes()
    assert kill_build_at(path, (r"plan\.arrow", "before", "previous"), signal.SIGKILL) == -signal.SIGKILL
    assert path.read_bytes() == before and validate_plan(path, SQUAD) == []
    build_plan_file(SQUAD, path, REBUILD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["paused", "plan.arrow"]


# --- a full disk -------------------------------------------------------------------------------


def fail_writes(monkeypatch, *, after_files: int, where: str = "epoch") -> None:
    """The epoch file written after ``after_files`` others (or the manifest) fails: no space left."""
    calls = []
    real = directory_writer.write_batches

    def write_batches(path, schema, metadata, batches):
        calls.append(path)
        if where == "epoch" and len(calls) > after_files:

            def failing(real_batches):
                yield next(iter(real_batches))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            batches = failing(batches)
        return real(path, schema, metadata, batches)

    @contextlib.contextmanager
    def no_space(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        yield

    monkeypatch.setattr(directory_writer, "write_batches", write_batches)
    if where == "manifest":
        monkeypatch.setattr(directory_writer, "atomic_path", no_space)


@pytest.mark.parametrize("where", ["epoch", "manifest"])
def test_a_full_disk_during_a_rebuild_keeps_the_previous_plan_and_says_so(plan, monkeypatch, where):
    before = snapshot(plan)
    fail_writes(monkeypatch, after_files=1, where=where)
    with pytest.raises(OSError) as raised:
        build_plan_file(SQUAD, plan, REBUILD, layout="directory")
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC and "\n" not in message
    removed = 1 if where == "epoch" else 3
    assert message == (
        f"{plan}: cannot write the plan directory (No space left on device); the previous plan there is intact "
        f"(its manifest.json and epoch files are untouched); the {removed} epoch file(s) this build wrote are "
        f"removed; free space on the disk holding {plan} or choose another output directory"
    )
    assert snapshot(plan) == before
    assert validate_plan(open_plan(plan), SQUAD) == []


def test_a_full_disk_during_a_first_build_leaves_no_epoch_file(tmp_path, monkeypatch):
    fail_writes(monkeypatch, after_files=2)
    command = ["build", str(SQUAD), "-o", str(tmp_path / "plan"), "--layout", "directory", *CLI_OPTIONS]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "there is no complete plan there (none was before); the 2 epoch file(s) this build wrote" in result.stderr
    assert list((tmp_path / "plan").iterdir()) == []


# --- read-only and symlinked outputs ------------------------------------------------------------


def test_a_read_only_output_directory_is_refused_before_planning(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(directory_writer, "tempfile", SimpleNamespace(mkstemp=read_only))
    expected = (
        f"output directory {tmp_path / 'plan'} is not writable: cannot write a file there (Read-only file "
        "system); make it writable or choose another output"
    )
    with pytest.raises(ConfigError) as raised:
        build_plan_file(SQUAD, tmp_path / "plan", CONFIG, layout="directory")
    assert str(raised.value) == expected
    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match=rf"output directory {tmp_path} is not writable: cannot create new there"):
        directory_writer.DirectoryWriter(tmp_path / "new", {})


def test_a_symlinked_output_is_written_through(previous, tmp_path):
    target = tmp_path / "real.arrow"
    build_plan_file(SQUAD, target, CONFIG)
    (tmp_path / "link.arrow").symlink_to(target)
    build_plan_file(SQUAD, tmp_path / "link.arrow", REBUILD)
    assert (tmp_path / "link.arrow").is_symlink() and open_plan(target).metadata["seed"] == 9
    shutil.copytree(previous, tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    build_plan_file(SQUAD, tmp_path / "link", REBUILD, layout="directory")
    assert (tmp_path / "link").is_symlink() and open_plan(tmp_path / "real").metadata["seed"] == 9
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == listed(tmp_path / "real")


# --- concurrent builds and old layouts -----------------------------------------------------------


def test_the_loser_of_two_concurrent_builds_says_another_build_may_be_running(tmp_path):
    """A build of other settings completes its plan while this one writes: this one says so."""
    from batchplan.formats.lengths import read_lengths
    from batchplan.formats.plan_writer import header_metadata
    from batchplan.planning.epochs import plan_epochs, prepare_entries

    lengths = read_lengths(SQUAD)
    prepared = prepare_entries(lengths.lengths, REBUILD)
    header = header_metadata(REBUILD, prepared.num_samples, prepared.entries, {}, lengths.fingerprint())
    epochs = plan_epochs(prepared, REBUILD, range(3))
    with pytest.raises(ConfigError) as raised:
        with directory_writer.DirectoryWriter(tmp_path / "plan", header) as loser:
            loser.write_epoch(prepared.entries, next(epochs))
            build_plan_file(SQUAD, tmp_path / "plan", CONFIG, layout="directory")  # the winner
            for epoch in epochs:
                loser.write_epoch(prepared.entries, epoch)
            loser.complete()
    assert "another build of other settings may be running into this directory" in str(raised.value)
    assert sorted(p.name for p in (tmp_path / "plan").iterdir()) == listed(tmp_path / "plan")
    assert validate_plan(tmp_path / "plan", SQUAD) == []


def test_a_directory_of_unqualified_epoch_file_names_is_read_and_rebuilt(plan):
    """Epoch files named without the plan's fingerprint (epoch-00000.arrow) read as their manifest lists them."""
    expected = open_plan(plan).read_all()
    manifest = json.loads((plan / "manifest.json").read_bytes())
    for epoch, entry in enumerate(manifest["epoch_files"]):
        (plan / entry["name"]).rename(plan / f"epoch-{epoch:05d}.arrow")
        entry["name"] = f"epoch-{epoch:05d}.arrow"
    manifest["content_hash"] = hash_text(metadata_crc(manifest))
    (plan / "manifest.json").write_bytes(dump_json(manifest))
    assert open_plan(plan).read_all().equals(expected) and validate_plan(plan, SQUAD) == []
    build_plan_file(SQUAD, plan, REBUILD, layout="directory")
    assert sorted(p.name for p in plan.iterdir()) == listed(plan)


# --- damaged directories: every reader gives one line ---------------------------------------------


def edit_manifest(change: Callable[[dict], object], rehash: bool = False) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        manifest = json.loads((directory / "manifest.json").read_bytes())
        change(manifest)
        if rehash:
            manifest["content_hash"] = hash_text(metadata_crc(manifest))
        (directory / "manifest.json").write_bytes(dump_json(manifest))

    return damage


def epoch_file(directory: Path, epoch: int) -> Path:
    return directory / json.loads((directory / "manifest.json").read_bytes())["epoch_files"][epoch]["name"]


def _swap(directory: Path) -> None:
    first, second = epoch_file(directory, 0), epoch_file(directory, 1)
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)


def _truncate(epoch: int, keep: float) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = epoch_file(directory, epoch)
        path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])

    return damage


def _set(*keys, value) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        target = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value(target[keys[-1]]) if callable(value) else value

    return change


def _pop(key: str) -> Callable[[dict], object]:
    return lambda manifest: manifest.pop(key)


def _one_fewer_epoch(manifest: dict) -> None:
    manifest["epochs"] -= 1
    for key in ("steps_per_epoch", "rows_per_rank", "packing", "epoch_files"):
        manifest[key] = manifest[key][:-1]


def _swap_listed_names(manifest: dict) -> None:
    files = manifest["epoch_files"]
    files[0]["name"], files[1]["name"] = files[1]["name"], files[0]["name"]


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda directory: (directory / name).write_bytes(data)


def _from_other(epoch: int | None) -> Callable[[Path], None]:
    """An epoch file (or, with None, the manifest) replaced by the other plan's."""

    def damage(directory: Path) -> None:
        other = directory.parent / "other"
        if epoch is None:
            (directory / "manifest.json").write_bytes((other / "manifest.json").read_bytes())
        else:
            epoch_file(directory, epoch).write_bytes(epoch_file(other, epoch).read_bytes())

    return damage


def _as_directory(directory: Path, path: Path) -> None:
    path.unlink()
    path.mkdir()


MANIFEST_KEYS = (
    "epoch_files",
    "steps_per_epoch",
    "plan",
    "content_hash",
    "world_size",
    "epochs",
    "layout",
    "format_version",
)
REHASHED_KEYS = ("epoch_files", "steps_per_epoch", "plan", "world_size", "rows_per_rank", "num_samples")
DAMAGES: dict[str, Callable[[Path], None]] = {
    "manifest removed": lambda d: (d / "manifest.json").unlink(),
    "manifest and an epoch file removed": lambda d: [epoch_file(d, 1).unlink(), (d / "manifest.json").unlink()],
    "manifest empty": _write("manifest.json", b""),
    "manifest not JSON": _write("manifest.json", b"{not json"),
    "manifest cut short": lambda d: (d / "manifest.json").write_bytes((d / "manifest.json").read_bytes()[:200]),
    "manifest a list": _write("manifest.json", b"[1, 2]"),
    "manifest not UTF-8": _write("manifest.json", b"\xff\xfe\x00{"),
    "manifest a directory": lambda d: _as_directory(d, d / "manifest.json"),
    "epoch file removed": lambda d: epoch_file(d, 2).unlink(),
    "epoch file a directory": lambda d: _as_directory(d, epoch_file(d, 0)),
    "epoch files swapped": _swap,
    "epoch file empty": _truncate(1, 0),
    "epoch file cut at 10 %": _truncate(0, 0.1),
    "epoch file cut at 90 %": _truncate(2, 0.9),
    "epoch file of another plan": _from_other(1),
    "manifest of another plan": _from_other(None),
    **{f"manifest without {key}": edit_manifest(_pop(key)) for key in MANIFEST_KEYS},
    **{f"manifest without {key}, hash recomputed": edit_manifest(_pop(key), rehash=True) for key in REHASHED_KEYS},
    "steps_per_epoch edited": edit_manifest(_set("steps_per_epoch", 1, value=lambda v: v + 1)),
    "tokens edited": edit_manifest(_set("epoch_files", 1, "tokens", value=lambda v: v + 5)),
    "rows_per_rank edited": edit_manifest(_set("rows_per_rank", 1, value=lambda v: v - 1)),
    "world_size edited": edit_manifest(_set("world_size", value=1)),
    "num_samples edited": edit_manifest(_set("num_samples", value=10)),
    "epoch file name edited": edit_manifest(_set("epoch_files", 0, "name", value="../../escape.arrow")),
    "content_hash edited": edit_manifest(_set("content_hash", value="crc32:00000000")),
    "steps_per_epoch edited, hash recomputed": edit_manifest(_set("steps_per_epoch", 1, value=lambda v: v + 1), True),
    "tokens edited, hash recomputed": edit_manifest(_set("epoch_files", 1, "tokens", value=lambda v: v + 5), True),
    "rows_per_rank edited, hash recomputed": edit_manifest(_set("rows_per_rank", 1, value=lambda v: v - 1), True),
    "world_size edited, hash recomputed": edit_manifest(_set("world_size", value=1), True),
    "epochs edited, hash recomputed": edit_manifest(_one_fewer_epoch, True),
    "steps a string, hash recomputed": edit_manifest(_set("steps_per_epoch", 0, value="many"), True),
    "file names swapped, hash recomputed": edit_manifest(_swap_listed_names, True),
    "epoch hash edited, hash recomputed": edit_manifest(_set("epoch_files", 0, "content_hash", value="crc32:0"), True),
}


@pytest.fixture(scope="module")
def damaged_root(previous, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("damaged")
    build_plan_file(SQUAD, root / "other", REBUILD, layout="directory")
    return root


def read_everything(directory: Path):
    """Open, read every rank's rows, verify: the rows read, or the error raised (never another exception)."""
    try:
        opened = batchplan.open_plan(directory)
        for epoch in range(opened.num_epochs):
            for rank in range(opened.world_size):
                opened.read_rank(epoch, rank)
        opened.verify()
        return opened.read_all()
    except BatchPlanError as error:
        assert "\n" not in str(error), str(error)
        return error


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_every_reader_refuses_a_damaged_directory_in_one_line(previous, damaged_root, damage):
    directory = damaged_root / damage.replace(" ", "-")
    shutil.copytree(previous, directory)
    DAMAGES[damage](directory)
    assert isinstance(read_everything(directory), PlanFormatError)
    with pytest.raises(BatchPlanError) as raised:  # the sampler: open, then its rank's rows
        from batchplan.runtime import PlanSampler

        for rank in range(2):
            for epoch in range(3):
                sampler = PlanSampler(directory, rank=rank, world_size=2)
                sampler.set_epoch(epoch)
                list(sampler)
        batchplan.open_plan(directory).verify()
    assert "\n" not in str(raised.value)
    for command in ("inspect", "validate"):
        result = CliRunner().invoke(app, [command, str(directory)])
        assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 or command == "validate" and lines[-1].endswith("guarantee(s) violated"), lines


def test_a_directory_without_its_manifest_says_what_is_there(previous, tmp_path):
    copy = Path(shutil.copytree(previous, tmp_path / "plan"))
    (copy / "manifest.json").unlink()
    expected = r"all 3 epoch files are there but no manifest\.json: the build that wrote the last one stopped"
    with pytest.raises(PlanFormatError, match=expected):
        open_plan(copy)
    build_plan_file(SQUAD, copy, CONFIG, only_epochs=range(2, 3))  # any part of the build writes it
    assert validate_plan(copy, SQUAD) == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_flipped_bytes_anywhere_in_a_directory_are_refused_or_harmless(previous, data):
    """A flipped byte is refused with one line, or (padding) leaves the rows the plan's."""
    expected = open_plan(previous).read_all()
    names = sorted(p.name for p in previous.iterdir())
    name = data.draw(st.sampled_from(names))
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(shutil.copytree(previous, Path(scratch) / "plan"))
        raw = bytearray((copy / name).read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
        (copy / name).write_bytes(bytes(raw))
        outcome = read_everything(copy)
        assert isinstance(outcome, PlanFormatError) or outcome.equals(expected)
