"""Reading lengths from a Hugging Face ``datasets`` folder (``Dataset.save_to_disk``).

Folders are written by the real ``datasets`` library where the test needs one (those
tests skip without it); folders that ``save_to_disk`` cannot produce (files listed out
of path order, damaged files) are written with pyarrow in the same layout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchplan.config import PlanConfig
from batchplan.errors import DatasetError
from batchplan.formats.lengths import DatasetFiles, count_samples, find_dataset_files, read_lengths
from batchplan.operations.build import build_plan_file
from batchplan.operations.validate import validate_plan
from batchplan_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def save_to_disk(path: Path, columns: dict, **kwargs) -> Path:
    """``datasets.Dataset.from_dict(columns).save_to_disk(path, **kwargs)``; skips without ``datasets``."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(columns).save_to_disk(str(path), **kwargs)
    return path


def write_folder(path: Path, shards: dict[str, pa.Table], order: list[str]) -> Path:
    """A folder in save_to_disk's layout, its state.json listing ``order``, written with pyarrow."""
    path.mkdir()
    for name, table in shards.items():
        with pa.ipc.new_stream(str(path / name), table.schema) as writer:
            writer.write_table(table, max_chunksize=2)
    state = {"_data_files": [{"filename": name} for name in order], "_fingerprint": "0", "_split": None}
    (path / "state.json").write_text(json.dumps(state))
    (path / "dataset_info.json").write_text("{}")
    return path


def token_ids(num_samples: int, seed: int = 0) -> list[list[int] | None]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, int(n)).tolist() for n in rng.integers(0, 300, num_samples)]


def test_folder_gives_the_lengths_and_fingerprint_of_the_same_parquet(tmp_path):
    ids = token_ids(500)
    ids[7], ids[11] = None, []  # a null list reads as 0 tokens, as in Parquet
    columns = {"input_ids": ids, "length": [0 if x is None else len(x) for x in ids], "text": ["x"] * 500}
    folder = save_to_disk(tmp_path / "ds", columns, num_shards=3)
    pq.write_table(pa.table(columns), tmp_path / "same.parquet")
    # The length column, then (no column "absent") the list offsets of input_ids.
    for kwargs, column in (({}, "length"), ({"length_column": "absent"}, "input_ids")):
        from_folder = read_lengths(folder, **kwargs)
        from_parquet = read_lengths(tmp_path / "same.parquet", **kwargs)
        assert from_folder.lengths.dtype == np.uint16 and from_folder.column == from_parquet.column == column
        assert from_folder.lengths.tolist() == from_parquet.lengths.tolist() == columns["length"]
        assert from_folder.fingerprint() == from_parquet.fingerprint()
    files = read_lengths(folder).files
    assert [Path(path).name for path, _ in files] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    assert sum(rows for _, rows in files) == 500 and all(rows > 0 for _, rows in files)


def test_shards_are_read_in_row_order(tmp_path):
    lengths = list(range(1, 101))
    folder = save_to_disk(tmp_path / "ds", {"length": lengths}, max_shard_size=200)  # ~100 B a shard
    assert len(find_dataset_files(folder).paths) > 3
    assert read_lengths(folder).lengths.tolist() == lengths


def test_state_json_order_wins_over_path_order(tmp_path):
    shards = {"b.arrow": pa.table({"length": [1, 2, 3]}), "a.arrow": pa.table({"length": [4, 5]})}
    folder = write_folder(tmp_path / "ds", shards, order=["b.arrow", "a.arrow"])
    lengths = read_lengths(folder)
    assert lengths.lengths.tolist() == [1, 2, 3, 4, 5]
    assert [(Path(path).name, rows) for path, rows in lengths.files] == [("b.arrow", 3), ("a.arrow", 2)]
    assert count_samples(find_dataset_files(folder)) == 5


def test_an_empty_folder_has_nothing_to_plan(tmp_path):
    folder = write_folder(tmp_path / "ds", {"a.arrow": pa.table({"length": pa.array([], pa.int64())})}, ["a.arrow"])
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(folder))}: dataset has 0 rows; nothing to plan"):
        read_lengths(folder)


def test_nulls_slices_and_fixed_size_lists(tmp_path):
    ids = pa.array([[1, 2], None, [3, 4], [5, 6]], pa.list_(pa.int32(), 2))
    table = pa.table({"fixed": ids, "n": pa.array([None, 3, 2**31 - 1, 0], pa.uint32())})
    shards = {"a.arrow": table.slice(1), "b.arrow": table.slice(0, 1)}
    folder = write_folder(tmp_path / "ds", shards, ["a.arrow", "b.arrow"])
    assert read_lengths(folder, length_column="absent", tokens_column="fixed").lengths.tolist() == [0, 2, 2, 2]
    assert read_lengths(folder, length_column="n").lengths.tolist() == [3, 2**31 - 1, 0, 0]


