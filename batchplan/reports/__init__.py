"""What a plan looks like: summaries, per-step statistics, plots, and the comparison
with the usual batching."""
