"""Mixture files: every bad mixture is one clear line; good ones round-trip, fingerprint, and read
their sources' lengths as one dataset in the file's order."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchplan.errors import BatchPlanError, ConfigError, DatasetError
from batchplan.formats.mixture_file import read_mixture, read_mixture_lengths
from batchplan.mixture import Mixture, MixtureSource


def source(name="web", **values):
    return {"name": name, "paths": ["web.parquet"], **values}


def weighted(*sources, tokens="1M"):
    return {"sources": list(sources), "tokens": tokens}


def write_parquet(path, **columns):
    pq.write_table(pa.table({name: pa.array(values, pa.int32()) for name, values in columns.items()}), path)


GOOD = weighted(
    source("web", weight=0.6), source("code", weight=0.3, length_column="n_tokens"), source("math", weight=0.1)
)

BAD = {
    "unknown top-level key": ({**GOOD, "weights": {}}, "unknown mixture keys ['weights']; the known keys are"),
    "unknown source key": (weighted(source(weigth=1)), "source 'web': unknown keys ['weigth']; the known keys are"),
    "no sources": ({"sources": [], "tokens": 10}, "a mixture needs a non-empty list under sources"),
    "sources not a list": ({"sources": {"web": 1}, "tokens": 10}, "non-empty list under sources"),
    "source not a mapping": (weighted("web"), "sources[0] is str"),
    "missing name": (weighted({"paths": ["a"], "weight": 1}), "source at position 0: key 'name' is missing"),
    "missing paths": (weighted({"name": "web", "weight": 1}), "source 'web': key 'paths' is missing"),
    "empty paths": (weighted(source(paths=[], weight=1)), "source 'web': paths must be a non-empty list"),
    "blank path": (weighted(source(paths=[" "], weight=1)), "source 'web': paths holds ' '"),
    "empty name": (weighted(source("", weight=1)), "source name '' is not a name"),
    "name with a space": (weighted(source("my web", weight=1)), "source name 'my web' is not a name"),
    "duplicate names": (weighted(source(weight=1), source(weight=2)), "source 'web' is named twice"),
    "negative weight": (weighted(source(weight=-0.1)), "source 'web': weight must be a finite number >= 0, got -0.1"),
    "infinite weight": (weighted(source(weight=float("inf"))), "source 'web': weight must be a finite number >= 0"),
    "weight not a number": (weighted(source(weight="lots")), "source 'web': weight must be a finite number"),
    "all weights zero": (weighted(source("a", weight=0), source("b", weight=0.0)), "every source has weight 0"),
    "tokens and epochs": (
        weighted(source(weight=1), source("code", epochs=2)),
        "source 'code': epochs is given in a mixture with tokens",
    ),
    "tokens without weight": (weighted(source()), "source 'web': weight is missing in a mixture with tokens"),
    "weight without tokens": (
        {"sources": [source(weight=1)]},
        "source 'web': weight is given in a mixture without tokens",
    ),
    "neither tokens nor epochs": (
        {"sources": [source()]},
        "source 'web': epochs is missing in a mixture without tokens",
    ),
    "negative epochs": ({"sources": [source(epochs=-1)]}, "source 'web': epochs must be a finite number >= 0"),
    "all epochs zero": ({"sources": [source(epochs=0)]}, "every source has epochs 0"),
    "tokens zero": (weighted(source(weight=1), tokens=0), "tokens must be a whole number of tokens >= 1"),
    "tokens not a count": (weighted(source(weight=1), tokens="lots"), "tokens must be a whole number"),
    "tokens fractional": (weighted(source(weight=1), tokens=2.5), "got 2.5"),
    "empty column name": (
        weighted(source(weight=1, length_column="")),
        "source 'web': length_column must be a column name",
    ),
}


@pytest.mark.parametrize("values, message", BAD.values(), ids=BAD.keys())
def test_a_bad_mixture_is_one_line_that_names_the_problem(values, message):
    with pytest.raises(ConfigError) as error:
        Mixture.from_dict(values)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("tokens", [2_000_000_000, 2.0e9, "2.0e9", "2e9", "2G", "2_000M", "2000000k", " 2G "], ids=repr)
def test_tokens_accept_numbers_and_suffixes(tokens):
    assert Mixture.from_dict(weighted(source(weight=1), tokens=tokens)).tokens == 2_000_000_000


def test_tokens_take_the_tera_suffix():
    assert Mixture.from_dict(weighted(source(weight=1), tokens="3T")).tokens == 3 * 10**12


def test_round_trip_through_to_dict():
    mixture = Mixture.from_dict(GOOD)
    again = Mixture.from_dict(json.loads(json.dumps(mixture.to_dict())))
    assert again == mixture
    assert again.to_dict() == mixture.to_dict()
    assert mixture.sources[1].length_column == "n_tokens"
    assert "length_column" not in mixture.to_dict()["sources"][0]  # unset keys are left out


def test_round_trip_of_a_mixture_sized_by_epochs():
    mixture = Mixture.from_dict({"sources": [source("a", epochs=2.5), source("b", epochs=0)]})
    assert Mixture.from_dict(mixture.to_dict()) == mixture
    assert mixture.by_epochs and mixture.tokens is None


def test_fingerprint_is_stable():
    """The fingerprint is SHA-256 of canonical JSON (no process-dependent hash): pinned to the digest of
    the mixture written out by hand, and to its value."""
    stored = {
        "sources": [
            {"name": "web", "paths": ["web.parquet"], "weight": 0.6},
            {"name": "code", "paths": ["web.parquet"], "weight": 0.3, "length_column": "n_tokens"},
            {"name": "math", "paths": ["web.parquet"], "weight": 0.1},
        ],
        "tokens": 1_000_000,
    }
    canonical = json.dumps(stored, sort_keys=True, separators=(",", ":")).encode()
    assert Mixture.from_dict(GOOD).fingerprint() == hashlib.sha256(canonical).hexdigest()[:16] == "765b6ae07282f664"


@pytest.mark.parametrize(
    "change",
    [
        {"tokens": "2M"},
        {"sources": [source("web", weight=0.6), source("code", weight=0.3), source("math", weight=0.1)]},
        {"sources": [source("web", weight=0.5), *GOOD["sources"][1:]]},
        {"sources": [source("www", weight=0.6), *GOOD["sources"][1:]]},
        {"sources": [source("web", weight=0.6, paths=["other.parquet"]), *GOOD["sources"][1:]]},
        {"sources": [GOOD["sources"][1], GOOD["sources"][0], GOOD["sources"][2]]},
    ],
    ids=["tokens", "column", "weight", "name", "paths", "order"],
)
def test_fingerprint_changes_with_every_field(change):
    assert Mixture.from_dict({**GOOD, **change}).fingerprint() != Mixture.from_dict(GOOD).fingerprint()


def test_a_source_with_weight_zero_is_allowed():
    mixture = Mixture.from_dict(weighted(source("web", weight=1), source("code", weight=0)))
    assert [s.weight for s in mixture.sources] == [1.0, 0.0]


def test_a_single_path_string_is_one_path():
    assert MixtureSource(name="web", paths="corpus/web", weight=1).paths == ("corpus/web",)


YAML = """\
# the issue's example
sources:
  - name: web
    paths: [web/]
    weight: 0.6
  - name: code
    paths: [code.parquet, s3://bucket/code/]
    weight: 0.3
    length_column: n_tokens
  - name: math
    paths: [/abs/math.parquet]
    weight: 1e-1
tokens: 2.0e9
"""


def test_yaml_and_json_files_read_the_same_mixture(tmp_path):
    (tmp_path / "mix.yaml").write_text(YAML)
    from_yaml = read_mixture(tmp_path / "mix.yaml")
    (tmp_path / "mix.json").write_text(json.dumps(from_yaml.to_dict()))
    assert read_mixture(tmp_path / "mix.json") == from_yaml
    assert from_yaml.tokens == 2_000_000_000
    assert [s.weight for s in from_yaml.sources] == [0.6, 0.3, 0.1]


def test_relative_paths_resolve_against_the_file_and_uris_stay(tmp_path):
    (tmp_path / "mix.yaml").write_text(YAML)
    sources = read_mixture(tmp_path / "mix.yaml").sources
    assert sources[0].paths == (str(tmp_path / "web"),)
    assert sources[1].paths == (str(tmp_path / "code.parquet"), "s3://bucket/code/")
    assert sources[2].paths == ("/abs/math.parquet",)


def test_sources_are_read_from_the_files_directory_whatever_the_working_directory(tmp_path, monkeypatch):
    folder = tmp_path / "mix"
    folder.mkdir()
    write_parquet(folder / "a.parquet", length=[3, 4])
    write_parquet(folder / "b.parquet", length=[5])
    mixture = weighted(source("a", paths=["a.parquet"], weight=1), source("b", paths=["./b.parquet"], weight=1))
    (folder / "mix.yaml").write_text(json.dumps(mixture))
    monkeypatch.chdir(tmp_path)
    read = read_mixture_lengths(read_mixture(os.path.join("mix", "mix.yaml")))
    assert read.lengths.tolist() == [3, 4, 5]


FILE_ERRORS = {
    "missing file": (None, "no such mixture file"),
    "yaml syntax": ("sources:\n  - name: web\n    paths: [a\n  - name: b\n", "not valid YAML at line 4"),
    "a list": ("- name: web\n", "holds a list, expected a mapping"),
    "empty": ("", "holds a NoneType, expected a mapping"),
    "bad content": (json.dumps(weighted(source(weight=-1))), "source 'web': weight must be a finite number >= 0"),
}


@pytest.mark.parametrize("text, message", FILE_ERRORS.values(), ids=FILE_ERRORS.keys())
def test_a_bad_mixture_file_is_one_line_with_its_path(tmp_path, text, message):
    path = tmp_path / "mix.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as error:
        read_mixture(path)
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.fixture
def three_sources(tmp_path):
    write_parquet(tmp_path / "a.parquet", length=[5, 6, 7])
    write_parquet(tmp_path / "b.parquet", n_tokens=[10, 20], loss=[4, 9])
    (tmp_path / "c").mkdir()
    write_parquet(tmp_path / "c" / "0.parquet", length=[1, 2])
    write_parquet(tmp_path / "c" / "1.parquet", length=[3])
    return tmp_path


def mixture_of(folder, *sources):
    return Mixture.from_dict(weighted(*[{**s, "paths": [str(folder / p) for p in s["paths"]]} for s in sources]))


def test_sources_are_concatenated_in_the_files_order(three_sources):
    mixture = mixture_of(
        three_sources,
        source("c", paths=["c"], weight=1),
        source("a", paths=["a.parquet"], weight=1),
        source("b", paths=["b.parquet"], weight=1, length_column="n_tokens"),
    )
    read = read_mixture_lengths(mixture)
    assert read.lengths.tolist() == [1, 2, 3, 5, 6, 7, 10, 20]
    assert read.offsets.tolist() == [0, 3, 6, 8]
    assert [(s.name, s.offset, s.num_samples) for s in read.sources] == [("c", 0, 3), ("a", 3, 3), ("b", 6, 2)]
    assert [len(s.files) for s in read.sources] == [2, 1, 1]
    assert read.loss_tokens is None


def test_each_source_has_its_own_fingerprint(three_sources):
    first = read_mixture_lengths(mixture_of(three_sources, source("a", paths=["a.parquet"], weight=1)))
    write_parquet(three_sources / "a.parquet", length=[5, 6, 8])
    second = read_mixture_lengths(mixture_of(three_sources, source("a", paths=["a.parquet"], weight=1)))
    assert first.sources[0].fingerprint != second.sources[0].fingerprint
    assert first.fingerprint() != second.fingerprint()


def test_a_loss_tokens_column_in_one_source_gives_the_others_length_minus_one(three_sources):
    mixture = mixture_of(
        three_sources,
        source("a", paths=["a.parquet"], weight=1),
        source("b", paths=["b.parquet"], weight=1, length_column="n_tokens", loss_tokens_column="loss"),
    )
    read = read_mixture_lengths(mixture)
    assert read.loss_tokens.tolist() == [4, 5, 6, 4, 9]


def test_an_empty_source_with_weight_zero_holds_no_samples(three_sources):
    pq.write_table(pa.table({"length": pa.array([], pa.int32())}), three_sources / "empty.parquet")
    mixture = mixture_of(
        three_sources, source("a", paths=["a.parquet"], weight=1), source("e", paths=["empty.parquet"], weight=0)
    )
    read = read_mixture_lengths(mixture)
    assert read.offsets.tolist() == [0, 3, 3]
    assert read.sources[1].num_samples == 0


SOURCE_ERRORS = {
    "missing path": (source("x", paths=["nowhere.parquet"], weight=1), "source 'x': ", "no such file or directory"),
    "column missing in one source": (
        source("b", paths=["b.parquet"], weight=1),
        "source 'b': ",
        "no length column 'length'",
    ),
    "empty with a positive weight": (
        source("e", paths=["empty.parquet"], weight=0.5),
        "source 'e': ",
        "has no samples but weight 0.5",
    ),
}


@pytest.mark.parametrize("bad, prefix, message", SOURCE_ERRORS.values(), ids=SOURCE_ERRORS.keys())
def test_a_bad_source_is_one_line_that_names_it(three_sources, bad, prefix, message):
    pq.write_table(pa.table({"length": pa.array([], pa.int32())}), three_sources / "empty.parquet")
    mixture = mixture_of(three_sources, source("a", paths=["a.parquet"], weight=1), bad)
    with pytest.raises(DatasetError) as error:
        read_mixture_lengths(mixture)
    assert isinstance(error.value, BatchPlanError)
    assert str(error.value).startswith(prefix)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_per_source_columns_override_the_build_columns(three_sources):
    mixture = mixture_of(three_sources, source("b", paths=["b.parquet"], weight=1, loss_tokens_column="loss"))
    read = read_mixture_lengths(mixture, length_column="n_tokens", loss_tokens_column="missing")
    assert read.lengths.tolist() == [10, 20]
    assert read.loss_tokens.tolist() == [4, 9]
    np.testing.assert_array_equal(read.offsets, [0, 2])