@pytest.mark.parametrize("type_", [pa.int8(), pa.uint16(), pa.int32(), pa.int64(), pa.uint64(), pa.float64()])
def test_numeric_values_without_pyarrow_to_numpy(type_):
    from batchplan.formats.arrow import numpy_of

    array = pa.array([5, None, 7, 0, None, 3, 9, 1, 2, 4, None], type_)
    for start, stop in ((0, 11), (1, 11), (3, 9), (9, 11), (4, 4)):
        part = array.slice(start, stop - start)
        expected = [0 if value is None else value for value in part.to_pylist()]
        assert numpy_of(part).tolist() == expected


def test_length_column_wins_over_token_ids(tmp_path):
    folder = save_to_disk(tmp_path / "ds", {"input_ids": [[1, 2], [3]], "length": [10, 20]})
    assert read_lengths(folder).lengths.tolist() == [10, 20]
    assert read_lengths(folder, length_column="n").lengths.tolist() == [2, 1]
    named = save_to_disk(tmp_path / "named", {"tokens": [[1, 2, 3], [4]], "size": [7, 8]})
    assert read_lengths(named, length_column="size").lengths.tolist() == [7, 8]
    assert read_lengths(named, tokens_column="tokens").column == "tokens"
    with pytest.raises(DatasetError, match=r"no length column 'length' and no token column 'input_ids'"):
        read_lengths(named)


def test_loss_tokens_column(tmp_path):
    columns = {"input_ids": [[1, 2, 3], [4, 5], [6]], "labels_count": [2, 0, 1]}
    folder = save_to_disk(tmp_path / "ds", columns, num_shards=2)
    pq.write_table(pa.table(columns), tmp_path / "same.parquet")
    lengths = read_lengths(folder, loss_tokens_column="labels_count")
    assert lengths.loss_tokens.tolist() == [2, 0, 1]
    same = read_lengths(tmp_path / "same.parquet", loss_tokens_column="labels_count")
    assert lengths.fingerprint() == same.fingerprint()
    assert lengths.fingerprint() != read_lengths(folder).fingerprint()
    bad = save_to_disk(tmp_path / "bad", {"input_ids": [[1], [2, 3]], "labels_count": [0, 3]})
    with pytest.raises(DatasetError, match=r"data-00000-of-00001.arrow \(row 1\): 1 samples have more loss tokens"):
        read_lengths(bad, loss_tokens_column="labels_count")


def test_dataset_dict_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    split = datasets.Dataset.from_dict({"length": [1, 2]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    expected = f"{tmp_path / 'dd'}: a Hugging Face DatasetDict (dataset_dict.json) with splits ['train', 'test']"
    with pytest.raises(DatasetError, match=rf"^{re.escape(expected)}; .*pass one split's folder, PATH/<split>, e.g. "):
        read_lengths(tmp_path / "dd")
    assert read_lengths(tmp_path / "dd" / "test").lengths.tolist() == [1, 2]


def test_a_folder_with_other_paths_is_refused(tmp_path):
    folder = write_folder(tmp_path / "ds", {"a.arrow": pa.table({"length": [1]})}, ["a.arrow"])
    other = write_folder(tmp_path / "other", {"a.arrow": pa.table({"length": [2]})}, ["a.arrow"])
    pq.write_table(pa.table({"length": [3]}), tmp_path / "x.parquet")
    for paths in ([folder, tmp_path / "x.parquet"], [tmp_path / "x.parquet", folder], [folder, other], [folder] * 2):
        with pytest.raises(DatasetError, match="datasets folder given with 1 other path.*pass one datasets folder"):
            read_lengths(paths)
    assert read_lengths([folder]).lengths.tolist() == [1]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", r"data-00001-of-00003.arrow: missing, but .*state.json lists it as Arrow file 2 of 3"),
        ("empty", r"data-00001-of-00003.arrow: not a readable Arrow IPC stream \(.*\); expected the Arrow files"),
        ("garbage", r"data-00001-of-00003.arrow: not a readable Arrow IPC stream"),
        ("cut", r"data-00001-of-00003.arrow: not a readable Arrow IPC stream \(Expected to"),
        ("no_end", r"data-00001-of-00003.arrow: expected an Arrow IPC stream ending with the end-of-stream marker"),
        ("state", r"state.json: not a readable state.json"),
        ("no_files", r"state.json: expected a non-empty '_data_files' list of Arrow files, found \[\]"),
        ("bad_entry", r"state.json: expected '_data_files' entries like .* found 'data.arrow'"),
    ],
)
def test_a_damaged_folder_is_a_clear_error(tmp_path, damage, message):
    folder = save_to_disk(tmp_path / "ds", {"input_ids": token_ids(30)}, num_shards=3)
    shard = folder / "data-00001-of-00003.arrow"
    content = shard.read_bytes()
    if damage == "missing":
        shard.unlink()
    elif damage in ("empty", "garbage", "cut", "no_end"):
        shard.write_bytes(
            {"empty": b"", "garbage": b"not arrow" * 20, "cut": content[:-28] + content[-8:], "no_end": content[:-8]}[
                damage
            ]
        )
    else:
        entries = {"state": None, "no_files": [], "bad_entry": ["data.arrow"]}[damage]
        text = "{not json" if damage == "state" else json.dumps({"_data_files": entries})
        (folder / "state.json").write_text(text)
    with pytest.raises(DatasetError, match=message):
        read_lengths(folder)
    # The build reports it the same way, as one line and exit code 1.
    result = run("build", folder, "-o", tmp_path / "plan.arrow", "--max-tokens", 512, "-q")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1


