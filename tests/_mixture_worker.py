"""A rank replaying a mixture's plan through MixtureDataset, for tests/test_runtime_mixture.py
(spawned processes import this module by name)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def code_of(source: int, row: int) -> int:
    """The token id every token of a source's row carries: the item says where it came from."""
    return source * 1_000_000 + row


def source_datasets(mixture: dict) -> dict[str, list[dict]]:
    """One list of items per source, ``input_ids`` of the row's length, every id its `code_of`."""
    datasets = {}
    for index, source in enumerate(mixture["sources"]):
        lengths = np.load(source["lengths"])
        datasets[source["name"]] = [{"input_ids": [code_of(index, row)] * int(n)} for row, n in enumerate(lengths)]
    return datasets


def replay(rank: int, plan: str, mixture_json: str, stop_after: int, out_dir: str) -> None:
    """Replay this rank's rows: ``stop_after`` micro-batches, a state saved, then a fresh sampler
    and loader from that state to the end. Saves per micro-batch (epoch, step, micro, source,
    the samples' (source, row) from the record, and the codes the collated tokens carry)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from batchplan.runtime import PackCollator, PlanDataset, PlanSampler
    from batchplan.runtime.mixture import MixtureDataset

    dist.init_process_group("gloo")
    datasets = source_datasets(json.loads(Path(mixture_json).read_text()))
    dataset = PlanDataset(MixtureDataset(plan, datasets))

    def loader(sampler):
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=PackCollator(), num_workers=0)

    seen, state = [], None
    sampler = PlanSampler(plan)
    for batch in loader(sampler):
        seen.append(_row(batch, dataset.dataset))
        if len(seen) == stop_after:
            state = sampler.state_dict(after=batch.record)
            break
    resumed = PlanSampler(plan)
    resumed.load_state_dict(state)
    while not resumed.finished:
        for batch in loader(resumed):
            seen.append(_row(batch, dataset.dataset))
    import torch

    torch.save(seen, Path(out_dir, f"rank{rank}.pt"))
    dist.barrier()


def _row(batch, mixture) -> dict:
    record = batch.record
    ids = batch["input_ids"].reshape(-1).tolist()
    starts = batch["cu_seq_lens"].tolist()[:-1]
    codes = [ids[start] for start in starts] if record.indices else []
    return {
        "epoch": record.epoch,
        "step": record.step,
        "micro": record.micro,
        "source": record.source,
        "located": [list(mixture.locate(i)) for i in record.indices],
        "codes": codes,
        "loss_tokens": record.loss_tokens,
    }
