"""The library names its parameters; the CLI names its options (`batchplan_cli.flags`).

One error, two callers: a library call with a bad value gets a message naming the parameter
(`` `max_tokens` ``), the same value through ``batchplan build`` the option (``--max-tokens``).
No ``--flag`` is written anywhere under batchplan/.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from batchplan import PlanConfig, build_plan_file
from batchplan.errors import BatchPlanError
from batchplan.formats.plan_writer import write_plan
from batchplan.planning.epochs import build_plan
from batchplan_cli.flags import FLAGS, to_cli_words
from batchplan_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
SQUAD = ROOT / "data" / "squad11_bert384.parquet"
runner = CliRunner()


@dataclasses.dataclass(frozen=True)
class SameError:
    """One bad value given both ways, and what each caller reads."""

    library: dict  # keyword arguments of PlanConfig, and of build_plan_file (`BUILD_OPTIONS`)
    cli: list[str]  # the same as ``batchplan build`` arguments
    names: str  # in the library's message
    flags: str  # in the CLI's


SAME_ERRORS = {
    "max_tokens below 1": SameError(
        {"max_tokens": 0},
        ["--max-tokens", "0"],
        "`max_tokens` must be >= 1, got 0",
        "--max-tokens must be >= 1, got 0",
    ),
    "world_size below 1": SameError(
        {"max_tokens": 512, "world_size": 0},
        ["--max-tokens", "512", "--world-size", "0"],
        "`world_size` must be >= 1, got 0",
        "--world-size must be >= 1, got 0",
    ),
    "batch_multiple outside pad": SameError(
        {"max_tokens": 512, "batch_multiple": 4},
        ["--max-tokens", "512", "--batch-multiple", "4"],
        '`batch_multiple` 4 only applies to `mode="pad"` (mode is \'pack\'); drop it or use `mode="pad"`',
        "--batch-multiple 4 only applies to --mode pad (mode is 'pack'); drop it or use --mode pad",
    ),
    "both step sizes": SameError(
        {"max_tokens": 512, "micro_batches": 2, "tokens_per_step": 4096},
        ["--max-tokens", "512", "--micro-batches", "2", "--tokens-per-step", "4096"],
        "`micro_batches` and `tokens_per_step` were both given",
        "--micro-batches and --tokens-per-step were both given",
    ),
    "a ramp-up without a larger step": SameError(
        {"max_tokens": 512, "rampup_start": 512, "rampup_tokens": 1000},
        ["--max-tokens", "512", "--rampup", "512:1k"],
        "pass `tokens_per_step` (the ramp's target) or `micro_batches` above 1",
        "pass --tokens-per-step (the ramp's target) or --micro-batches above 1",
    ),
    "a warmup minimum at the cap": SameError(
        {"max_tokens": 512, "seqlen_warmup_min": 512, "seqlen_warmup_tokens": 1000},
        ["--max-tokens", "512", "--seqlen-warmup", "512:1k"],
        "`seqlen_warmup_min` 512 must be below max_tokens 512",
        "--seqlen-warmup MIN 512 must be below max_tokens 512",
    ),
    "compute balance without a width": SameError(
        {"max_tokens": 512, "balance": "compute"},
        ["--max-tokens", "512", "--balance", "compute"],
        '`balance="compute"` needs the attention term of the cost model; pass `hidden_size` or `attention_coefficient`',
        "--balance compute needs the attention term of the cost model; pass --hidden-size or --attention-coefficient",
    ),
    "oversize samples": SameError(
        {"max_tokens": 64},
        ["--max-tokens", "64"],
        "raise `max_tokens` or set `oversize` to drop, truncate or split",
        "raise --max-tokens or set --oversize to drop, truncate or split",
    ),
    "part of a plan as one file": SameError(
        {"max_tokens": 512, "epochs": 2, "layout": "file", "only_epochs": range(0, 1)},
        ["--max-tokens", "512", "--epochs", "2", "--layout", "file", "--only-epochs", "0:1"],
        '`only_epochs` writes part of a plan directory; use `layout="directory"`',
        "--only-epochs writes part of a plan directory; use --layout directory",
    ),
}
BUILD_OPTIONS = ("layout", "only_epochs")  # build_plan_file's, not PlanConfig's


def library_error(kwargs: dict, output: Path) -> str:
    options = {key: kwargs[key] for key in BUILD_OPTIONS if key in kwargs}
    config = {key: value for key, value in kwargs.items() if key not in BUILD_OPTIONS}
    with pytest.raises(BatchPlanError) as raised:
        build_plan_file(SQUAD, output, PlanConfig(**config), **options)
    return str(raised.value)


@pytest.mark.parametrize("case", list(SAME_ERRORS))
def test_a_library_call_with_a_bad_value_names_the_parameter(tmp_path, case):
    same = SAME_ERRORS[case]
    message = library_error(same.library, tmp_path / "plan.arrow")
    assert same.names in message
    assert not re.search(r"(?<![\w-])--[a-z]", message), message


@pytest.mark.parametrize("case", list(SAME_ERRORS))
def test_the_same_value_through_the_cli_names_the_flag(tmp_path, case):
    same = SAME_ERRORS[case]
    result = runner.invoke(app, ["build", str(SQUAD), "-o", str(tmp_path / "plan.arrow"), *same.cli, "-q"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert same.flags in lines[0]
    assert lines[0] == "error: " + to_cli_words(library_error(same.library, tmp_path / "plan.arrow"))
    assert not any(f"`{name}" in lines[0] for name in FLAGS), lines[0]


def test_a_violation_printed_by_validate_names_the_option(tmp_path):
    """``validate --mixture`` of a single dataset's plan: the library's violation says
    `` `dataset` ``, the command's ``FAIL`` line ``--dataset``."""
    from batchplan.formats.opening import open_plan
    from batchplan.operations.validate import validate_plan

    plan = tmp_path / "plan.arrow"
    write_plan(build_plan(np.full(20, 10, np.int32), PlanConfig(max_tokens=64)), plan)
    mixture = tmp_path / "mixture.yaml"
    mixture.write_text("sources: []\n")
    violations = validate_plan(open_plan(plan), None, mixture=mixture)
    assert [v.message for v in violations] == ["the plan was built from one dataset, not a mixture; pass `dataset`"]
    result = runner.invoke(app, ["validate", str(plan), "--mixture", str(mixture)])
    assert result.exit_code == 1
    assert "FAIL [dataset] the plan was built from one dataset, not a mixture; pass --dataset" in result.stderr


