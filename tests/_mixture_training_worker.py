"""What each process of tests/test_mixture_training.py runs (2 real processes, gloo on CPU).

A three-source mixture (one source repeated, one cut, one with a sample split in two) is
saved as three ``datasets`` folders and planned for 2 ranks, 2 epochs, 2 micro-batches per
step. Every path trains the tiny Llama of `_integration_worker` (float32, SGD) on
``MixtureDataset(plan, {name: datasets.load_from_disk(folder)})`` and saves, per
micro-batch, what it trained (`observe`: the record's key, its source, the collated token
ids) and, per step, each source's loss and loss tokens over both ranks (`SourceLosses`).
Each path runs stopped inside epoch 2 with its own checkpoint, then resumed from it in fresh
objects; the plain loop, also run in full, is the reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _integration_worker import LR, VOCAB_SIZE, _step_inside_last_epoch, init_group, key, make_model, params

from batchplan.runtime import PackCollator, PlanDataset, PlanSampler, SourceLosses, token_loss_sum
from batchplan.runtime.mixture import MixtureDataset

# name, rows, weight: "web" is repeated (about 1.5 passes), "code" is cut (about 0.25 of a pass).
SOURCES = (("web", 30, 0.5), ("code", 80, 0.2), ("math", 40, 0.3))
TOKENS = 3_000


def ids_of(source: int, row: int, length: int) -> list[int]:
    """The token ids of a source's row: a function of (source, row), so a batch shows its rows."""
    return [(source * 31 + row * 7 + j) % VOCAB_SIZE for j in range(length)]


def write_mixture(directory: Path) -> dict:
    """The sources as ``datasets`` folders, the mixture file and its plan; returns their paths."""
    import datasets

    from batchplan import PlanConfig
    from batchplan.operations.build_mixture import build_mixture_plan_file

    rng = np.random.default_rng(11)
    folders, spec = {}, {"sources": [], "tokens": TOKENS}
    for index, (name, rows, weight) in enumerate(SOURCES):
        lengths = rng.integers(2, 60, rows)
        if index == 2:
            lengths[5] = 100  # longer than max_tokens: split into two spans
        ids = [ids_of(index, row, int(n)) for row, n in enumerate(lengths)]
        folders[name] = str(directory / name)
        datasets.Dataset.from_dict({"input_ids": ids}).save_to_disk(folders[name])
        spec["sources"].append({"name": name, "paths": [folders[name]], "weight": weight})
    (directory / "mix.json").write_text(json.dumps(spec))
    plan = directory / "mix.arrow"
    config = PlanConfig(max_tokens=64, world_size=2, micro_batches=2, epochs=2, oversize="split", seed=2)
    build_mixture_plan_file(directory / "mix.json", plan, config)
    return {"plan": str(plan), "sources": folders}


def mixture_dataset(mixture: dict) -> MixtureDataset:
    import datasets

    sources = {name: datasets.load_from_disk(folder) for name, folder in mixture["sources"].items()}
    return MixtureDataset(mixture["plan"], sources)


def observe(batch) -> dict:
    """What a micro-batch trained: its key (epoch, step, micro, samples, starts), source and ids."""
    record = batch.record
    ids = batch["input_ids"].reshape(-1).tolist() if record.indices else []
    return {"key": key(record), "source": record.source, "ids": ids}


def reduced(losses: SourceLosses) -> dict[str, tuple[float, int]]:
    return {name: (loss.loss_sum, loss.loss_tokens) for name, loss in losses.reduce().items()}


def run_paths(rank: int, paths: list[str], mixture: dict, out_dir: str) -> None:
    """Each of ``paths``' full, stopped and resumed runs; a path that raises saves its traceback."""
    init_group()
    results = {"plain": _guarded(plain_runs, mixture, os.path.join(out_dir, "plain"))}
    for path in paths:
        results[path] = _guarded(RUNS[path], mixture, os.path.join(out_dir, path))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()


def _guarded(runs, mixture: dict, out: str) -> dict:
    try:
        return runs(mixture, out)
    except Exception:  # noqa: BLE001 - the test reports it for this path
        return {"error": traceback.format_exc()}


