"""Files: sample lengths in (Parquet, `datasets` folders), plan files out and in (Arrow IPC),
and the one view of plan rows every reader above uses (`batchplan.formats.plan_rows.PlanRows`).

pyarrow and numpy only, never numba: the runtime reads plans through this layer.
"""