@pytest.mark.parametrize(
    ("library", "cli"),
    [
        ("raise `max_tokens`", "raise --max-tokens"),
        ("use `oversize=\"drop\"` or `mode='pad'`", "use --oversize drop or --mode pad"),
        ("rebuild it with `epochs=3` or more", "rebuild it with --epochs 3 or more"),
        ("pass `drop_empty=True`", "pass --drop-empty"),
        ("lower `rampup_start`", "lower --rampup START"),
        (
            "`batchplan.reshard_plan_file('p.arrow', 'NEW.arrow', world_size=3)`",
            "`batchplan.reshard_plan_file('p.arrow', 'NEW.arrow', world_size=3)`",
        ),
        ("`max_steps` and world_size 2 x max_tokens 8", "`max_steps` and world_size 2 x max_tokens 8"),
    ],
)
def test_only_backquoted_parameters_of_the_table_become_options(library, cli):
    assert to_cli_words(library) == cli


def test_every_option_of_the_table_is_an_option_of_a_command_and_every_config_field_has_one():
    commands = typer.main.get_command(app).commands.values()
    options = {opt for command in commands for param in command.params for opt in param.opts}
    assert {flag.split()[0] for flag in FLAGS.values()} <= options
    assert {field.name for field in dataclasses.fields(PlanConfig)} <= set(FLAGS)


def test_no_flag_is_written_under_batchplan():
    """The CLI's words live in cli/ (batchplan_cli): messages, docstrings and comments under
    batchplan/ name parameters."""
    flag = re.compile(r"(?<![\w-])--[a-z][\w-]*")
    found = []
    for path in sorted((ROOT / "batchplan").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if flag.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
