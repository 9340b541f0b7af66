"""Lengths from object storage: ``s3://`` prefixes on a real S3-protocol server (moto in server
mode, on localhost), read like the same files on local disk; clear errors; ``gs://`` routing.

The server holds a small corpus under ``s3://corpus/lengths`` (nested prefixes, among them
``a`` and ``a-b``, whose keys sort differently as strings and as paths, and one non-Parquet
object beside them) and a few objects for the error cases. It lists at most `PAGE` keys a
page (the client asks for 1,000; a request filter in front of moto lowers it), so the slow
test's 150 more files take several pages of a listing without a thousand uploads (moto
answers a request in 5-15 ms of Python).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from _corpus import assert_plans_equal, write_corpus
from _ddp_plans import free_port
from typer.testing import CliRunner

from batchplan.config import PlanConfig
from batchplan.errors import DatasetError
from batchplan.formats.lengths import find_dataset_files, read_lengths
from batchplan.formats.opening import open_plan
from batchplan.formats.storage import for_each_file
from batchplan.operations.build import build_plan_file
from batchplan_cli.main import app

moto_server = pytest.importorskip("moto.server", reason="moto[server] (the test extra) runs the S3 server")
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

BUCKET = "corpus"
PREFIX = f"s3://{BUCKET}/lengths"
PAGE = 100  # keys a page of a listing
LISTED: list[str] = []  # the query of every listing the server answered


def paged(app):
    """``app`` with every listing asked for at most `PAGE` keys (noted in `LISTED`)."""

    def call(environ, start_response):
        query = environ.get("QUERY_STRING", "")
        if "list-type=2" in query.split("&"):
            query = re.sub(r"(^|&)max-keys=\d+", rf"\g<1>max-keys={PAGE}", query)
            environ["QUERY_STRING"] = query
            LISTED.append(query)
        return app(environ, start_response)

    return call


def upload(local: Path, key: str) -> float:
    """Copies ``local`` under ``s3://corpus/KEY`` (pyarrow's threads); returns the seconds taken."""
    store, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}")
    start = time.perf_counter()
    pafs.copy_files(
        str(local),
        f"{BUCKET}/{key}",
        source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=store,
        use_threads=True,
    )
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on a free localhost port, reached through the AWS environment
    variables (restored after this file's tests); yields the local copy of ``PREFIX``."""
    local = write_corpus(tmp_path_factory.mktemp("corpus"), num_files=40)
    app = paged(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", free_port(), app, threaded=True, request_handler=MotoRequestHandler)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    werkzeug = logging.getLogger("werkzeug")  # one log record per request otherwise
    level = werkzeug.level
    werkzeug.setLevel(logging.WARNING)
    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        env.setenv("AWS_CONFIG_FILE", str(local / "no-aws-config"))
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(local / "no-aws-credentials"))
        host, port = server.server_address[:2]
        env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        store, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}?allow_bucket_creation=true")
        store.create_dir(BUCKET)
        upload(local, "lengths")
        others = {"notes/readme.txt": b"text", "hf/state.json": b"{}", "hf/data-00000-of-00001.arrow": b""}
        for key, body in others.items():
            with store.open_output_stream(f"{BUCKET}/{key}") as stream:
                stream.write(body)
        yield local
    werkzeug.setLevel(level)
    server.shutdown()
    serving.join()


def assert_read_like_local(prefix: str, local: Path) -> None:
    remote, copy = read_lengths(prefix, loss_tokens_column="loss"), read_lengths(local, loss_tokens_column="loss")
    assert remote.num_samples == copy.num_samples
    np.testing.assert_array_equal(remote.lengths, copy.lengths)
    np.testing.assert_array_equal(remote.loss_tokens, copy.loss_tokens)
    assert remote.fingerprint() == copy.fingerprint()
    assert_listed_like_local(remote.files, copy.files, prefix, local)


def assert_listed_like_local(files, local_files, prefix: str, local: Path) -> None:
    """The files (name, rows) read from ``prefix`` are those read from its copy ``local``, in
    path order, and only the Parquet ones."""
    assert [tuple(file) for file in files] == [(name.replace(str(local), prefix), rows) for name, rows in local_files]
    assert not any(name.endswith("README.txt") for name, _ in files)
    # Path order, not string order: a/ comes before a-b/.
    folders = [name[len(prefix) + 1 :].split("/")[0] for name, _ in files]
    assert folders.index("a") < folders.index("a-b")


def test_a_prefix_reads_like_its_local_copy(s3):
    assert_read_like_local(PREFIX, s3)


def test_a_plan_built_from_a_prefix_equals_the_local_one(s3, tmp_path):
    assert_plans_equal(PREFIX, s3, tmp_path)


@pytest.mark.slow
def test_a_listing_of_several_pages_reads_and_plans_like_local_disk(s3, tmp_path):
    """151 objects, more than one page of a listing: the prefix is read once, by the build.
    Its plan equals the local one, lengths fingerprint (lengths and loss tokens) included, and
    lists the same files, rows and order as the local copy."""
    local = write_corpus(tmp_path / "large", num_files=150, seed=1)
    print(f"uploaded 151 objects in {upload(local, 'large'):.1f} s")
    LISTED.clear()
    assert_plans_equal(f"s3://{BUCKET}/large", local, tmp_path)
    assert any("continuation-token=" in query for query in LISTED), "the listing took one page"
    remote, copy = (open_plan(tmp_path / name).metadata["dataset"]["files"] for name in ("remote.arrow", "local.arrow"))
    assert_listed_like_local(remote, copy, f"s3://{BUCKET}/large", local)


