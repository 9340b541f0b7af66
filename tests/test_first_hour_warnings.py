"""The paths batchplan owns raise no deprecation warning: building and inspecting a plan, and one
epoch of the README's loop (sampler, dataset, collator, loss, LR by tokens, state round trip),
run with ``DeprecationWarning`` and ``FutureWarning`` as errors. The Hugging Face ``Trainer``
path is checked the same way in tests/test_integrations_transformers.py.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
from typer.testing import CliRunner

from batchplan_cli.main import app

torch = pytest.importorskip("torch")


@contextlib.contextmanager
def deprecations_are_errors() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        yield


def test_build_and_inspect_raise_no_deprecation_warning(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "lengths.parquet"
    pq.write_table(pa.table({"length": np.random.default_rng(0).integers(1, 300, 500)}), data)
    plan = tmp_path / "plan.arrow"
    with deprecations_are_errors():
        runner = CliRunner()
        built = runner.invoke(
            app,
            [
                "build",
                str(data),
                "-o",
                str(plan),
                "--max-tokens",
                "512",
                "--world-size",
                "2",
                "--hidden-size",
                "64",
                "--epochs",
                "2",
            ],
        )
        assert built.exit_code == 0, built.output
        for args in (["inspect", str(plan)], ["inspect", str(plan), "--json"], ["validate", str(plan)]):
            result = runner.invoke(app, args)
            assert result.exit_code == 0 and not isinstance(result.exception, Warning), result.output


def test_the_readme_loop_on_one_rank_raises_no_deprecation_warning(tmp_path):
    from batchplan.config import PlanConfig
    from batchplan.formats.plan_writer import write_plan
    from batchplan.planning.epochs import build_plan
    from batchplan.runtime import PackCollator, PlanDataset, PlanSampler, token_loss_sum, token_lr_scheduler
    from batchplan.toy import RandomTokens, TinyGPT

    lengths = np.random.default_rng(1).integers(1, 200, 120).astype(np.int32)
    plan = tmp_path / "plan.arrow"
    with deprecations_are_errors():
        write_plan(build_plan(lengths, PlanConfig(max_tokens=256, world_size=1, micro_batches=2)), plan)
        sampler = PlanSampler(plan, rank=0, world_size=1)
        loader = torch.utils.data.DataLoader(
            PlanDataset(RandomTokens(lengths, 64)), batch_sampler=sampler, collate_fn=PackCollator()
        )
        model = TinyGPT(64, d_model=16, num_heads=2, num_layers=1, max_positions=256)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = token_lr_scheduler(optimizer, sampler, warmup_tokens=1_000)
        for batch in loader:
            mb = batch.record
            (token_loss_sum(model(**batch), batch) * mb.loss_scale()).backward()
            if mb.is_last:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()  # noqa: E702
                state = sampler.state_dict(after=mb)
        resumed = PlanSampler(plan, rank=0, world_size=1)
        resumed.load_state_dict(state)
        assert resumed.finished
