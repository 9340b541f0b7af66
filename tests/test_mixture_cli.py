"""`batchplan build --mixture`, `validate --mixture` and `inspect` of a mixture's plan, end to
end on data/mixture.yaml; bad mixtures and bad combinations are one line and exit 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from batchplan.formats.opening import open_plan
from batchplan_cli.main import app

DATA = Path(__file__).resolve().parent.parent / "data"
DEMO = DATA / "mixture.yaml"
runner = CliRunner()
BUILD = ["--max-tokens", "8192", "--world-size", "8", "--micro-batches", "2", "--oversize", "split", "-q"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "mix.arrow"
    result = runner.invoke(app, ["build", "--mixture", str(DEMO), "-o", str(path), *BUILD])
    assert result.exit_code == 0, result.output
    return path


def test_build_and_validate_a_mixture(built):
    result = runner.invoke(app, ["validate", str(built), "--mixture", str(DEMO)])
    assert result.exit_code == 0, result.output
    assert "OK, every guarantee holds" in result.stdout and "against the mixture's sources" in result.stdout


def test_validate_a_mixture_against_other_sources_fails(built, tmp_path):
    other = tmp_path / "other.yaml"  # qa's file swapped for another of the same folder
    text = DEMO.read_text().replace("squad11_bert384.parquet", "sharegpt_segments_cl100k.parquet")
    other.write_text(text.replace("paths: [", f"paths: [{DATA}/"))
    result = runner.invoke(app, ["validate", str(built), "--mixture", str(other)])
    assert result.exit_code == 1
    assert "fingerprint" in result.stderr


def test_inspect_shows_every_source_and_its_shares(built):
    result = runner.invoke(app, ["inspect", str(built), "--json"])
    assert result.exit_code == 0, result.output
    sources = json.loads(result.stdout)["mixture"]
    assert [s["name"] for s in sources] == ["chat", "qa", "wiki"]
    for source in sources:
        assert source["tokens"] == source["planned_tokens"]
        assert abs(source["mean_share"] - source["weight"]) < 0.005
        assert source["worst_miss"] <= source["worst_miss_bound"]
    table = runner.invoke(app, ["inspect", str(built)])
    assert table.exit_code == 0 and "sources (share of each step" in table.stdout and "wiki" in table.stdout


def test_inspect_shares_agree_with_a_recount(built):
    """The mean share of each source over the regular steps, counted here from the samples."""
    plan = open_plan(built)
    sources = plan.metadata["mixture"]["sources"]
    bounds = np.array([s["offset"] for s in sources] + [plan.num_samples])
    steps = plan.metadata["steps_per_epoch"][0]
    per_step = np.zeros((steps, len(sources)))
    for rank in range(plan.world_size):
        for row in plan.read_rank(0, rank).to_pylist():
            if row["samples"]:
                per_step[row["step"], np.searchsorted(bounds, row["samples"][0], side="right") - 1] += row["tokens"]
    shares = per_step[:-1] / per_step[:-1].sum(axis=1, keepdims=True)
    summary = json.loads(runner.invoke(app, ["inspect", str(built), "--json"]).stdout)["mixture"]
    for index, source in enumerate(summary):
        assert source["mean_share"] == pytest.approx(shares[:, index].mean(), rel=1e-9)
        assert source["worst_miss"] == pytest.approx(np.abs(shares[:, index] - source["weight"]).max(), rel=1e-9)


def test_a_mixture_plan_directory_builds_and_validates(tmp_path):
    out = tmp_path / "mixdir"
    result = runner.invoke(
        app, ["build", "--mixture", str(DEMO), "-o", str(out), "--layout", "directory", "--epochs", "2", *BUILD]
    )
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["validate", str(out), "--mixture", str(DEMO)]).exit_code == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([str(DATA / "squad11_bert384.parquet"), "--mixture", str(DEMO)], "give either DATASET or --mixture"),
        ([], "give either DATASET or --mixture"),
        (["--mixture", "no-such.yaml"], "no-such.yaml"),
        (["--mixture", str(DEMO), "--seqlen-warmup", "512:1T"], "more tokens than the mixture's epoch 0 holds"),
    ],
)
def test_bad_builds_are_one_line(tmp_path, args, message):
    result = runner.invoke(app, ["build", *args, "-o", str(tmp_path / "p.arrow"), *BUILD])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "p.arrow").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sources: []\ntokens: 1M\n", "source"),
        (
            "sources:\n  - {name: a, paths: [x.parquet], weight: 1}\n  - {name: a, paths: [y.parquet], weight: 1}\n"
            "tokens: 1M\n",
            "a",
        ),
        ("sources:\n  - {name: a, paths: [x.parquet], weight: -1}\ntokens: 1M\n", "weight"),
        ("sources:\n  - {name: a, paths: [x.parquet], weight: 1, colour: red}\ntokens: 1M\n", "colour"),
        ("sources: [\n", "line"),
    ],
)
def test_bad_mixture_files_are_one_line(tmp_path, text, message):
    mixture = tmp_path / "mix.yaml"
    mixture.write_text(text)
    result = runner.invoke(app, ["build", "--mixture", str(mixture), "-o", str(tmp_path / "p.arrow"), *BUILD])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
