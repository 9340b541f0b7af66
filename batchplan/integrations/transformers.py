"""Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``) that replay a plan exactly.

``PlanTrainer(model=..., args=..., train_dataset=..., plan="plan.arrow")`` trains on
the plan's micro-batches, steps and epochs, and nothing else:

- The loader is built from the plan (`PlanSampler` + `PlanDataset` + the collator
  of the plan's mode) and never passed through ``accelerator.prepare``, so
  Accelerate cannot split a rank's plan again; tensors reach the device through
  Trainer's own ``_prepare_inputs``.
- Trainer sees one *step* of the plan per batch (``gradient_accumulation_steps``
  stays 1): `PlanTrainerMixin.training_step` runs the step's micro-batches, with
  DDP's gradient sync only on the last, so steps whose micro-batch count varies
  (``tokens_per_step``) train as planned.
- The loss is normalised by the plan's ``step_loss_tokens`` (Trainer's
  ``num_items_in_batch``), the exact token mean over all ranks with no all-reduce;
  each micro-batch's labelled tokens are checked against the plan.
- Epochs and ``max_steps`` come from the plan (``num_train_epochs`` is not used;
  ``max_steps`` may stop earlier). Checkpoints hold each rank's sampler state,
  and ``resume_from_checkpoint`` continues with exactly the micro-batches left.
- Packed batches carry ``use_cache=False`` and the model's config gets it too
  (Hugging Face models find packed samples from ``position_ids`` only without a
  KV cache).
- A mixture's plan trains on ``MixtureDataset(plan, {name: dataset})`` like any
  dataset, and each training log also holds ``loss/<source>``: the token-mean loss
  of each source over all ranks since the last log (`batchplan.runtime.SourceLosses`).

TRL: ``class PlanSFTTrainer(PlanTrainerMixin, SFTTrainer)``. Build the plan on the
dataset as the trainer prepares it (after tokenisation and truncation): the trainer
checks the row count, and the token lengths when it can read them cheaply.

DDP runs without ``find_unused_parameters`` unless ``ddp_find_unused_parameters=True`` asks for
it (Trainer's default walks the graph on every backward and warns when nothing is unused).

This module overrides some of Trainer's private methods (``_init_training_state``,
``_save_checkpoint``, ``_track_num_input_tokens``, ``_build_accelerator_args``); it is tested
with transformers 5.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from batchplan.errors import ConfigError, PlanFormatError, PlanMismatchError
from batchplan.formats.datasets_folder import loaded_dataset_lengths
from batchplan.integrations import require

transformers = require("transformers")
torch = require("torch")

from torch.utils.data import DataLoader  # noqa: E402

from batchplan.runtime import PackCollator, PadCollator, PlanBatch, PlanDataset, PlanSampler  # noqa: E402
from batchplan.runtime.loss import count_loss_tokens, token_loss_sum  # noqa: E402
from batchplan.runtime.plan_steps import PlanStep, PlanSteps  # noqa: E402
from batchplan.runtime.source_loss import SourceLosses  # noqa: E402

__all__ = ["PlanTrainer", "PlanTrainerMixin", "SAMPLER_STATE_FILE"]

SAMPLER_STATE_FILE = "batchplan_sampler_rank{rank}.json"

# The mixin's base: at run time object (the Trainer class comes after the mixin in a subclass's
# bases); for the type checker Trainer itself, which is Any (`require` imports transformers).
if TYPE_CHECKING:
    _TrainerBase = Any
else:
    _TrainerBase = object
_Trainer: Any = transformers.Trainer


class PlanTrainerMixin(_TrainerBase):
    """Makes a ``Trainer`` subclass replay a batchplan plan; put it first in the bases.

    Args:
        plan: the plan file, or a `PlanSampler` of this rank.
        plan_collator: collate function for the plan's micro-batches; default
            `PackCollator` or `PadCollator` by the plan's mode (pad token from the
            processing class). The trainer's ``data_collator`` is not used.
        *args, **kwargs: what the ``Trainer`` class takes.

    Raises:
        ConfigError: ``gradient_accumulation_steps`` is not 1 (the plan sets the
            micro-batches of each step), or ``average_tokens_across_devices`` is off.
        PlanMismatchError: the plan was built for another world size or dataset.
    """

    compute_loss_func: Any  # Trainer's; set here for a model that returns only logits

    def __init__(
        self, *args: Any, plan: str | os.PathLike | PlanSampler, plan_collator: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise ConfigError(
                f"gradient_accumulation_steps is {self.args.gradient_accumulation_steps}, but the plan sets the "
                "micro-batches of every step; leave it at 1 (build the plan with `micro_batches=M` or "
                "`tokens_per_step=T` instead)"
            )
        if not self.args.average_tokens_across_devices:
            raise ConfigError(
                "average_tokens_across_devices=False divides each rank's loss by its own tokens; the plan's "
                "step_loss_tokens counts all ranks, so leave it True"
            )
        self.plan_sampler = (
            plan
            if isinstance(plan, PlanSampler)
            else PlanSampler(plan, rank=self.args.process_index, world_size=self.args.world_size)
        )
        if self.plan_sampler.first_step != 0:
            raise ConfigError(
                f"{self.plan_sampler.path} is a resharded plan (it starts at step {self.plan_sampler.first_step}); "
                "PlanTrainer replays whole plans: resume the resharded part with the plain loop (docs/resharding.md)"
            )
        self.plan_collator = plan_collator or self._default_plan_collator()
        if self.train_dataset is not None:
            _check_dataset(self.plan_sampler, self.train_dataset)
        config = getattr(self.model, "config", None)
        if config is not None and self.plan_sampler.mode == "pack" and getattr(config, "use_cache", None):
            config.use_cache = False  # a KV cache hides the packed samples' boundaries from HF models
        if not self.model_accepts_loss_kwargs and self.compute_loss_func is None:
            self.compute_loss_func = _token_mean_loss  # exact for a model that returns only logits
        mixture = self.plan_sampler.plan.metadata.get("mixture") is not None
        self.plan_source_losses = SourceLosses(self.plan_sampler) if mixture else None

    def _default_plan_collator(self):
        pad = getattr(self.processing_class, "pad_token_id", None)
        options = {} if pad is None else {"pad_token_id": int(pad)}
        return PackCollator(**options) if self.plan_sampler.mode == "pack" else PadCollator(**options)

    # -- data ------------------------------------------------------------------------

    def get_train_dataloader(self) -> PlanSteps:
        """The plan's steps: each item is a `PlanStep`, the step's micro-batches on this rank."""
        if self.train_dataset is None:
            raise ConfigError("Trainer: training requires a train_dataset")
        args = self.args
        workers = args.dataloader_num_workers
        loader = DataLoader(
            PlanDataset(self.train_dataset),
            batch_sampler=self.plan_sampler,
            collate_fn=self.plan_collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers if workers else False,
            prefetch_factor=args.dataloader_prefetch_factor if workers else None,
        )
        return PlanSteps(loader, self.plan_sampler)

    def set_initial_training_values(self, args, dataloader):
        steps = self.plan_sampler.steps_per_epoch
        total = sum(steps)
        max_steps = args.max_steps if args.max_steps > 0 else total
        if max_steps > total:
            raise ConfigError(
                f"max_steps is {max_steps:,} but the plan has {total:,} steps; rebuild it with more `epochs` "
                "or lower max_steps"
            )
        epochs = int(np.searchsorted(np.cumsum(steps), max_steps, side="left")) + 1
        num_examples = len(self.train_dataset)
        longest = max(steps)  # Trainer loops this many steps per epoch; a shorter epoch ends early
        return (
            epochs,
            longest,
            num_examples,
            num_examples * epochs,
            self.get_total_train_batch_size(args),
            longest,
            max_steps,
        )

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        step = next(epoch_iterator, None)
        if step is None:
            return [], None
        return [step], step.step_loss_tokens

    # -- one step ----------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not isinstance(inputs, PlanStep):
            return super().training_step(model, inputs, num_items_in_batch)
        total = None
        for batch in inputs:
            record = batch.record
            _check_loss_tokens(batch, record)
            sync = contextlib.nullcontext() if record.is_last else self.accelerator.no_sync(model)
            with sync:
                loss = super().training_step(model, batch, num_items_in_batch=max(record.step_loss_tokens, 1))
            if self.plan_source_losses is not None:
                self.plan_source_losses.add(loss / record.loss_scale(), record)  # the loss sum: see log
            total = loss if total is None else total + loss
        return total

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log; for a mixture's plan, a training log also holds ``loss/<source>``: each
        source's token-mean loss on all ranks since the last log (`SourceLosses`; a collective,
        which Trainer's training logs are on every rank)."""
        if self.plan_source_losses is not None and "loss" in logs:
            logs.update({f"loss/{name}": loss.mean for name, loss in self.plan_source_losses.reduce().items()})
        super().log(logs, *args, **kwargs)

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        # Trainer asks DDP to find unused parameters unless told otherwise, which costs a graph walk per
        # backward and warns on every model that uses all of its parameters; a plan's micro-batches do
        # not change which parameters a model uses. ddp_find_unused_parameters=True keeps it.
        built = super()._build_accelerator_args(**kwargs)
        if self.args.ddp_find_unused_parameters is None:
            for handler in built.get("kwargs_handlers", []):
                if hasattr(handler, "find_unused_parameters"):
                    handler.find_unused_parameters = False
        return built

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, PlanStep):
            return sum(super(PlanTrainerMixin, self).floating_point_ops(batch) for batch in inputs)
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs) -> None:
        if isinstance(inputs, PlanStep):
            for batch in inputs:
                super()._track_num_input_tokens(batch)
            return
        super()._track_num_input_tokens(inputs)

    # -- checkpoints ---------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        prefix = transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
        folder = os.path.join(self._get_output_dir(trial=trial), f"{prefix}-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        # Checkpoints fall on step boundaries: global_step steps done, whatever the loader prefetched.
        sampler = self.plan_sampler
        path = os.path.join(folder, SAMPLER_STATE_FILE.format(rank=sampler.rank))
        with open(path, "w") as file:
            json.dump(sampler.state_at_step(self.state.global_step), file)

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        sampler = self.plan_sampler
        if resume_from_checkpoint is None or self.state.global_step == 0:
            sampler.load_state_dict(sampler.state_at_step(0))
            return 0, 0
        state = _read_sampler_state(resume_from_checkpoint, sampler.rank)
        sampler.load_state_dict(state)  # checks plan, rank and world size
        expected = sampler.state_at_step(self.state.global_step)
        if state != expected:
            raise PlanMismatchError(
                f"{resume_from_checkpoint}: the sampler state is at epoch {state['epoch']}, micro-batch "
                f"{state['position']} but global step {self.state.global_step} starts at epoch {expected['epoch']}, "
                f"micro-batch {expected['position']}; the checkpoint is inconsistent"
            )
        return sampler.epoch, 0


class PlanTrainer(PlanTrainerMixin, _Trainer):
    """``transformers.Trainer`` that replays a plan: ``PlanTrainer(..., plan="plan.arrow")``."""


def _token_mean_loss(outputs, labels, num_items_in_batch=None):
    """Token loss sum over the step's loss tokens (Trainer then scales by the process count)."""
    return token_loss_sum(outputs, labels) / max(int(num_items_in_batch or 1), 1)


def _check_loss_tokens(batch: PlanBatch, record) -> None:
    found = count_loss_tokens(batch)
    if found != record.loss_tokens:
        raise PlanMismatchError(
            f"micro-batch {record.micro} of step {record.step} has {found} labelled tokens but the plan counts "
            f"{record.loss_tokens}; the labels do not match the plan's loss tokens: build the plan with "
            "a loss-tokens column (`loss_tokens_column`: labels with -100 on prompts), or give items no 'labels'"
        )


def _read_sampler_state(folder: str, rank: int) -> dict:
    path = os.path.join(folder, SAMPLER_STATE_FILE.format(rank=rank))
    try:
        with open(path) as file:
            return json.load(file)
    except FileNotFoundError:
        raise PlanFormatError(
            f"{path} is missing: the checkpoint was not saved by a PlanTrainer (or by another world size); "
            "resume from a checkpoint of this run"
        ) from None


def _check_dataset(sampler: PlanSampler, dataset) -> None:
    """Row count always; the token lengths too when a ``datasets.Dataset`` gives them cheaply."""
    lengths = loaded_dataset_lengths(dataset)  # from the list offsets of input_ids
    column = (sampler.plan.metadata.get("dataset") or {}).get("loss_tokens_column")
    if lengths is None or column is not None or sampler.plan.metadata.get("lengths_fingerprint") is None:
        sampler.check_dataset(dataset)
    else:
        sampler.check_dataset(dataset, lengths)
