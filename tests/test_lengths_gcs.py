"""Lengths from ``gs://`` prefixes on a real GCS-protocol server (gcp-storage-emulator, its own
process on localhost), read through pyarrow's GcsFileSystem like the same files on local disk.

The server holds a small corpus under ``gs://corpus/lengths`` (nested prefixes, among them ``a``
and ``a-b``, whose keys sort differently as strings and as paths, a folder placeholder object
and one non-Parquet object beside them) and a few objects for the error cases. Every URI is
anonymous and names the server in its query, as a user points batchplan at an emulator; the
retry limit in the query turns a server that stopped answering into an error, not a hang.
The emulator runs in a subprocess: a pyarrow GCS file makes its first request holding the GIL
(``NativeFile.closed`` starts the download), which deadlocks against a server thread here.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from _corpus import assert_plans_equal, write_corpus
from _ddp_plans import free_port
from typer.testing import CliRunner

from batchplan.errors import DatasetError
from batchplan.formats.lengths import read_lengths
from batchplan.formats.opening import open_plan
from batchplan.formats.storage import GCS_RETRY_SECONDS, _with_retry_limit
from batchplan_cli.main import app

pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (the test extra) runs the GCS server")

BUCKET = "corpus"
NAME = f"gs://{BUCKET}/lengths"  # how files under the prefix are named: no credentials, no query


def start_emulator(port: int, log: Path) -> subprocess.Popen:
    """gcp-storage-emulator on ``127.0.0.1:port``, in memory, once it answers its health check;
    its stderr goes to ``log``.

    Its server answers one request at a time from a listen queue of 5 connections (the
    `http.server` default): 16 reading threads overflow it, and each dropped connection costs
    the client a 1 s SYN retry. A queue of 128 lets them wait their turn instead.
    """
    queue = "import http.server; http.server.HTTPServer.request_queue_size = 128"
    run = f"{queue}; import sys; from gcp_storage_emulator.__main__ import main; main(sys.argv[1:])"
    arguments = ["start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--quiet"]
    with log.open("wb") as stderr:
        server = subprocess.Popen([sys.executable, "-c", run, *arguments], stderr=stderr)
    deadline = time.monotonic() + 30
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
                return server
        except OSError:
            time.sleep(0.05)
    server.kill()
    server.wait()
    raise RuntimeError(f"gcp-storage-emulator did not answer on port {port}: {log.read_text()}")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A GCS emulator with the corpus uploaded; yields ``(local copy of NAME, its HOST:PORT)``."""
    local = write_corpus(tmp_path_factory.mktemp("corpus"), num_files=40)
    port = free_port()
    server = start_emulator(port, tmp_path_factory.mktemp("emulator") / "stderr.log")
    try:
        store = pafs.GcsFileSystem(
            anonymous=True, endpoint_override=f"127.0.0.1:{port}", scheme="http", project_id="test"
        )
        for bucket in (BUCKET, "empty"):
            store.create_dir(bucket)
        pafs.copy_files(
            str(local),
            f"{BUCKET}/lengths",
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=store,
            use_threads=True,
        )
        store.create_dir(f"{BUCKET}/lengths/a/placeholder")  # a "folder" object: lengths/a/placeholder/
        for key, body in {"notes/readme.txt": b"text", "hf/state.json": b"{}"}.items():
            with store.open_output_stream(f"{BUCKET}/{key}") as stream:
                stream.write(body)
        yield local, f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


def uri(name: str, endpoint: str) -> str:
    """The URI of file name ``gs://BUCKET/KEY`` on the emulator at ``endpoint`` (HOST:PORT)."""
    query = f"?endpoint_override={endpoint}&scheme=http&retry_limit_seconds=5"
    return name.replace("gs://", "gs://anonymous@", 1) + query


@pytest.mark.slow
def test_a_prefix_reads_like_its_local_copy(gcs):
    local, endpoint = gcs
    remote = read_lengths(uri(NAME, endpoint), loss_tokens_column="loss")
    copy = read_lengths(local, loss_tokens_column="loss")
    assert remote.num_samples == copy.num_samples
    np.testing.assert_array_equal(remote.lengths, copy.lengths)
    np.testing.assert_array_equal(remote.loss_tokens, copy.loss_tokens)
    assert remote.fingerprint() == copy.fingerprint()
    assert list(remote.files) == [(name.replace(str(local), NAME), rows) for name, rows in copy.files]
    # Path order, not string order: a/ comes before a-b/.
    folders = [name[len(NAME) + 1 :].split("/")[0] for name, _ in remote.files]
    assert folders.index("a") < folders.index("a-b")


