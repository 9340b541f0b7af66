"""Train a tiny GPT with DDP on CPU, replaying a batchplan plan exactly.

    .venv/bin/torchrun --nproc_per_node 2 examples/train_ddp.py --max-steps 20           # ~12 s on 2 cores
    .venv/bin/torchrun --nproc_per_node 2 examples/train_ddp.py --max-steps 40 --resume  # continue from step 20

Token ids are random, with the real lengths of data/sharegpt_dialogues_cl100k.parquet
(9,457 conversations, median 977 tokens, longest 199,994: split into 2,048-token
pieces by the plan). Rank 0 builds the plan on first use. What it shows:

- `PlanSampler` as the loader's ``batch_sampler`` + `PackCollator`/`PadCollator`;
  each batch carries its plan record (``batch.record``), so one loop over the loader
  is the whole training loop, and each pass over it is the next epoch;
- exact token-mean loss: ``token_loss_sum * world_size / step_loss_tokens``
  on every micro-batch, ``no_sync`` except on the step's last one;
- learning rate by tokens (`token_lr_scheduler`), a checkpoint with every rank's
  sampler state, and resume.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from batchplan.runtime import (
    PackCollator,
    PadCollator,
    PlanDataset,
    PlanSampler,
    count_loss_tokens,
    read_step_tokens,
    token_loss_sum,
    token_lr_scheduler,
)
from batchplan.toy import RandomTokens, TinyGPT

ROOT = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "sharegpt_dialogues_cl100k.parquet")
    parser.add_argument("--plan", type=Path, default=Path("example-plan.arrow"), help="built by rank 0 if missing")
    parser.add_argument("--mode", choices=["pack", "pad"], default="pack")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank per step")
    parser.add_argument("--max-steps", type=int, default=80, help="stop after this global step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", type=Path, default=Path("example-checkpoint.pt"))
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not args.plan.exists():
        build_plan(args, world_size)
    dist.barrier()

    sampler = PlanSampler(args.plan)  # rank and world size from torch.distributed
    lengths = pq.read_table(args.data, columns=["length"]).column("length").to_numpy()
    dataset = PlanDataset(RandomTokens(lengths, VOCAB_SIZE))  # PlanDataset: the plan splits long samples
    collator = PackCollator() if sampler.mode == "pack" else PadCollator()
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collator, num_workers=1)

    torch.manual_seed(0)
    model = TinyGPT(VOCAB_SIZE, d_model=64, num_heads=4, num_layers=2, max_positions=sampler.max_tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # The schedule spans the whole plan (--max-steps only stops the demo early).
    before, step_tokens = read_step_tokens(sampler)
    total_tokens = int(before[-1] + step_tokens[-1])
    scheduler = token_lr_scheduler(optimizer, sampler, warmup_tokens=total_tokens // 100, decay="cosine")
    last_step = min(args.max_steps, sampler.num_steps)
    if args.resume:
        load_checkpoint(args.checkpoint, model, optimizer, scheduler, sampler, rank)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters

    step = scheduler.last_epoch  # optimizer steps done so far
    loss_sum = torch.zeros((), dtype=torch.float64)
    started = time.perf_counter()
    while not sampler.finished:  # each pass over the loader walks the plan's next epoch
        for batch in loader:
            mb = batch.record  # the micro-batch's plan record
            if count_loss_tokens(batch) != mb.loss_tokens:
                raise RuntimeError(f"batch has {count_loss_tokens(batch)} loss tokens, plan says {mb.loss_tokens}")
            with contextlib.nullcontext() if mb.is_last else ddp.no_sync():
                micro_loss = token_loss_sum(ddp(**batch), batch)
                (micro_loss * mb.loss_scale()).backward()
            loss_sum += micro_loss.detach()
            if not mb.is_last:
                continue
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            log_step(step, mb, loss_sum, scheduler, started, rank)
            loss_sum.zero_()
            if step % args.checkpoint_every == 0 or step == last_step:
                save_checkpoint(args.checkpoint, model, optimizer, scheduler, sampler.state_dict(after=mb), rank)
            if step == last_step:
                dist.destroy_process_group()
                return
    dist.destroy_process_group()


def build_plan(args: argparse.Namespace, world_size: int) -> None:
    import batchplan  # building plans is not the runtime's job (it loads numba)

    config = batchplan.PlanConfig(
        max_tokens=args.max_tokens,
        mode=args.mode,
        world_size=world_size,
        micro_batches=args.micro_batches,
        oversize="split",
    )
    batchplan.build_plan_file(args.data, args.plan, config)
    print(f"built {args.plan} for world_size {world_size}", flush=True)


def log_step(step: int, mb, loss_sum: torch.Tensor, scheduler, started: float, rank: int) -> None:
    total = loss_sum.clone()
    dist.all_reduce(total)  # every rank's loss sum: the step's exact mean loss below
    if rank == 0 and (step % 10 == 0 or step == 1):
        seconds = time.perf_counter() - started
        print(
            f"step {step:4d}  epoch {mb.epoch}  loss {total.item() / max(mb.step_loss_tokens, 1):.4f}  "
            f"lr {scheduler.get_last_lr()[0]:.2e}  tokens {mb.tokens_before_step + mb.step_tokens:,}  "
            f"({seconds:.0f} s)",
            flush=True,
        )


def save_checkpoint(path: Path, model, optimizer, scheduler, sampler_state: dict, rank: int) -> None:
    # The loader's worker has drawn ahead: the state is taken after the last micro-batch trained.
    samplers = [None] * dist.get_world_size()
    dist.all_gather_object(samplers, sampler_state)  # each rank's position is its own
    if rank == 0:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "samplers": samplers,
        }
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        print(
            f"saved {path} at step {scheduler.last_epoch}: rank 0 at epoch {samplers[0]['epoch']}, "
            f"micro-batch {samplers[0]['position']}",
            flush=True,
        )
    dist.barrier()


def load_checkpoint(path: Path, model, optimizer, scheduler, sampler: PlanSampler, rank: int) -> None:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["samplers"][rank])  # checked: same plan, rank and world size
    if rank == 0:
        print(f"resumed from {path} at step {scheduler.last_epoch}", flush=True)


if __name__ == "__main__":
    main()
