"""Lightning ``LightningDataModule`` that replays a plan exactly: `PlanDataModule`.

``trainer.fit(module, datamodule=PlanDataModule(plan="plan.arrow", dataset=ds))``
trains on the plan's micro-batches, steps and epochs, and nothing else:

- ``train_dataloader()`` is ``DataLoader(PlanDataset(dataset), batch_sampler=sampler,
  collate_fn=...)``; pass ``use_distributed_sampler=False`` to ``Trainer`` (Lightning
  would otherwise try to rebuild the batch sampler around a ``DistributedSampler``:
  the data module raises a `ConfigError` first). The loader's length is the whole
  epoch's micro-batches, which is what Lightning counts batches against, also after
  a resume inside an epoch.
- Epochs follow from the sampler (Lightning's ``set_epoch`` does not reach a batch
  sampler): each new iteration walks the next epoch, so nothing replays, also when
  Lightning calls ``train_dataloader()`` again (``reload_dataloaders_every_n_epochs``,
  required when the plan's epochs differ in micro-batches).
- Each batch is a `PlanBatch`: ``batch.record`` in ``training_step``. As each batch
  is about to be trained (``on_after_batch_transfer``, main process) its record's
  step is checked against ``trainer.global_step``: a loader or loop that skips or
  replays data raises `PlanMismatchError`.
- Checkpoints: the data module's ``state_dict`` holds the plan's identity and
  ``trainer.global_step``; loading it puts every rank's sampler right before that
  step (`PlanSampler.state_at_step`). A step count, not a sampler position, because
  Lightning writes the checkpoint on rank 0 only (one state must serve all ranks),
  because it is exact whatever the loader prefetched (``num_workers``, Lightning's
  own one-batch look-ahead), and because the model and optimizer in the checkpoint
  are those after ``global_step`` steps: a step's micro-batches whose gradients were
  not yet applied are trained again, as they must be. Save on step boundaries
  (``ModelCheckpoint(every_n_train_steps=...)``, ``trainer.save_checkpoint`` after
  ``fit``).

Two ways to optimise, both exact against the plain loop (``tests/test_integrations_lightning.py``):

(a) **Automatic optimisation**, for plans built with ``micro_batches=M``:
    ``Trainer(accumulate_grad_batches=M)`` and ``training_step`` returns
    ``plan_loss(token_loss_sum(output, batch), batch, self.trainer)``. Lightning
    divides a returned loss by ``accumulate_grad_batches``; `plan_loss` multiplies
    it back, so gradients are those of the step's token mean, as in the plain loop.
    Lightning steps every M batches counted from the epoch start, so the plan must
    have exactly M micro-batches in every step (a ``tokens_per_step`` plan is a
    `ConfigError`).

(b) **Manual optimisation**, for any plan (steps of varying size):
    ``automatic_optimization = False`` and::

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            if plan_backward(self, token_loss_sum(self.model(**batch), batch), batch):
                opt.step()
                opt.zero_grad()

    `plan_backward` scales the loss sum by ``record.loss_scale(world_size)`` and
    backpropagates it with DDP's gradient sync on the step's last micro-batch only.

This module is tested with Lightning 2.6 (``lightning.pytorch``), DDP on gloo.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, cast

from batchplan.errors import ConfigError, PlanFormatError, PlanMismatchError
from batchplan.integrations import require

lightning_pytorch = require("lightning.pytorch")
torch = require("torch")

from torch.utils.data import DataLoader  # noqa: E402

from batchplan.runtime import PackCollator, PadCollator, PlanBatch, PlanDataset, PlanSampler  # noqa: E402
from batchplan.runtime.records import MicroBatch  # noqa: E402

__all__ = ["PlanDataModule", "plan_backward", "plan_loss"]

STATE_FORMAT = "batchplan-lightning/1"

_LightningDataModule: Any = lightning_pytorch.LightningDataModule  # a class of a library imported at run time


class PlanDataModule(_LightningDataModule):
    """Feeds a Lightning ``Trainer`` this rank's micro-batches of a plan.

    Args:
        plan: the plan file, or a `PlanSampler` of this rank. A path is opened in
            ``setup`` with the trainer's ``global_rank`` and ``world_size``.
        dataset: the map-style dataset the plan was built on (row count checked).
        collate_fn: collate function; default `PackCollator` or `PadCollator` by the
            plan's mode. A custom one must keep the record (``with_record``).
        num_workers: ``DataLoader`` worker processes.
        pin_memory: ``DataLoader(pin_memory=...)``.

    Raises:
        ConfigError: in ``train_dataloader``, when the trainer would replace the
            batch sampler, would train past the plan, or its accumulation does not
            match the plan's steps (automatic optimisation).
        PlanMismatchError: the plan was built for another world size or dataset.
    """

    def __init__(
        self,
        plan: str | os.PathLike | PlanSampler,
        dataset: Any,
        *,
        collate_fn: Any = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(plan, (str, os.PathLike, PlanSampler)):
            raise ConfigError(f"plan must be a plan file path or a PlanSampler, got {type(plan).__name__}")
        self.plan = plan
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self._sampler: PlanSampler | None = None  # opened on first use
        self._pending_step: int | None = None
        self.last_record: MicroBatch | None = None

    # -- the sampler -------------------------------------------------------------------

    @property
    def sampler(self) -> PlanSampler:
        """This rank's `PlanSampler` (opened on first use)."""
        if self._sampler is None:
            if isinstance(self.plan, PlanSampler):
                self._sampler = self.plan
            else:
                trainer = self._trainer_or_none()
                rank, world_size = (None, None) if trainer is None else (trainer.global_rank, trainer.world_size)
                self._sampler = PlanSampler(self.plan, rank=rank, world_size=world_size)
        return self._sampler

    def setup(self, stage: str) -> None:
        sampler = self.sampler
        trainer = self._trainer_or_none()
        if trainer is not None and (sampler.rank, sampler.world_size) != (trainer.global_rank, trainer.world_size):
            raise PlanMismatchError(
                f"the PlanSampler is rank {sampler.rank} of {sampler.world_size} but this trainer process is rank "
                f"{trainer.global_rank} of {trainer.world_size}; pass the plan path and let the data module open it"
            )
        if sampler.first_step != 0:
            raise ConfigError(
                f"{sampler.path} is a resharded plan (it starts at step {sampler.first_step}); Lightning counts "
                "steps from 0: resume the resharded part with the plain loop (docs/resharding.md)"
            )
        sampler.check_dataset(self.dataset)

    def train_dataloader(self) -> DataLoader:
        """The plan's loader; ``len`` is the micro-batches of the whole epoch it walks."""
        sampler = self.sampler
        trainer = self._trainer_or_none()
        if trainer is not None:
            _check_trainer(trainer, sampler)
        self._apply_pending_state()
        collate = self.collate_fn or (PackCollator() if sampler.mode == "pack" else PadCollator())
        loader = _PlanLoader(
            PlanDataset(self.dataset),
            batch_sampler=sampler,
            collate_fn=collate,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )
        loader.steps_done = self._steps_done
        return loader

    # -- batches ---------------------------------------------------------------------------

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Check that the batch about to be trained belongs to the step the trainer is at."""
        trainer = self._trainer_or_none()
        if trainer is None or not trainer.training or not isinstance(batch, PlanBatch) or not batch.has_record:
            return batch
        record = batch.record
        if record.step != trainer.global_step:
            raise PlanMismatchError(
                f"rank {self.sampler.rank} is about to train micro-batch {record.micro} of plan step {record.step} "
                f"(epoch {record.epoch}) but the trainer is at global step {trainer.global_step}: the loader and "
                "the trainer disagree (a mid-step checkpoint, accumulate_grad_batches that does not match the "
                "plan, or a loader that skips or replays data)"
            )
        self.last_record = record
        return batch

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The plan's identity and the optimizer steps done (``trainer.global_step``); one for all ranks."""
        trainer = self._trainer_or_none()
        if trainer is None:
            raise ConfigError("PlanDataModule.state_dict needs the trainer's global_step: call it during fit")
        metadata = self.sampler.plan.metadata
        return {
            "format": STATE_FORMAT,
            "step": int(trainer.global_step),
            "content_hash": metadata.get("content_hash"),
            "config_fingerprint": metadata.get("config_fingerprint"),
            "world_size": self.sampler.world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put this rank's sampler right before the saved step (applied when the loader is built)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            raise PlanFormatError(
                f"the checkpoint's data module state is not a {STATE_FORMAT} state (got "
                f"{type(state_dict).__name__}); resume from a checkpoint of a PlanDataModule run"
            )
        sampler = self.sampler
        metadata = sampler.plan.metadata
        for name, ours in (
            ("content_hash", metadata.get("content_hash")),
            ("config_fingerprint", metadata.get("config_fingerprint")),
            ("world_size", sampler.world_size),
        ):
            if state_dict.get(name) != ours:
                raise PlanMismatchError(
                    f"the checkpoint was saved with a plan of {name} {state_dict.get(name)!r} but {sampler.path} has "
                    f"{ours!r}; resume with the plan (and world size) the checkpoint was trained with"
                )
        self._pending_step = int(state_dict["step"])
        self._apply_pending_state()

    def _apply_pending_state(self) -> None:
        if self._pending_step is not None:
            sampler = self.sampler
            sampler.load_state_dict(sampler.state_at_step(self._pending_step))
            self._pending_step = None

    def _trainer_or_none(self):
        return getattr(self, "trainer", None)

    def _steps_done(self) -> int | None:
        """The optimizer steps the fitting trainer has done, or None outside training."""
        trainer = self._trainer_or_none()
        return int(trainer.global_step) if trainer is not None and trainer.training else None