@pytest.mark.slow
def test_a_plan_built_from_a_prefix_equals_the_local_one(gcs, tmp_path):
    local, endpoint = gcs
    assert_plans_equal(uri(NAME, endpoint), local, tmp_path, name=NAME)


@pytest.mark.slow
def test_cli_builds_and_validates_from_a_prefix(gcs, tmp_path):
    _, endpoint = gcs
    plan = tmp_path / "plan.arrow"
    runner = CliRunner()
    build = ["build", uri(NAME, endpoint), "-o", str(plan), "--max-tokens", "64", "--world-size", "2", "-q"]
    result = runner.invoke(app, [*build, "--loss-tokens-column", "loss"])
    assert result.exit_code == 0, result.output
    files = open_plan(plan).metadata["dataset"]["files"]
    assert len(files) == 40
    assert all(name.startswith(f"{NAME}/") and name.endswith(".parquet") for name, _ in files)
    result = runner.invoke(app, ["validate", str(plan), "--dataset", uri(NAME, endpoint)])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output


@pytest.mark.slow
def test_one_object_and_an_endpoint_from_the_environment(gcs, monkeypatch):
    local, endpoint = gcs
    name = f"{NAME}/a/shard-00001.parquet"
    lengths = read_lengths(uri(name, endpoint))
    assert list(lengths.files) == [(name, pq.read_metadata(local / "a/shard-00001.parquet").num_rows)]
    np.testing.assert_array_equal(lengths.lengths, read_lengths(local / "a/shard-00001.parquet").lengths)
    # google-cloud-cpp's emulator variable, the GCS analogue of AWS_ENDPOINT_URL.
    monkeypatch.setenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", f"http://{endpoint}")
    assert read_lengths(f"gs://anonymous@{BUCKET}/lengths/b?retry_limit_seconds=5").files == (
        read_lengths(uri(f"{NAME}/b", endpoint)).files
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("gs://no-such-bucket/lengths", "GCS bucket 'no-such-bucket' does not exist"),
        (f"{NAME}/missing", "no such object or prefix"),
        (f"gs://{BUCKET}/notes", r"prefix holds no \*.parquet objects \(1 other object\(s\)\)"),
        ("gs://empty", r"prefix holds no \*.parquet objects \(0 other object\(s\)\)"),
        (f"gs://{BUCKET}/hf", "datasets folder .* read from local disk only"),
    ],
)
def test_errors_name_the_uri(gcs, path, message):
    with pytest.raises(DatasetError, match=message) as raised:
        read_lengths(uri(path, gcs[1]))
    assert str(raised.value).startswith(uri(path, gcs[1]))
    assert "\n" not in str(raised.value)


@pytest.mark.slow
def test_an_object_that_is_not_parquet_is_named_without_the_query(gcs):
    name = f"{NAME}/README.txt"
    with pytest.raises(DatasetError, match=f"^{name}: not a readable Parquet file") as raised:
        read_lengths(uri(name, gcs[1]))
    assert "\n" not in str(raised.value)


@pytest.mark.slow
def test_gs_uris_retry_for_a_minute_unless_they_say(gcs):
    """Without credentials pyarrow's GCS client retries for 15 minutes before reporting anything:
    a gs:// URI that sets no ``retry_limit_seconds`` gets `GCS_RETRY_SECONDS` appended to its
    query (kept as given), and it still reads."""
    _, endpoint = gcs
    query = f"endpoint_override={endpoint}&scheme=http"
    assert _with_retry_limit(f"gs://b/p?{query}") == f"gs://b/p?{query}&retry_limit_seconds={GCS_RETRY_SECONDS}"
    assert _with_retry_limit("gs://b/p") == f"gs://b/p?retry_limit_seconds={GCS_RETRY_SECONDS}"
    assert _with_retry_limit("gs://b/p?retry_limit_seconds=5") == "gs://b/p?retry_limit_seconds=5"
    assert _with_retry_limit("s3://b/p") == "s3://b/p"
    default = read_lengths(f"gs://anonymous@{BUCKET}/lengths/b?{query}")
    assert default.files == read_lengths(uri(f"{NAME}/b", endpoint)).files
