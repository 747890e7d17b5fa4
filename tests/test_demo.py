"""The README's demo (tools/demo.py) end to end at small sizes: a real training subprocess is
SIGKILLed, resumed from its checkpoint and compared with an uninterrupted run; plus the demo's
own checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynstate import InvalidDataError, Store, StoreExistsError

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
from demo import DemoConfig, compare, generate, initial_tasks, policy_solves, prepare_dir  # noqa: E402

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
    for i, task in generated:
        (source,) = task["_dynstate_source"]
        assert 0 <= source < i and table[source]["answer"] > 40  # a task the policy failed
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
    failed = [t for t in rows if not policy_solves(t, step=3)]
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
