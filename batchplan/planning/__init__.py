"""Planning: lengths in, a `batchplan.plan.Plan` out (arrays only, no files).

A build runs `batchplan.planning.epochs.build_plan`: entries from the samples
(`entries`), then per epoch micro-batches formed (`forming`), scheduled into steps and
ranks (`schedule`), with seeded randomness from one place (`randomness`).
"""
