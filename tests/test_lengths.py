"""Reading lengths: files, directories, list columns, loss tokens, bad input."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchplan.errors import DatasetError
from batchplan.formats.lengths import fingerprint_lengths, read_lengths


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return path


def test_reads_integer_length_column(tmp_path):
    path = write(tmp_path / "a.parquet", length=pa.array([3, 1, 4], pa.int64()), text=["x", "y", "z"])
    lengths = read_lengths(path)
    assert lengths.lengths.tolist() == [3, 1, 4]
    assert lengths.lengths.dtype == np.uint16  # every length below 2^16
    assert lengths.loss_tokens is None
    assert lengths.column == "length"


def test_list_column_gives_lengths_from_offsets(tmp_path):
    ids = pa.array([[1, 2, 3], [], [7], None, [5] * 10], pa.list_(pa.int32()))
    path = write(tmp_path / "a.parquet", input_ids=ids)
    assert read_lengths(path).lengths.tolist() == [3, 0, 1, 0, 10]
    large = write(tmp_path / "b.parquet", tokens=pa.array([[1, 2], [3]], pa.large_list(pa.int64())))
    assert read_lengths(large, tokens_column="tokens").lengths.tolist() == [2, 1]


def test_directory_reads_files_in_sorted_path_order(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "b.parquet", length=[20, 21])
    write(tmp_path / "a.parquet", length=[10])
    write(tmp_path / "sub" / "c.parquet", length=[30])
    lengths = read_lengths(tmp_path)
    assert lengths.lengths.tolist() == [10, 20, 21, 30]
    assert [rows for _, rows in lengths.files] == [1, 2, 1]
    # Several files given in any order: still sorted paths.
    again = read_lengths([tmp_path / "b.parquet", tmp_path / "a.parquet"])
    assert again.lengths.tolist() == [10, 20, 21]


def test_loss_tokens_column(tmp_path):
    path = write(tmp_path / "a.parquet", length=[5, 6], loss=[2, 0])
    lengths = read_lengths(path, loss_tokens_column="loss")
    assert lengths.loss_tokens.tolist() == [2, 0]
    assert lengths.fingerprint() != read_lengths(path).fingerprint()


def test_fingerprint_depends_on_every_length():
    base = np.array([1, 2, 3], dtype=np.int32)
    assert fingerprint_lengths(base) == fingerprint_lengths(base.astype(np.int64))
    assert fingerprint_lengths(base) != fingerprint_lengths(np.array([1, 2, 4]))
    assert fingerprint_lengths(base) != fingerprint_lengths(np.array([1, 2, 3, 0]))


@pytest.mark.parametrize(
    ("columns", "kwargs", "message"),
    [
        ({"other": [1]}, {}, "no length column 'length' and no token column 'input_ids'; columns are ['other']"),
        ({"length": [1.5]}, {}, "has type double; expected integer"),
        ({"length": ["a"]}, {}, "has type string"),
        ({"length": [1, -2]}, {}, "negative value -2"),
        ({"length": [3], "loss": [4]}, {"loss_tokens_column": "loss"}, "more loss tokens than tokens"),
        ({"length": [3]}, {"loss_tokens_column": "loss"}, "column 'loss' is missing"),
        ({"length": pa.array([], pa.int32())}, {}, "0 rows"),
    ],
)
def test_bad_columns_are_clear_errors(tmp_path, columns, kwargs, message):
    path = write(tmp_path / "a.parquet", **columns)
    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_lengths(path, **kwargs)


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        read_lengths(tmp_path / "missing.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        read_lengths(tmp_path / "junk.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no \\*.parquet files"):
        read_lengths(tmp_path / "empty")


def test_files_with_different_columns_are_rejected(tmp_path):
    write(tmp_path / "a.parquet", length=[1])
    write(tmp_path / "b.parquet", size=[1])
    with pytest.raises(DatasetError, match="b.parquet: column 'length' is missing"):
        read_lengths(tmp_path)


def test_real_demo_file():
    lengths = read_lengths("data/squad11_bert384.parquet")
    assert lengths.num_samples == 88_641
    assert int(lengths.lengths.max()) == 384


def test_a_length_column_of_lists_is_refused_not_read_as_token_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchplan.errors import DatasetError
    from batchplan.formats.lengths import read_lengths

    path = tmp_path / "lists.parquet"
    pq.write_table(pa.table({"length": pa.array([[1, 2], [3]])}), path)
    with pytest.raises(DatasetError, match="length column 'length' holds lists"):
        read_lengths(path)
    counted = read_lengths(path, length_column="absent", tokens_column="length")
    assert counted.lengths.tolist() == [2, 1]