class _PlanLoader(DataLoader):
    """A plan ``DataLoader`` whose length is the micro-batches of the epoch it walks, and whose
    every iteration starts at the trainer's next step.

    Lightning counts an epoch's batches from its start, also when it resumes inside
    it; the sampler's own length (what is left) would end a resumed epoch early.
    With ``reload_dataloaders_every_n_epochs``, Lightning makes two iterators at the
    start of every epoch after the first and trains the second; the first one's
    workers have drawn ``num_workers x prefetch_factor`` micro-batches by then, which
    the second would skip. So each iteration first puts the sampler right before step
    ``steps_done()`` (`PlanSampler.state_at_step`), as a resume does.
    """

    # () -> the trainer's optimizer steps done, or None: the sampler is left as it is
    steps_done: Callable[[], int | None] | None = None

    @property
    def plan_sampler(self) -> PlanSampler:
        return cast(PlanSampler, self.batch_sampler)  # made with batch_sampler=the plan's sampler

    def __len__(self) -> int:
        sampler = self.plan_sampler
        return int(sampler.plan.metadata["rows_per_rank"][sampler.epoch])

    def __iter__(self):
        done = self.steps_done() if self.steps_done is not None else None
        if done is not None:
            sampler = self.plan_sampler
            sampler.load_state_dict(sampler.state_at_step(done))
        return super().__iter__()


