"""A large Parquet file is read in pieces of whole row groups (`batchplan.formats.dataset_files`),
on several threads: the lengths are those of reading it whole, errors name the file's own rows,
and progress still counts files."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplan.errors import DatasetError
from batchplan.formats import dataset_files
from batchplan.formats.dataset_files import Piece, pieces_of
from batchplan.formats.lengths import read_lengths


@given(
    group_rows=st.lists(st.lists(st.integers(0, 9), max_size=6), min_size=1, max_size=4),
    piece_rows=st.integers(1, 12),
)
def test_pieces_cover_every_row_group_once_in_order(group_rows, piece_rows):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dataset_files, "PIECE_ROWS", piece_rows)
        pieces = pieces_of(group_rows)
    start = 0
    for file, rows in enumerate(group_rows):
        mine = [piece for piece in pieces if piece.file == file]
        assert mine and all(piece.file_start == start for piece in mine)
        groups = [group for piece in mine for group in (piece.row_groups or range(len(rows)))]
        assert groups == list(range(len(rows)))
        for piece in mine:
            held = rows if piece.row_groups is None else [rows[g] for g in piece.row_groups]
            assert piece.end - piece.start == sum(held)
            assert piece.row_groups is None or sum(held) >= piece_rows or piece.row_groups[-1] == len(rows) - 1
        start += sum(rows)
    assert [p.start for p in pieces[1:]] == [p.end for p in pieces[:-1]] and pieces[0].start == 0


def test_one_row_group_or_a_small_file_is_one_piece():
    assert pieces_of([[5], [2, 3]]) == [Piece(0, None, 0, 5, 0), Piece(1, None, 5, 10, 5)]


def _write(path, lengths, group):
    pq.write_table(pa.table({"length": pa.array(lengths, pa.int64())}), path, row_group_size=group)
    return path


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=3).filter(any),
    group=st.integers(1, 9),
    piece_rows=st.integers(1, 20),
    wide=st.booleans(),
)
def test_lengths_read_in_pieces_equal_the_files_read_whole(tmp_path_factory, sizes, group, piece_rows, wide):
    folder = tmp_path_factory.mktemp("pieces")
    rng = np.random.default_rng(len(sizes) * 100 + group)
    high = 70_000 if wide else 9_000
    files = [rng.integers(0, high, size) for size in sizes]
    for index, lengths in enumerate(files):
        _write(folder / f"{index:02d}.parquet", lengths, group)
    done: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dataset_files, "PIECE_ROWS", piece_rows)
        got = read_lengths(folder, on_file=done.append)
    want = np.concatenate(files)
    assert got.lengths.tolist() == want.tolist()
    assert got.lengths.dtype == (np.int32 if want.max(initial=0) >= 1 << 16 else np.uint16)
    assert sorted(done) == sorted(str(folder / f"{index:02d}.parquet") for index in range(len(sizes)))
    assert [rows for _, rows in got.files] == sizes


def test_an_error_in_a_later_piece_names_the_row_of_its_file(tmp_path, monkeypatch):
    lengths = [4] * 30
    lengths[23] = -1
    _write(tmp_path / "a.parquet", [1, 2], 2)
    path = _write(tmp_path / "b.parquet", lengths, 5)
    monkeypatch.setattr(dataset_files, "PIECE_ROWS", 10)
    with pytest.raises(DatasetError, match=rf"{path} row 23 \(sample 25\)"):
        read_lengths(tmp_path)
