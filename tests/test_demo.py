"""The README's demo (tools/demo.py) end to end at small sizes: a real training subprocess is
SIGKILLed, resumed from its checkpoint and compared with an uninterrupted run; plus the demo's
own checks."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynstate import InvalidDataError, Store, StoreExistsError, lineage

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
from demo import (  # noqa: E402
    DemoConfig,
    compare,
    generate,
    initial_tasks,
    pass_rates,
    prepare_dir,
    score,
    shorten_listing,
    solve_chance,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--steps", "12", "--step-time", "0.1"]


def run_demo(args: list[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(TOOLS / "demo.py"), *args]
    # Wide enough that `dynstate ls` prints whole cells (pytest may export a narrow COLUMNS).
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env, cwd=cwd)


def verdict(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("resume exact:")]
    assert len(lines) == 1, f"no verdict line:\n{proc.stdout}\n{proc.stderr}"
    return lines[0]


def check_outputs(out: Path, run_url: str, ref_url: str, proc) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdict(proc).startswith("resume exact: OK"), proc.stdout
    assert (out / "growth.png").read_bytes()[:8] == PNG_MAGIC
    run, ref = Store.open(run_url), Store.open(ref_url)
    assert run.snapshot().to_arrow().equals(ref.snapshot().to_arrow())
    assert run.snapshot().num_rows > DemoConfig().initial_tasks  # the generator added rows
    # The crashed run's rounds after its checkpoint were rolled back by a reset commit and
    # are listed by `dynstate ls --all` as abandoned.
    # (The kill lands at a random instant: the process may have checkpointed once more before
    # it, and then there is nothing to roll back.)
    summary = json.loads((out / "summary.json").read_text())
    resets = [c for c in run.versions() if c.op == "reset"]
    assert len(resets) == (1 if summary["rolled_back_steps"] else 0)
    assert all("rollback_from" in reset.meta for reset in resets)
    assert ("abandoned" in proc.stdout) == bool(resets)
    assert f"dynstate ls {run_url} --all" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"dynstate serve {run_url}")  # the next thing to try
    # Lineage by the reserved column: every generated task names the row it varies, a row
    # of an earlier version of the lineage (row numbers are stable), never itself.
    table = run.snapshot().to_arrow().to_pylist()
    generated = [(i, t) for i, t in enumerate(table) if t["origin_step"] >= 0]
    assert generated and all(
        t["_dynstate_source"] is None for t in table[: len(table) - len(generated)]
    )
    # Outcomes: the files of the head's lineage read with pyarrow, against what the training
    # processes logged (the crashed run's steps up to its checkpoint, then the resumed run's).
    raw = raw_outcomes(run)
    trained = [
        s for s in read_jsonl(out / "run/stream.jsonl") if s["step"] <= summary["checkpoint_step"]
    ]
    trained += read_jsonl(out / "run/stream-resumed.jsonl")
    cfg = DemoConfig(**summary["config"])
    logged = [
        (row["_dynstate_row"], s["step"], score(row, s["step"], cfg))
        for s in trained
        for row in s["rows"]
    ]
    assert raw == logged and [sc for s in trained for sc in s["scores"]] == [x[2] for x in raw]
    assert run.outcome_records().select(["row", "step", "score"]).to_pylist() == [
        {"row": r, "step": st, "score": sc} for r, st, sc in raw
    ]
    assert summary["outcome_records"] == len(raw) and 0 < sum(x[2] for x in raw) < len(raw)
    # `dynstate stats` at the end of the demo saw them (not "no outcomes recorded").
    stats = proc.stdout.split(f"$ dynstate stats {run_url}", 1)[1]
    assert "no outcomes recorded" not in proc.stdout
    assert re.search(rf"^outcomes:\s+{len(raw)}\b", stats, re.M), stats
    assert "pass rate of trained rows:" in stats
    # The pass-rate chart: each group's rate is the share of successes in the raw records,
    # and the stand-in policy, which gets better with every step, passes more at the end.
    width = -(-cfg.steps // 12)
    expected = []
    for first in range(0, cfg.steps, width):
        group = [x[2] for x in raw if first <= x[1] < first + width]
        expected.append([[first, min(cfg.steps, first + width) - 1], sum(group) / len(group)])
    assert [[g["steps"], g["pass_rate"]] for g in summary["pass_rates"]] == expected
    third = len(expected) // 3
    early, late = (
        sum(rate for _, rate in groups) for groups in (expected[:third], expected[-third:])
    )
    assert late > early, expected
    for (first, last), rate in expected:
        assert (
            f"steps {first:>3}-{last:<3} {'#' * round(40 * rate):<40} {rate:>4.0%}" in proc.stdout
        )
    # Each generated task names a row the policy failed on the step that generated it.
    failed = {(r, st) for r, st, sc in raw if sc == 0.0}
    for i, task in generated:
        (source,) = task["_dynstate_source"]
        assert 0 <= source < i and (source, task["origin_step"]) in failed
    # The sampler drew by learnability: the checkpoint names the policy, and rows the policy
    # always or never solved so far (weight floor 0.01 against up to 0.25) were drawn far less
    # often than their share of the rows.
    ckpt = torch.load(out / "run/ckpt/global_step_9/data.pt", weights_only=True)
    (state,) = find_key(ckpt, "sampler_state")
    assert state["select"] == {"policy": "learnability", "params": {"floor": 0.01, "neutral": 0.25}}
    floor_share, floor_drawn = curriculum(run, raw, trained, cfg)
    assert floor_share > 0.2 and floor_drawn < floor_share / 3, (floor_share, floor_drawn)
    # The evidence: both runs' batches for the steps after the checkpoint, side by side.
    ckpt = json.loads((out / "summary.json").read_text())["checkpoint_step"]
    evidence = proc.stdout.split("batches after the checkpoint", 1)[1].splitlines()[2:]
    assert evidence[0].split()[0] == str(ckpt + 1) and evidence[0].endswith("yes")
    assert not any(line.endswith("NO") for line in evidence[:4])
    assert not any(c.op == "reset" for c in ref.versions())
    # The killed run really ran past its checkpoint, and the resumed run took over from it.
    killed = [json.loads(line)["step"] for line in (out / "run/stream.jsonl").open()]
    resumed = [json.loads(line)["step"] for line in (out / "run/stream-resumed.jsonl").open()]
    ckpt_step = summary["checkpoint_step"]
    assert summary["ok"] and summary["crash_after_step"] > ckpt_step
    assert max(killed) > ckpt_step and resumed[0] == ckpt_step + 1 and resumed[-1] == 11
    assert summary["rolled_back_steps"] == list(range(ckpt_step + 1, max(killed) + 1)) or (
        # SIGKILL can land between a round's commit and its stream line
        summary["rolled_back_steps"] == list(range(ckpt_step + 1, max(killed) + 2))
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def raw_outcomes(store: Store) -> list[tuple[int, int, float]]:
    """The plain way: ``(row, step, score)`` of every outcome file the appends of the head's
    lineage name, read whole with pyarrow, oldest first (a reset's outcome list is its
    target's, already on the way)."""
    out: list[tuple[int, int, float]] = []
    for version in reversed(lineage(store)):
        record = store.commit_record(version)
        if record.op != "append" or not record.outcomes:
            continue
        for entry in record.outcomes["add"]:
            table = pq.read_table(os.path.join(store.url, entry["path"]))
            out += zip(
                *(table.column(c).to_pylist() for c in ("row", "step", "score")), strict=True
            )
    return out


def find_key(obj: Any, key: str) -> list[Any]:
    if isinstance(obj, dict):
        found = [obj[key]] if key in obj else []
        return found + [v for value in obj.values() for v in find_key(value, key)]
    return []


def curriculum(
    store: Store, raw: list[tuple[int, int, float]], trained: list[dict[str, Any]], cfg: DemoConfig
) -> tuple[float, float]:
    """For the steps whose weights come from recorded outcomes: the share of the drawable rows
    that Learnability weighs at its floor (tried, pass rate 0 or 1: what a uniform draw would
    give them), and the share of the draws that landed on them. Which outcomes a step's
    weights see follows docs/selection.md's rule: in epoch mode those of the steps before the
    epoch (whose length is its pinned rows over the batch size), in mix mode those of the
    steps up to ``step - lag``; the rows drawable are the rows of that version."""
    rows_after = {c.meta["step"]: c.num_rows for c in map(store.commit_record, lineage(store))
                  if c.op == "append"}  # fmt: skip
    seen_before: dict[int, tuple[int, int]] = {}  # step -> (outcomes of steps < this, rows)
    if cfg.mode == "epoch":
        start, rows = 0, rows_after[-1]
        while start < cfg.steps:
            end = start + math.ceil(rows / cfg.batch_size)
            seen_before.update({s: (start, rows) for s in range(start, min(end, cfg.steps))})
            start, rows = end, rows_after.get(end - 1, 0)
    else:
        seen_before = {s: (s - cfg.lag + 1, rows_after[s - cfg.lag]) for s in range(cfg.steps)
                       if s - cfg.lag >= -1}  # fmt: skip
    shares, drawn, on_floor = [], 0, 0
    for step in trained:
        if step["step"] not in seen_before:
            continue
        bound, rows = seen_before[step["step"]]
        tried: dict[int, list[float]] = {}
        for row, s, sc in raw:
            if s < bound:
                tried.setdefault(row, []).append(sc)
        floor = {r for r, scores in tried.items() if len(set(scores)) == 1}
        if not floor:
            continue
        assert all(row["_dynstate_row"] < rows for row in step["rows"][: cfg.batch_size])
        shares.append(len(floor) / rows)
        drawn += len(step["rows"])
        on_floor += sum(row["_dynstate_row"] in floor for row in step["rows"])
    assert shares, "no step drew by recorded outcomes"
    return sum(shares) / len(shares), on_floor / drawn


@pytest.mark.slow
def test_demo_crash_and_resume_local_epoch_with_workers(tmp_path) -> None:
    out = tmp_path / "demo"
    proc = run_demo(["--dir", str(out), "--workers", "1", "--seed", "3", *SMALL])
    check_outputs(out, str(out / "store"), str(out / "reference-store"), proc)


@pytest.mark.slow
def test_demo_mix_mode_reuses_its_own_dir(tmp_path) -> None:
    out = tmp_path / "demo"
    prepare_dir(str(out))  # a previous demo's directory is replaced, not refused
    (out / "stale").write_text("from a previous demo")
    args = ["--dir", str(out), "--workers", "0", "--mode", "mix", "--seed", "1", *SMALL]
    proc = run_demo(args, cwd=tmp_path)
    assert not (out / "stale").exists()
    check_outputs(out, str(out / "store"), str(out / "reference-store"), proc)


@pytest.mark.slow
@pytest.mark.s3
def test_demo_on_loopback_s3(tmp_path) -> None:
    out = tmp_path / "demo"
    proc = run_demo(["--dir", str(out), "--s3", "--workers", "1", *SMALL])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert verdict(proc).startswith("resume exact: OK")
    assert "s3://dynstate-demo/store" in proc.stdout
    assert (out / "growth.png").read_bytes()[:8] == PNG_MAGIC
    assert not (out / "store").exists()  # the store lived on S3, only checkpoints are local
    # The server does not flood the terminal, and the summary stays valid after it is gone:
    # it names local copies of the stores.
    assert len(proc.stderr.splitlines()) < 5, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["s3"]["urls"]["run"] == "s3://dynstate-demo/store"
    copy = Store.open(summary["urls"]["run"])
    assert copy.refresh() == summary["head_version"]
    assert copy.snapshot().num_rows == summary["head_rows"]
    assert copy.outcome_records().num_rows == summary["outcome_records"] > 0
    assert "no outcomes recorded" not in proc.stdout and "pass rate of trained rows:" in proc.stdout


def test_demo_refuses_a_directory_it_did_not_make(tmp_path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(StoreExistsError, match="not made by the dynstate demo"):
        prepare_dir(str(tmp_path))
    assert os.listdir(tmp_path) == ["precious.txt"]
    proc = run_demo(["--dir", str(tmp_path), *SMALL])
    assert proc.returncode == 1 and proc.stderr.startswith("error: ")
    assert os.listdir(tmp_path) == ["precious.txt"]


def test_demo_rejects_too_few_steps() -> None:
    with pytest.raises(InvalidDataError, match="--steps"):
        DemoConfig(steps=6, ckpt_every=5).check()


def _write_stream(path: Path, steps: range, rows_of) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for step in steps:
            fh.write(json.dumps({"step": step, "rows": rows_of(step)}) + "\n")


def test_compare_finds_the_first_differing_batch(tmp_path) -> None:
    def rows(step: int) -> list[dict]:
        return [{"id": f"r{step}-{k}"} for k in range(2)]

    cfg = DemoConfig(steps=8, ckpt_every=3)
    _write_stream(tmp_path / "ref/stream.jsonl", range(8), rows)
    _write_stream(tmp_path / "run/stream.jsonl", range(5), rows)  # killed after step 4
    _write_stream(tmp_path / "run/stream-resumed.jsonl", range(3, 8), rows)  # ckpt at step 2
    assert compare(str(tmp_path / "ref"), str(tmp_path / "run"), 2, cfg) is None
    # A line cut short by the SIGKILL is not a step.
    with (tmp_path / "run/stream.jsonl").open("a") as fh:
        fh.write('{"step": 5, "ro')
    assert compare(str(tmp_path / "ref"), str(tmp_path / "run"), 2, cfg) is None

    def swapped(step: int) -> list[dict]:
        return rows(step)[::-1] if step == 6 else rows(step)

    _write_stream(tmp_path / "run/stream-resumed.jsonl", range(3, 8), swapped)
    problem = compare(str(tmp_path / "ref"), str(tmp_path / "run"), 2, cfg)
    assert problem is not None and problem.startswith("step 6:")
    _write_stream(tmp_path / "run/stream-resumed.jsonl", range(4, 8), rows)  # step 3 missing
    assert "expected 0..7" in compare(str(tmp_path / "ref"), str(tmp_path / "run"), 2, cfg)


def test_generator_varies_only_failed_tasks_deterministically() -> None:
    cfg = DemoConfig(seed=5)
    tasks = initial_tasks(cfg).to_pylist()
    assert tasks == initial_tasks(cfg).to_pylist()
    assert all(t["_dynstate_source"] is None for t in tasks)  # the import has no sources
    # Batch rows as the demo's dataset gives them: with their row number in the store.
    rows = [{**t, "_dynstate_row": i} for i, t in enumerate(tasks)]
    failed = [t for t in rows if score(t, 3, cfg) == 0.0]
    assert failed and len(failed) < len(tasks)
    new = generate(failed, 3, cfg).to_pylist()
    assert new == generate(failed, 3, cfg).to_pylist()
    assert 0 < len(new) <= cfg.max_new
    assert {tuple(t["_dynstate_source"]) for t in new} <= {(t["_dynstate_row"],) for t in failed}
    for task in new:
        assert task["prompt"] == f"what is {task['a']}+{task['b']}?"
        assert task["answer"] == task["a"] + task["b"] and task["origin_step"] == 3
    assert generate([], 3, cfg).num_rows == 0  # an empty round is still committed


def test_compare_flags_reads_from_abandoned_versions(tmp_path) -> None:
    store = Store.open(str(tmp_path / "store"), create=True)
    for step in range(-1, 4):
        store.append([{"id": f"r{step}"}], meta={"step": step})  # versions 1..5
    store.reset(3)  # steps 2 and 3 (versions 4, 5) abandoned; head 6
    cfg = DemoConfig(steps=4, ckpt_every=1)
    for name, steps in (("ref/stream.jsonl", range(4)), ("run/stream.jsonl", range(2))):
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps({"step": s, "rows": [], "versions": [1, 3]}) + "\n"
                                for s in steps))  # fmt: skip
    resumed = tmp_path / "run/stream-resumed.jsonl"
    resumed.write_text("".join(json.dumps({"step": s, "rows": [], "versions": [1, v]}) + "\n"
                               for s, v in ((2, 6), (3, 4))))  # fmt: skip
    problem = compare(str(tmp_path / "ref"), str(tmp_path / "run"), 1, cfg, store)
    assert problem is not None and problem.startswith("step 3: the sampler read version(s) [4]")
    assert compare(str(tmp_path / "ref"), str(tmp_path / "run"), 1, cfg) is None