def test_reading_reports_each_file_as_it_finishes(s3, tmp_path):
    seen: list[str] = []
    lengths = read_lengths(f"{PREFIX}/b", on_file=seen.append)
    assert sorted(seen) == [name for name, _ in lengths.files]
    advances: dict[str, list[int]] = {}

    class Progress:
        def stage(self, description, total):
            advances[description] = []
            return advances[description].append

    build_plan_file(f"{PREFIX}/b", tmp_path / "plan.arrow", PlanConfig(max_tokens=64), progress=Progress())
    assert advances["reading lengths"] == [1] * len(lengths.files)


def test_cli_builds_and_validates_from_a_prefix(s3, tmp_path):
    plan = tmp_path / "plan.arrow"
    runner = CliRunner()
    build = ["build", PREFIX, "-o", str(plan), "--max-tokens", "64", "--world-size", "2", "-q"]
    result = runner.invoke(app, [*build, "--loss-tokens-column", "loss"])
    assert result.exit_code == 0, result.output
    files = open_plan(plan).metadata["dataset"]["files"]
    assert len(files) == 40
    assert all(name.startswith(f"{PREFIX}/") and name.endswith(".parquet") for name, _ in files)
    result = runner.invoke(app, ["validate", str(plan), "--dataset", PREFIX])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output


def test_an_endpoint_in_the_uri_query_is_used_and_not_recorded(s3, monkeypatch):
    host_port = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    lengths = read_lengths(f"{PREFIX}/b?endpoint_override={host_port}&scheme=http")
    assert lengths.fingerprint() == read_lengths(s3 / "b").fingerprint()
    assert lengths.files and all(name.startswith(f"{PREFIX}/b/shard-") for name, _ in lengths.files)
    assert not any("?" in name for name, _ in lengths.files)


def test_one_object_and_objects_given_twice(s3):
    name = f"{PREFIX}/a/shard-00001.parquet"
    assert [file for file, _ in read_lengths(name).files] == [name]
    with pytest.raises(DatasetError, match="shard-00001.parquet: file given twice"):
        find_dataset_files([f"{PREFIX}/a", name])


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://no-such-bucket/lengths", "S3 bucket 'no-such-bucket' does not exist"),
        (f"{PREFIX}/missing", "no such object or prefix"),
        (f"s3://{BUCKET}/notes", r"prefix holds no \*.parquet objects \(1 other object\(s\)\)"),
        (f"{PREFIX}/README.txt", "README.txt: not a readable Parquet file"),
        (f"s3://{BUCKET}/hf", "datasets folder .* read from local disk only"),
        ("hdfs://host/path", "unsupported URI scheme 'hdfs'"),
    ],
)
def test_errors_name_the_uri(s3, uri, message):
    with pytest.raises(DatasetError, match=message) as raised:
        read_lengths(uri)
    assert str(raised.value).startswith(uri)
    assert "\n" not in str(raised.value)


def test_an_unreachable_endpoint_is_a_clear_error(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(DatasetError, match=f"^{PREFIX}: cannot read from S3 .*Could not connect.*AWS_ENDPOINT_URL"):
        read_lengths(PREFIX)


def test_a_path_made_from_a_uri_says_so(tmp_path):
    with pytest.raises(DatasetError, match="no such file or directory; a URI\\? pass it as a str"):
        read_lengths(Path("s3://corpus/lengths"))


def test_gs_uris_go_to_google_cloud_storage():
    # pyarrow's GcsFileSystem, anonymous, at a closed local port: no network, no credentials.
    uri = f"gs://anonymous@corpus/lengths?endpoint_override=127.0.0.1:{free_port()}&scheme=http&retry_limit_seconds=0.2"
    message = r"^gs://anonymous@corpus/lengths\?.*: cannot read from GCS \(google::cloud::Status\(UNAVAILABLE.*"
    message += "GOOGLE_APPLICATION_CREDENTIALS"
    with pytest.raises(DatasetError, match=message):
        read_lengths(uri)


def test_files_in_parallel_fail_with_the_first_bad_file_and_start_no_more():
    started: list[int] = []

    def work(index: int) -> None:
        started.append(index)
        if index == 3:
            time.sleep(0.05)  # the later file fails first
        if index in (3, 5):
            raise ValueError(f"file {index}")

    with pytest.raises(ValueError, match="^file 3$"):
        for_each_file(1_000, work, max_threads=4)
    assert len(started) < 20
    done: list[int] = []
    for_each_file(100, lambda index: None, on_done=done.append, max_threads=4)
    assert sorted(done) == list(range(100))


def test_an_object_of_many_row_groups_is_read_in_pieces_like_its_local_copy(s3, tmp_path, monkeypatch):
    """Row groups of an object read as pieces (`batchplan.formats.dataset_files.PIECE_ROWS`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchplan.formats import dataset_files

    local = tmp_path / "grouped"
    local.mkdir()
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 900, 1_000)
    table = pa.table({"length": lengths, "loss": rng.integers(0, lengths)})
    pq.write_table(table, local / "one.parquet", row_group_size=64)
    upload(local, "grouped")
    monkeypatch.setattr(dataset_files, "PIECE_ROWS", 100)
    assert (
        len(
            dataset_files.pieces_of(
                dataset_files.count_file_rows(dataset_files.find_dataset_files(f"s3://{BUCKET}/grouped"), None)
            )
        )
        == 8
    )
    remote = read_lengths(f"s3://{BUCKET}/grouped", loss_tokens_column="loss")
    assert remote.lengths.tolist() == lengths.tolist()
    assert remote.loss_tokens.tolist() == table["loss"].to_pylist()
