"""batchplan.runtime: replay a plan inside PyTorch training (numpy + pyarrow + torch only).

```python
loader = plan_loader(dataset, "plan.arrow")                # rank/world_size from torch.distributed
sampler = loader.batch_sampler                             # the PlanSampler: state_dict, finished
while not sampler.finished:                                # one pass of the loader = one epoch
    for batch in loader:
        mb = batch.record                                  # the micro-batch's plan record
        loss = token_loss_sum(model(**batch), batch) * mb.loss_scale()
        loss.backward()                                    # (DDP: no_sync() unless mb.is_last)
        if mb.is_last: optimizer.step(); scheduler.step(); optimizer.zero_grad()
```

`plan_loader` is ``DataLoader(PlanDataset(dataset), batch_sampler=PlanSampler(plan),
collate_fn=PackCollator())`` (`PadCollator` for pad plans). Importing this package never
imports numba or typer (a test checks it). See docs/runtime.md.
"""

from batchplan.runtime.attention import document_causal_mask, padding_causal_mask
from batchplan.runtime.batch import PlanBatch, record_of
from batchplan.runtime.collate import IGNORE_INDEX, PackCollator, PadCollator, with_record
from batchplan.runtime.dataset import PlanDataset
from batchplan.runtime.loader import plan_loader
from batchplan.runtime.loss import count_loss_tokens, token_loss_sum
from batchplan.runtime.lr_schedule import read_step_tokens, token_lr_scheduler
from batchplan.runtime.mixture import MixtureDataset, source_names
from batchplan.runtime.records import MicroBatch, PlannedItems, PlannedRows, SpanIndex, SpanItem
from batchplan.runtime.sampler import PlanSampler
from batchplan.runtime.source_loss import SourceLoss, SourceLosses

__all__ = [
    "IGNORE_INDEX",
    "MicroBatch",
    "MixtureDataset",
    "PackCollator",
    "PadCollator",
    "PlanBatch",
    "PlanDataset",
    "PlanSampler",
    "PlannedItems",
    "PlannedRows",
    "SourceLoss",
    "SourceLosses",
    "SpanIndex",
    "SpanItem",
    "count_loss_tokens",
    "document_causal_mask",
    "padding_causal_mask",
    "plan_loader",
    "read_step_tokens",
    "record_of",
    "source_names",
    "token_loss_sum",
    "token_lr_scheduler",
    "with_record",
]