def test_a_directory_without_parquet_or_state_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: directory holds no \*.parquet files and no state.json"):
        read_lengths(tmp_path / "empty")


def test_build_and_validate_through_the_cli(tmp_path):
    ids = token_ids(400, seed=1)
    folder = save_to_disk(tmp_path / "ds", {"input_ids": ids, "text": ["t"] * 400}, num_shards=4)
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "same.parquet")
    plan = tmp_path / "plan.arrow"
    result = run("build", folder, "-o", plan, "--max-tokens", 512, "--world-size", 2, "--epochs", 2, "--drop-empty")
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout
    for dataset in (folder, tmp_path / "same.parquet"):  # the plan validates against either form of the data
        result = run("validate", plan, "--dataset", dataset)
        assert result.exit_code == 0, result.output
        assert "OK, every guarantee holds" in result.stdout and "400 samples" in result.stdout
    # ...and a plan built from the Parquet file validates against the folder.
    from_parquet = tmp_path / "from-parquet.arrow"
    result = run("build", tmp_path / "same.parquet", "-o", from_parquet, "--max-tokens", 512, "--drop-empty", "-q")
    assert result.exit_code == 0, result.output
    assert run("validate", from_parquet, "--dataset", folder).exit_code == 0
    other = save_to_disk(tmp_path / "other", {"input_ids": token_ids(400, seed=2)})
    result = run("validate", plan, "--dataset", other)
    assert result.exit_code == 1 and "lengths fingerprint" in result.output
    result = run("compare", folder, "--max-tokens", 512, "--world-size", 2, "--drop-empty", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)


def test_plan_records_the_arrow_files_and_the_runtime_checks_the_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    columns = {"input_ids": token_ids(200, seed=3), "loss": [0] * 200}
    folder = save_to_disk(tmp_path / "ds", columns, num_shards=2)
    plan = tmp_path / "plan.arrow"
    metadata = build_plan_file(folder, plan, PlanConfig(max_tokens=512, drop_empty=True), loss_tokens_column="loss")
    files = read_lengths(folder).files
    assert metadata["dataset"]["files"] == [[path, rows] for path, rows in files]
    assert metadata["dataset"]["length_column"] == "input_ids"
    violations = validate_plan(plan, folder)
    assert violations == []
    pytest.importorskip("torch")
    from batchplan.runtime import PlanSampler

    lengths = read_lengths(folder, loss_tokens_column="loss")
    sampler = PlanSampler(plan, rank=0, world_size=1)
    sampler.check_dataset(datasets.load_from_disk(str(folder)), lengths.lengths, loss_tokens=lengths.loss_tokens)


def test_find_dataset_files_keeps_parquet_as_it_was(tmp_path):
    pq.write_table(pa.table({"length": [1]}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"length": [2]}), tmp_path / "a.parquet")
    found = find_dataset_files(tmp_path)
    assert found == DatasetFiles((str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")))
    assert count_samples(found) == 2


@pytest.mark.slow
def test_reading_and_building_from_a_folder_import_neither_datasets_nor_pandas(tmp_path):
    folder = save_to_disk(tmp_path / "ds", {"input_ids": token_ids(100, seed=4), "n": list(range(100))}, num_shards=2)
    # Reading the lengths loads neither module (pyarrow's to_numpy and fill_null would load pandas).
    read = f"""
import sys
from batchplan.formats.lengths import read_lengths
read_lengths({str(folder)!r}, loss_tokens_column="n", length_column="n")
read_lengths({str(folder)!r})
loaded = {{"datasets", "pandas"}} & set(sys.modules)
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", read], check=True, cwd=ROOT)
    # A build and a validate from the folder run with both made unimportable, and load no `datasets`.
    build = f"""
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("datasets", "pandas"):
            raise ImportError(f"{{name}} is refused in this test")

sys.meta_path.insert(0, Refuse())
from typer.testing import CliRunner
from batchplan_cli.main import app

plan = {str(tmp_path / "plan.arrow")!r}
for args in (["build", {str(folder)!r}, "-o", plan, "--max-tokens", "512", "--drop-empty"],
             ["validate", plan, "--dataset", {str(folder)!r}]):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
assert "datasets" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", build], check=True, cwd=ROOT, env=os.environ | {"BATCHPLAN_DEBUG": "1"})
