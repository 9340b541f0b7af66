"""Compile the kernels the suite calls into numba's cache before ``pytest -n`` starts its workers.

Without it, on a fresh checkout each worker compiles the kernels its first tests call, and
the workers, starting together, compile the same ones at once. `conftest.pytest_configure`
runs ``python tests/_warm_kernels.py PART PARTS`` for each part side by side: each part builds,
in a directory of its own, small plans that reach the kernels the suite reaches most (pack and
pad, the build's policies, compute balance, a ramp-up and a warmup, directories, validate,
reshard, mixtures and their re-plan, ``plan_batch``), with the dtypes the suite's data gives
them. With a warm cache each part only loads the kernels (a few seconds).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent.parent / "data"


def single_dataset(directory: Path) -> None:
    from batchplan import PlanConfig, build_plan_file, reshard_plan_file, validate_plan
    from batchplan.planning.epochs import build_plan

    dialogues = DATA / "sharegpt_dialogues_cl100k.parquet"
    configs = [
        dict(max_tokens=2048, world_size=2, oversize="split"),
        dict(max_tokens=2048, world_size=3, micro_batches=2, oversize="truncate", epochs=2),
        dict(max_tokens=2048, world_size=2, tokens_per_step=20_000, oversize="drop", drop_last=True),
        dict(max_tokens=2048, world_size=4, mode="pad", oversize="split"),
        dict(max_tokens=4096, world_size=2, oversize="split", hidden_size=1024, balance="compute"),
        dict(max_tokens=2048, world_size=2, micro_batches=4, oversize="split", rampup_start=4096, rampup_tokens=10**6),
        dict(max_tokens=2048, world_size=2, oversize="split", seqlen_warmup_min=128, seqlen_warmup_tokens=10**6),
    ]
    for index, options in enumerate(configs):
        plan = directory / f"plan{index}.arrow"
        build_plan_file(dialogues, plan, PlanConfig(**options))
        validate_plan(plan, dialogues)
    build_plan_file(dialogues, directory / "plan-dir", PlanConfig(**configs[1]), layout="directory")
    reshard_plan_file(directory / "plan1.arrow", directory / "resharded.arrow", world_size=2, from_step=3)
    lengths = np.random.default_rng(0).integers(1, 3000, 3000).astype(np.int32)
    build_plan(lengths, PlanConfig(max_tokens=2048, world_size=2, oversize="split"))


def mixtures(directory: Path) -> None:
    from batchplan import PlanConfig, plan_batch, validate_plan
    from batchplan.operations.build_mixture import build_mixture_plan_file
    from batchplan.operations.replan_mixture import replan_mixture_file

    mixture = DATA / "mixture.yaml"
    configs = [
        dict(max_tokens=8192, world_size=8, micro_batches=4, oversize="split"),
        dict(max_tokens=8192, world_size=8, micro_batches=4, oversize="split", epochs=2, drop_last=True),
        dict(max_tokens=4096, world_size=4, mode="pad", oversize="truncate"),
        dict(max_tokens=8192, world_size=4, oversize="split", seqlen_warmup_min=512, seqlen_warmup_tokens=10**7),
    ]
    for index, options in enumerate(configs):
        plan = directory / f"mixture{index}.arrow"
        build_mixture_plan_file(mixture, plan, PlanConfig(**options))
        validate_plan(plan, mixture=mixture)
    replan_mixture_file(
        directory / "mixture0.arrow", directory / "replanned.arrow", DATA / "mixture-anneal.yaml", from_step=300
    )
    lengths = np.random.default_rng(1).integers(1, 4000, 512).astype(np.int32)
    plan_batch(lengths, 8, 8192)


PARTS = (mixtures, single_dataset)


def main(part: int, parts: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        for index in range(part, len(PARTS), parts):
            PARTS[index](Path(directory))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