def test_stand_in_policy_is_a_pure_function_that_gets_better() -> None:
    cfg = DemoConfig(seed=2)
    task = {**initial_tasks(cfg).to_pylist()[0], "_dynstate_row": 0}
    # The same row and step score the same in any process: what makes the resume exact.
    assert all(score(task, step, cfg) == score(task, step, cfg) for step in range(60))
    assert {score(task, step, cfg) for step in range(60)} == {0.0, 1.0}
    chances = [solve_chance(90, step) for step in range(60)]
    assert chances == sorted(chances) and chances[0] < 0.01 and chances[-1] > 0.99
    assert solve_chance(30, 0) == 0.5 and solve_chance(20, 0) > solve_chance(40, 0)
    # Over many rows, the share solved follows the chance.
    rows = [{**task, "_dynstate_row": i, "answer": 60} for i in range(2000)]
    for step in (0, 20, 40):
        share = sum(score(r, step, cfg) for r in rows) / len(rows)
        assert abs(share - solve_chance(60, step)) < 0.04


def test_pass_rates_group_the_steps() -> None:
    records = pa.table({"row": [0, 1, 2, 3, 4], "step": [0, 0, 5, 6, 11],
                        "score": [1.0, 0.0, 0.0, 0.75, 0.5]})  # fmt: skip
    # 12 steps in groups of 1; a score above 0.5 is a success, as in dynstate's statistics.
    assert pass_rates(records, DemoConfig(steps=12)) == [
        (0, 0, 0.5), (5, 5, 0.0), (6, 6, 1.0), (11, 11, 0.0)
    ]  # fmt: skip
    assert pass_rates(records, DemoConfig(steps=24)) == [(0, 1, 0.5), (4, 5, 0.0), (6, 7, 1.0),
                                                         (10, 11, 0.0)]  # fmt: skip


def test_shorten_listing_keeps_the_rollback_and_says_what_it_left_out() -> None:
    header = ["store:    x", "", "version  op      added  status"]
    rows = [f"{v:>7}  append  {'abandoned' if v in (20, 21) else ''}" for v in range(40, 0, -1)]
    rows[40 - 22] = f"{22:>7}  reset→19"
    text = "\n".join([*header, *rows, "(shards left out)"]) + "\n"
    short = shorten_listing(text).splitlines()
    versions = [int(line[:7]) for line in short if line[:7].strip().isdigit()]
    assert versions == [40, 39, 38, 23, 22, 21, 20, 19, 2, 1]
    gaps = [line for line in short if line.lstrip().startswith("...")]
    assert len(gaps) == 2 and "(14 versions left out" in gaps[0] and "(16 versions" in gaps[1]
    assert short[:3] == header and short[-1] == "(shards left out)"
    assert (
        shorten_listing("\n".join([*header, *rows[:8]]) + "\n")
        == "\n".join([*header, *rows[:8]]) + "\n"
    )  # a short listing is left whole