def _first_rest(loop, mixture: dict, out: str, **options) -> dict:
    """A run stopped inside epoch 2 with the path's own checkpoint, and its resumption in fresh
    objects: together, an uninterrupted run's micro-batches and parameters."""
    stop = _step_inside_last_epoch(mixture["plan"])
    first = loop(mixture, out, stop=stop, **options)
    rest = loop(mixture, out, resume=True, **options)
    return {"first": first, "rest": rest, "stop": stop}


# -- the plain loop, and torchdata's StatefulDataLoader -------------------------------------------


def plain_runs(mixture: dict, out: str) -> dict:
    """The reference: the plain loop in full, and stopped and resumed."""
    return {"full": plain_loop(mixture, out + "-full", workers=2), **_first_rest(plain_loop, mixture, out, workers=2)}


def plain_loop(
    mixture: dict, out: str, *, stop: int | None = None, resume: bool = False, workers: int = 0, stateful: bool = False
) -> dict:
    """DDP over a DataLoader (or a StatefulDataLoader); checkpoints the model with the sampler's
    ``state_dict(after=mb)`` (or the loader's own ``state_dict``)."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    sampler = PlanSampler(mixture["plan"])
    options = dict(batch_sampler=sampler, collate_fn=PackCollator(), num_workers=workers)
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(PlanDataset(mixture_dataset(mixture)), **options)
    else:
        loader = DataLoader(PlanDataset(mixture_dataset(mixture)), **options)
    model = make_model()
    checkpoint = Path(out, f"checkpoint{dist.get_rank()}.pt")
    if resume:
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        (loader if stateful else sampler).load_state_dict(saved["data"])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, seen, by_step = SourceLosses(sampler), [], {}
    while not sampler.finished:
        for batch in loader:
            mb = batch.record
            with contextlib.nullcontext() if mb.is_last else ddp.no_sync():
                loss_sum = token_loss_sum(ddp(**batch), batch)
                (loss_sum * mb.loss_scale()).backward()
            losses.add(loss_sum, mb)
            seen.append(observe(batch))
            if not mb.is_last:
                continue
            optimizer.step()
            optimizer.zero_grad()
            by_step[mb.step] = reduced(losses)
            if mb.step + 1 == stop:
                Path(out).mkdir(parents=True, exist_ok=True)
                data = loader.state_dict() if stateful else sampler.state_dict(after=mb)
                torch.save({"model": model.state_dict(), "data": data}, checkpoint)
                return {"seen": seen, "losses": by_step}
    return {"seen": seen, "losses": by_step, "params": params(model)}


def stateful_runs(mixture: dict, out: str) -> dict:
    return {
        workers: _first_rest(plain_loop, mixture, f"{out}-{workers}", workers=workers, stateful=True)
        for workers in (0, 2)
    }


# -- Accelerate ------------------------------------------------------------------------------------


def accelerate_runs(mixture: dict, out: str) -> dict:
    return _first_rest(accelerate_loop, mixture, out)


def accelerate_loop(mixture: dict, out: str, *, stop: int | None = None, resume: bool = False) -> dict:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from batchplan.integrations.accelerate import prepare_plan_loader

    accelerator = Accelerator(cpu=True)
    sampler = PlanSampler(mixture["plan"])
    loader = DataLoader(
        PlanDataset(mixture_dataset(mixture)),
        batch_sampler=sampler,
        collate_fn=PackCollator(),
        num_workers=2,
        multiprocessing_context="fork",
    )
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = prepare_plan_loader(accelerator, loader)
    accelerator.register_for_checkpointing(loader)
    if resume:
        accelerator.load_state(out)
    losses, seen, by_step = SourceLosses(sampler), [], {}
    while not sampler.finished:
        for batch in loader:
            mb = batch.record
            with contextlib.nullcontext() if mb.is_last else accelerator.no_sync(model):
                loss_sum = token_loss_sum(model(**batch), batch)
                accelerator.backward(loss_sum * mb.loss_scale())
            losses.add(loss_sum, mb)
            seen.append(observe(batch))
            if mb.is_last:
                optimizer.step()
                optimizer.zero_grad()
                by_step[mb.step] = reduced(losses)
                if mb.step + 1 == stop:
                    accelerator.save_state(out)
                    return {"seen": seen, "losses": by_step}
    return {"seen": seen, "losses": by_step, "params": params(model)}


# -- Hugging Face Trainer ------------------------------------------------------------------------------


def trainer_runs(mixture: dict, out: str) -> dict:
    return _first_rest(trainer_loop, mixture, out)


def trainer_loop(mixture: dict, out: str, *, stop: int | None = None, resume: bool = False) -> dict:
    """`PlanTrainer`, logging every step (its logs hold ``loss/<source>``); checkpoint at ``stop``."""
    import transformers

    from batchplan.integrations.transformers import PlanTrainer

    class Logged(PlanTrainer):
        seen: list

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.seen.extend(observe(batch) for batch in inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    model = make_model()
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=stop or -1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="steps" if stop else "no",
        save_steps=stop or 500,
        seed=0,
    )
    trainer = Logged(
        model=model,
        args=args,
        train_dataset=mixture_dataset(mixture),
        plan=mixture["plan"],
        optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
    )
    trainer.seen = []
    trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{_stop_of(out)}" if resume else None)
    logs = {
        entry["step"] - 1: {k: v for k, v in entry.items() if k.startswith("loss/")}
        for entry in trainer.state.log_history
        if "loss" in entry
    }
    result = {"seen": trainer.seen, "logs": logs, "global_step": trainer.state.global_step}
    return result if stop else {**result, "params": params(trainer.model)}


def _stop_of(out: str) -> int:
    folders = [p.name for p in Path(out).iterdir() if p.name.startswith("checkpoint-")]
    return int(folders[0].split("-")[1])


# -- Lightning -----------------------------------------------------------------------------------------


def lightning_runs(mixture: dict, out: str) -> dict:
    return _first_rest(lightning_loop, mixture, out)


def lightning_loop(mixture: dict, out: str, *, stop: int | None = None, resume: bool = False) -> dict:
    """Automatic optimisation (``accumulate_grad_batches=2``, the plan's micro-batches) with
    `plan_loss`; `SourceLosses` in ``training_step``; ``ModelCheckpoint`` at ``stop``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from batchplan.integrations.lightning import PlanDataModule, plan_loss

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()
            self.losses = SourceLosses(mixture["plan"])
            self.seen, self.by_step = [], {}

        def training_step(self, batch, batch_idx):
            record = batch.record
            loss_sum = token_loss_sum(self.model(**batch), batch)
            self.losses.add(loss_sum, record)
            self.seen.append(observe(batch))
            if record.is_last:
                self.by_step[record.step] = reduced(self.losses)
            return plan_loss(loss_sum, batch, self.trainer)

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=LR)

    callbacks = (
        [
            ModelCheckpoint(
                dirpath=out, filename="resume", every_n_train_steps=stop, save_top_k=-1, enable_version_counter=False
            )
        ]
        if stop
        else []
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        num_nodes=1,
        strategy=DDPStrategy(process_group_backend="gloo"),
        use_distributed_sampler=False,
        max_epochs=2,
        max_steps=stop or -1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(stop),
        callbacks=callbacks,
        num_sanity_val_steps=0,
        default_root_dir=out,
        accumulate_grad_batches=2,
        reload_dataloaders_every_n_epochs=1,
    )
    module = LM()
    trainer.fit(
        module,
        datamodule=PlanDataModule(mixture["plan"], mixture_dataset(mixture), num_workers=2),
        ckpt_path=f"{out}/resume.ckpt" if resume else None,
    )
    result = {"seen": module.seen, "losses": module.by_step, "global_step": trainer.global_step}
    return result if stop else {**result, "params": params(module.model)}


RUNS = {"stateful": stateful_runs, "accelerate": accelerate_runs, "trainer": trainer_runs, "lightning": lightning_runs}
