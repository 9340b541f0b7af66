"""What each process of the real DDP test runs (gloo on CPU, spawned by `_spawn.launch`).

One spawn runs every check and saves its results to ``rank{r}.pt``; the tests in
test_runtime_ddp.py compare them. Checks: the micro-batches each rank replays
(with a collective per micro-batch, so unequal counts would hang, not pass),
gradient equivalence with a single-process reference, and resume from a
mid-epoch state dict with ``num_workers=2`` loaders.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch
import torch.distributed as dist
from _ddp_plans import make_dataset, make_model, process_group
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from batchplan.formats.opening import open_plan
from batchplan.runtime import (
    PackCollator,
    PadCollator,
    PlanDataset,
    PlanSampler,
    SpanItem,
    count_loss_tokens,
    token_loss_sum,
    token_lr_scheduler,
)

RESUME_AFTER_STEPS = 2


def run_checks(rank: int, world_size: int, port: int, plans: dict[str, str], out_dir: str) -> None:
    with process_group(rank, world_size, port):
        results = {
            "coverage": replay_epochs(plans["pack"]),
            "grads": {
                "pack": gradient_check(plans["pack"], PackCollator(), "documents"),
                "pack-mask": gradient_check(plans["pack"], PackCollator(), "mask"),
                "pad": gradient_check(plans["pad"], PadCollator(), "documents"),
                "pad-mask": gradient_check(plans["pad"], PadCollator(), "mask"),
                "single": gradient_check(plans["single"], PackCollator(), "documents", lengths=[20]),
            },
            "resume": resume_check(plans["pack"]),
        }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def replay_epochs(path: str) -> list[tuple]:
    """Every micro-batch this rank runs, each epoch, in lockstep with the other rank.

    The loop never calls set_epoch: each pass over the loader walks the next epoch."""
    sampler = PlanSampler(path)
    loader = DataLoader(PlanDataset(make_dataset()), batch_sampler=sampler, collate_fn=PackCollator())
    seen = []
    for _ in range(sampler.num_epochs):
        for batch in loader:
            mb = batch.record
            # A collective per micro-batch: both ranks must be at the same (step, micro).
            here = torch.tensor([mb.step, mb.micro, mb.num_micro], dtype=torch.int64)
            total = here.clone()
            dist.all_reduce(total)
            if not torch.equal(total, here * dist.get_world_size()):
                raise AssertionError(f"ranks out of lockstep at {here.tolist()}: sum {total.tolist()}")
            seen.append(
                (
                    mb.epoch,
                    mb.step,
                    mb.micro,
                    mb.num_micro,
                    tuple(mb.indices),
                    tuple(mb.starts or ()),
                    tuple(mb.lengths or ()),
                    int(batch["input_ids"].shape[1]),
                    count_loss_tokens(batch),
                    mb.loss_tokens,
                )
            )
    return seen


def gradient_check(path: str, collator, attention: str, lengths=None) -> dict:
    """DDP gradients after step 0 (several micro-batches per rank) and, on rank 0, the reference."""
    dataset = make_dataset(None if lengths is None else torch.tensor(lengths).numpy())
    sampler = PlanSampler(path)
    model = make_model(seed=1, attention=attention)
    ddp = DistributedDataParallel(model)
    loader = DataLoader(PlanDataset(dataset), batch_sampler=sampler, collate_fn=collator)
    count = 0
    for batch in loader:
        mb = batch.record
        with contextlib.nullcontext() if mb.is_last else ddp.no_sync():
            (token_loss_sum(ddp(**batch), batch) * mb.loss_scale()).backward()
        count += 1
        if mb.is_last:
            break
    result = {
        "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()},
        "num_micro": count,
    }
    if dist.get_rank() == 0:
        result["reference"], result["reference_loss_tokens"] = reference_gradients(path, dataset, attention)
    return result


def reference_gradients(path: str, dataset, attention: str, step: int = 0):
    """One process, no DDP: mean token loss over all of step ``step``'s entries, each alone."""
    rows = [row for row in open_plan(path).read_epoch(0).to_pylist() if row["step"] == step]
    model = make_model(seed=1, attention=attention)
    loss_sum = torch.zeros((), dtype=torch.float64)
    counted = 0
    for row in rows:
        for j, sample in enumerate(row["samples"]):
            item = dataset[sample]
            if "starts" in row:
                item = SpanItem(item, row["starts"][j], row["lengths"][j])
            batch = PackCollator()([item])
            loss_sum = loss_sum + token_loss_sum(model(**batch), batch)
            counted += count_loss_tokens(batch)
    (loss_sum / rows[0]["step_loss_tokens"]).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return grads, (counted, rows[0]["step_loss_tokens"])


def resume_check(path: str) -> dict:
    """Uninterrupted run vs. stop after a few steps, checkpoint, and resume in fresh objects."""
    full = train(path, num_workers=0)
    first = train(path, num_workers=2, stop_after=RESUME_AFTER_STEPS)
    buffer = io.BytesIO()
    torch.save(first["checkpoint"], buffer)  # a real round trip: the state must serialise
    buffer.seek(0)
    rest = train(path, num_workers=2, checkpoint=torch.load(buffer, weights_only=True))
    return {"full": full, "first": first["seen"], "rest": rest, "sampler_state": first["checkpoint"]["sampler"]}


def train(path: str, *, num_workers: int, stop_after: int | None = None, checkpoint: dict | None = None) -> dict:
    sampler = PlanSampler(path)
    model = make_model(seed=2)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = token_lr_scheduler(optimizer, sampler, warmup_tokens=300)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        sampler.load_state_dict(checkpoint["sampler"])
    # These processes were spawned, so spawn is their default start method and each loader
    # worker would re-import torch (seconds); torchrun-started ranks default to fork anyway.
    loader = DataLoader(
        PlanDataset(make_dataset()),
        batch_sampler=sampler,
        collate_fn=PackCollator(),
        num_workers=num_workers,
        multiprocessing_context="fork" if num_workers else None,
    )
    seen, steps = [], 0
    while not sampler.finished:
        for batch in loader:
            mb = batch.record
            if batch["input_ids"].shape[1] != max(mb.tokens, 1):
                raise AssertionError(f"batch of {batch['input_ids'].shape[1]} tokens for record {mb}")
            with contextlib.nullcontext() if mb.is_last else ddp.no_sync():
                (token_loss_sum(ddp(**batch), batch) * mb.loss_scale()).backward()
            seen.append((mb.epoch, mb.step, mb.micro, tuple(mb.indices)))
            if mb.is_last:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                steps += 1
                if steps == stop_after:  # the loader's workers have drawn ahead: save the state after mb
                    return {"seen": seen, "checkpoint": _checkpoint(model, optimizer, scheduler, sampler, mb)}
    return {"seen": seen, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _checkpoint(model, optimizer, scheduler, sampler, last) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(after=last),
    }
