"""README.md's "In Python" block runs as written: the one loader recipe (rows as a list of
dicts, each with its `_dynstate_row`), outcomes recorded by those labels, a crash after a
checkpoint and a resume that reads exactly the uninterrupted run's batches. The block is
executed as it stands in the README; only its store URL and the user's own functions
(checkpointing, reward, generator) are supplied here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import dynstate

README = Path(__file__).resolve().parent.parent / "README.md"


def _block() -> str:
    text = README.read_text()
    section = text[text.index("## In Python") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README.md's In Python section has no python block"
    return match.group(1)


class Crash(Exception):
    pass


def _run(url: str, checkpoints: list[dict[str, Any]], crash_after: int | None) -> list[list[int]]:
    """Execute the README block once; returns the store rows of the batches it trained."""
    seen: list[list[int]] = []

    def load_latest_checkpoint() -> dict[str, Any] | None:
        return checkpoints[-1] if checkpoints else None

    def save_checkpoint(ckpt: dict[str, Any]) -> None:
        checkpoints.append(ckpt)
        if crash_after is not None and ckpt["step"] == crash_after:
            raise Crash

    def reward(batch: list[dict[str, Any]]) -> list[float]:
        return [float(int(r["answer"]) % 3 == 0) for r in batch]

    def generate(batch: list[dict[str, Any]], scores: list[float]) -> list[dict[str, Any]]:
        seen.append([r["_dynstate_row"] for r in batch])
        return [
            {
                "prompt": r["prompt"] + " (again)",
                "answer": r["answer"],
                "_dynstate_source": [r["_dynstate_row"]],
            }
            for r, s in zip(batch, scores, strict=True)
            if s == 0.0
        ][:2]

    code = _block().replace('"s3://bucket/runs/run1"', repr(url))
    scope = {
        "load_latest_checkpoint": load_latest_checkpoint,
        "save_checkpoint": save_checkpoint,
        "reward": reward,
        "generate": generate,
    }
    try:
        exec(compile(code, str(README), "exec"), scope)
    except Crash:
        pass
    return seen


def _seed(url: str) -> None:
    store = dynstate.Store.open(url, create=True)
    store.append(
        [
            {"prompt": f"What is {i}+{i}?", "answer": str(2 * i), "_dynstate_source": None}
            for i in range(40)
        ]
    )


def test_the_readme_block_runs_records_outcomes_by_row_and_resumes_exactly(tmp_path):
    reference_url, url = str(tmp_path / "reference"), str(tmp_path / "crashed")
    _seed(reference_url)
    _seed(url)
    reference = _run(reference_url, [], crash_after=None)
    assert len(reference) == 5  # an epoch of 40 rows in batches of 8

    checkpoints: list[dict[str, Any]] = []
    before = _run(url, checkpoints, crash_after=2)
    after = _run(url, checkpoints, crash_after=None)
    assert before + after == reference

    # The outcomes landed on the rows they were scored on: each recorded row's score is the
    # reward of that row as the shards hold it (read whole with pyarrow, the oracle).
    store = dynstate.Store.open(url)
    snap = store.snapshot()
    oracle = pa.concat_tables(
        [pq.read_table(Path(url) / s.path) for s in snap.shards], promote_options="default"
    )
    records = store.outcome_records().to_pylist()
    assert sorted(r["row"] for r in records) == sorted(row for batch in reference for row in batch)
    for r in records:
        answer = int(oracle.column("answer")[r["row"]].as_py())
        assert r["score"] == float(answer % 3 == 0)
