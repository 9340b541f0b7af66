"""batchplan.runtime: replay a plan inside PyTorch training (numpy + pyarrow + torch only).

```python
sampler = PlanSampler("plan.arrow")                        # rank/world_size from torch.distributed
loader = DataLoader(PlanDataset(dataset), batch_sampler=sampler, collate_fn=PackCollator())
while not sampler.finished:                                # one pass of the loader = one epoch
    for batch in loader:
        mb = batch.record                                  # the micro-batch's plan record
        loss = token_loss_sum(model(**batch), batch) * mb.loss_scale()
        loss.backward()                                    # (DDP: no_sync() unless mb.is_last)
        if mb.is_last: optimizer.step(); scheduler.step(); optimizer.zero_grad()
```

Importing this package never imports numba or typer (a test checks it).
See docs/runtime.md.
"""

from batchplan.runtime.attention import document_causal_mask, padding_causal_mask
from batchplan.runtime.batch import PlanBatch, record_of
from batchplan.runtime.collate import IGNORE_INDEX, PackCollator, PadCollator, with_record
from batchplan.runtime.dataset import PlanDataset
from batchplan.runtime.loss import count_loss_tokens, token_loss_sum
from batchplan.runtime.records import MicroBatch, PlannedItems, PlannedRows, SpanIndex, SpanItem
from batchplan.runtime.sampler import PlanSampler
from batchplan.runtime.schedule import read_step_tokens, token_lr_scheduler

__all__ = [
    "IGNORE_INDEX",
    "MicroBatch",
    "PackCollator",
    "PadCollator",
    "PlanBatch",
    "PlanDataset",
    "PlanSampler",
    "PlannedItems",
    "PlannedRows",
    "SpanIndex",
    "SpanItem",
    "count_loss_tokens",
    "document_causal_mask",
    "padding_causal_mask",
    "read_step_tokens",
    "record_of",
    "token_loss_sum",
    "token_lr_scheduler",
    "with_record",
]
