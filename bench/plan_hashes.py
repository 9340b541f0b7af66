"""A hash of every plan of the guarantee matrix (tests/test_guarantees.py), to show that a
change to the planner or the writer leaves plans byte for byte as they were.

    python -m bench.plan_hashes > before.txt        # on the old commit (or its checkout)
    python -m bench.plan_hashes --compare before.txt

Each line is ``case-id sha256-of-the-plan-file`` (the file as `write_plan` writes it, lengths
fingerprint included); ``--compare`` prints the cases whose hash differs and exits 1 if any.
``--rows`` hashes the rows alone (every column of every record batch, not the metadata): the
plans' content, to compare across a change of what the file carries besides it.
A few more cases cover what the matrix does not: a sequence-length warmup, a ramp-up with
drop_last, compute balance, a loss-tokens column with split samples, a plan directory, and
the demo mixture (data/mixture.yaml) in a few configurations.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _extra_cases(make_case):
    return [
        make_case(
            "lognormal",
            max_tokens=2048,
            mode="pack",
            world_size=8,
            seqlen_warmup_min=256,
            seqlen_warmup_tokens=2_000_000,
            epochs=2,
            oversize="split",
        ),
        make_case(
            "lognormal",
            max_tokens=2048,
            mode="pack",
            world_size=8,
            micro_batches=2,
            rampup_start=8 * 2048,
            rampup_tokens=3_000_000,
            drop_last=True,
            epochs=2,
            oversize="split",
        ),
        make_case(
            "sharegpt_dialogues",
            max_tokens=8192,
            mode="pack",
            world_size=16,
            hidden_size=4096,
            balance="compute",
            oversize="split",
            epochs=2,
        ),
        make_case("heavy_tail", True, max_tokens=1024, mode="pack", world_size=4, oversize="drop", micro_batches=3),
    ]


def plan_hashes(rows: bool = False) -> dict[str, str]:
    """``{case id: sha256 of its plan file}`` (``rows``: of its rows) over the matrix and the
    extra cases."""
    sys.path.insert(0, str(TESTS))
    from conftest import build_and_write
    from test_guarantees import CASES, lengths_of, loss_column_for, make_case

    from batchplan.config import PlanConfig

    hashes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES + _extra_cases(make_case):
            try:
                config = case.config
            except TypeError:  # an option this version does not know
                continue
            lengths = lengths_of(case.dataset)
            loss = loss_column_for(lengths) if case.loss_column else None
            path = Path(tmp) / "plan.arrow"
            try:
                build_and_write(lengths, config, path, loss_tokens=loss)
            except Exception as error:  # a case the planner refuses: its message is its hash
                hashes[case.id] = "error:" + hashlib.sha256(str(error).encode()).hexdigest()[:16]
                continue
            hashes[case.id] = _rows_hash([path]) if rows else hashlib.sha256(path.read_bytes()).hexdigest()
        hashes["directory"] = _directory_hash(Path(tmp), PlanConfig)
        hashes.update(_mixture_hashes(Path(tmp), PlanConfig))
    return hashes


MIXTURE = Path(__file__).resolve().parent.parent / "data" / "mixture.yaml"
_MIXTURE_CASES = {
    "mixture-pack": dict(max_tokens=8192, world_size=4, micro_batches=2, oversize="split"),
    "mixture-pad": dict(max_tokens=8192, mode="pad", world_size=4, micro_batches=2, oversize="truncate"),
    "mixture-token-steps": dict(max_tokens=8192, world_size=8, tokens_per_step=300_000, epochs=2, oversize="split"),
    "mixture-rampup": dict(
        max_tokens=8192,
        world_size=4,
        micro_batches=4,
        rampup_start=4 * 8192,
        rampup_tokens=20_000_000,
        oversize="split",
    ),
    "mixture-compute": dict(
        max_tokens=8192, world_size=3, micro_batches=1, hidden_size=4096, balance="compute", oversize="drop", epochs=3
    ),
}


def _mixture_hashes(tmp: Path, config_type) -> dict[str, str]:
    """The rows of the demo mixture's plan in a few configurations (an error's message hashed
    in place of a case the planner refuses)."""
    from batchplan.operations.build_mixture import build_mixture_plan_file

    hashes = {}
    for case, options in _MIXTURE_CASES.items():
        path = tmp / f"{case}.arrow"
        try:
            build_mixture_plan_file(MIXTURE, path, config_type(**options))
        except Exception as error:
            hashes[case] = "error:" + hashlib.sha256(str(error).encode()).hexdigest()[:16]
            continue
        hashes[case] = _rows_hash([path])
    return hashes


def _directory_hash(tmp: Path, config_type) -> str:
    """The rows of every epoch file of a plan directory built from a synthetic dataset (not
    the files' bytes: their metadata names the temporary dataset's path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchplan import build_plan_file

    lengths = np.random.default_rng(7).lognormal(5.5, 1.0, 50_000).clip(1, 4096).astype(np.int32)
    pq.write_table(pa.table({"length": lengths}), tmp / "data.parquet")
    config = config_type(max_tokens=4096, world_size=8, epochs=3, oversize="split")
    build_plan_file(tmp / "data.parquet", tmp / "plan-dir", config, layout="directory")
    return _rows_hash(sorted((tmp / "plan-dir").rglob("epoch-*.arrow")))


def _rows_hash(paths: list[Path]) -> str:
    """SHA-256 of the rows of Arrow files, one after another (no metadata)."""
    import pyarrow as pa

    digest = hashlib.sha256()
    for path in paths:
        table = pa.ipc.open_file(path).read_all().replace_schema_metadata(None)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        digest.update(sink.getvalue().to_pybytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="a file this command wrote before")
    parser.add_argument("--rows", action="store_true", help="hash the rows alone, not the files")
    args = parser.parse_args()
    hashes = plan_hashes(args.rows)
    if args.compare is None:
        for case, digest in hashes.items():
            print(case, digest)
        return
    before = dict(line.split() for line in args.compare.read_text().splitlines() if line.strip())
    differ = [case for case in hashes if case in before and before[case] != hashes[case]]
    missing = sorted(set(before) - set(hashes))
    for case in differ:
        print(f"differs: {case}")
    print(
        f"{len(hashes) - len(differ)} of {len(hashes)} plans identical; {len(differ)} differ; {len(missing)} not built"
    )
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