# -- training-step helpers --------------------------------------------------------------


def plan_loss(loss_sum: Any, batch: PlanBatch, trainer: Any) -> Any:
    """What an automatic-optimisation ``training_step`` returns for this micro-batch.

    ``loss_sum * record.loss_scale(world_size) * accumulate_grad_batches``: Lightning
    divides the returned loss by ``accumulate_grad_batches``, so the gradients are
    the step's token mean over all ranks, as in the plain loop. (The logged loss is
    that scaled value, not a mean.)

    Args:
        loss_sum: the micro-batch's summed token loss (`token_loss_sum`).
        batch: the `PlanBatch` (its record gives the step's loss tokens).
        trainer: the Lightning trainer (``self.trainer``).
    """
    return loss_sum * (batch.record.loss_scale(trainer.world_size) * trainer.accumulate_grad_batches)


def plan_backward(module: Any, loss_sum: Any, batch: PlanBatch) -> bool:
    """Manual optimisation: backpropagate this micro-batch's share of the step's loss.

    Gradients are synchronised across ranks on the step's last micro-batch only
    (DDP's ``no_sync`` before it). Returns True when the optimizer should step now
    (``record.is_last``).

    Args:
        module: the ``LightningModule`` (``self``), with ``automatic_optimization = False``.
        loss_sum: the micro-batch's summed token loss (`token_loss_sum`).
        batch: the `PlanBatch`.

    Raises:
        ConfigError: the module uses automatic optimisation.
    """
    if module.automatic_optimization:
        raise ConfigError(
            "plan_backward is for manual optimisation (automatic_optimization = False); with automatic "
            "optimisation return plan_loss(loss_sum, batch, self.trainer) from training_step"
        )
    record = batch.record
    trainer = module.trainer
    wrapped = trainer.model
    no_sync = getattr(wrapped, "no_sync", None)
    sync = contextlib.nullcontext() if record.is_last or no_sync is None else no_sync()
    with sync:
        module.manual_backward(loss_sum * record.loss_scale(trainer.world_size))
    return record.is_last


