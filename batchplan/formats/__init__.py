"""Files: sample lengths in (Parquet, `datasets` folders), plan files out and in (Arrow IPC).

pyarrow and numpy only, never numba: the runtime reads plans through this layer.
"""
