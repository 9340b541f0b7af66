"""Lengths read from an S3 prefix (a moto server on localhost) against the same files on local disk.

    python -m bench.remote_lengths --files 1000
    python -m bench.remote_lengths --files 1000 --rows 5000 --json

Writes ``--files`` Parquet files of ``--rows`` rows (a length column and a text column) into a
temporary folder (``BENCH_TMP``), uploads them to a bucket of an in-process moto S3 server
(``moto[server]``, the test extra) and times `batchplan.read_lengths` on ``s3://bench/lengths``
and on the folder, best of ``--repeats``. moto answers in Python, a few ms a request, on the
same cores as the reader: the remote time is the server's, an upper bound of the reader's cost
per request, not S3's latency.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from bench.build import print_row


def write_files(root: Path, num_files: int, rows: int) -> None:
    rng = np.random.default_rng(0)
    for index in range(num_files):
        length = rng.integers(1, 4096, rows).astype(np.int32)
        pq.write_table(pa.table({"length": length, "text": ["x" * 16] * rows}), root / f"shard-{index:05d}.parquet")


def best_seconds(function, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=5, help="rows per file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    from batchplan.formats.lengths import read_lengths

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            local = Path(tmp)
            write_files(local, args.files, args.rows)
            store, _ = pafs.FileSystem.from_uri("s3://bench?allow_bucket_creation=true")
            store.create_dir("bench")
            start = time.perf_counter()
            pafs.copy_files(
                tmp,
                "bench/lengths",
                source_filesystem=pafs.LocalFileSystem(),
                destination_filesystem=store,
                use_threads=True,
            )
            upload = time.perf_counter() - start
            remote = best_seconds(lambda: read_lengths("s3://bench/lengths"), args.repeats)
            on_disk = best_seconds(lambda: read_lengths(local), args.repeats)
            same = read_lengths("s3://bench/lengths").fingerprint() == read_lengths(local).fingerprint()
    finally:
        server.stop()
    row = {
        "files": args.files,
        "samples": args.files * args.rows,
        "upload_s": round(upload, 2),
        "s3_read_s": round(remote, 2),
        "local_read_s": round(on_disk, 3),
        "ratio": round(remote / on_disk, 1),
        "s3_files_per_s": round(args.files / remote),
        "same_lengths": same,
    }
    print_row(row, args.json)


if __name__ == "__main__":
    main()