# -- checks ---------------------------------------------------------------------------------


def _check_trainer(trainer: Any, sampler: PlanSampler) -> None:
    connector = getattr(trainer, "_accelerator_connector", None)
    if getattr(connector, "use_distributed_sampler", False) and trainer.world_size > 1:
        raise ConfigError(
            "Trainer(use_distributed_sampler=True) would rebuild the plan's loader around a DistributedSampler; "
            "the plan already splits the data by rank: pass use_distributed_sampler=False to Trainer"
        )
    _check_length(trainer, sampler)
    rows = [int(n) for n in sampler.plan.metadata["rows_per_rank"]]
    if len(set(rows)) > 1 and trainer.reload_dataloaders_every_n_epochs != 1:
        raise ConfigError(
            f"the plan's epochs have {rows} micro-batches per rank; Lightning reads an epoch's length when it "
            "builds the loader: pass reload_dataloaders_every_n_epochs=1 to Trainer"
        )
    if trainer.lightning_module is not None and trainer.lightning_module.automatic_optimization:
        _check_accumulation(trainer, sampler)


def _check_length(trainer: Any, sampler: PlanSampler) -> None:
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    if max_steps is not None and max_steps > sampler.num_steps:
        raise ConfigError(
            f"max_steps is {max_steps:,} but the plan has {sampler.num_steps:,} steps; rebuild it with more "
            "`epochs` or lower max_steps"
        )
    stops_by_steps = max_steps is not None and max_steps >= 0
    stops_by_epochs = max_epochs is not None and 0 <= max_epochs <= sampler.num_epochs
    if not (stops_by_steps or stops_by_epochs):
        raise ConfigError(
            f"the trainer would train {max_epochs if max_epochs not in (None, -1) else 'unlimited'} epochs but the "
            f"plan has {sampler.num_epochs}; pass max_epochs={sampler.num_epochs} (or fewer) to Trainer"
        )


def _check_accumulation(trainer: Any, sampler: PlanSampler) -> None:
    """Automatic optimisation steps every ``accumulate_grad_batches`` batches and at an epoch's
    end: the plan must have that many micro-batches in every step but an epoch's last."""
    micro = trainer.accumulate_grad_batches
    sizes = []
    for epoch in range(sampler.num_epochs):
        rows = sampler.plan.rank_rows(epoch, sampler.rank)
        first = rows.numbers("micro") == 0  # one row per step
        sizes.append(rows.numbers("num_micro")[first])
    inner = {int(n) for epoch in sizes for n in epoch[:-1]}
    last = max((int(epoch[-1]) for epoch in sizes if epoch.size), default=0)
    if inner <= {micro} and last <= micro:
        return
    if len(inner) > 1:
        raise ConfigError(
            f"{sampler.path} has steps of {min(inner)} to {max(inner)} micro-batches (built with "
            "`tokens_per_step` or a ramp-up); Lightning's automatic optimisation steps every "
            "accumulate_grad_batches batches: use manual optimisation with plan_backward, or build the plan "
            "with `micro_batches=M`"
        )
    planned = max(inner | {last})
    raise ConfigError(
        f"accumulate_grad_batches is {micro} but the steps of {sampler.path} have {planned} micro-batches "
        f"(an epoch's last step may have fewer); pass accumulate_grad_batches={planned} to Trainer"
    )
