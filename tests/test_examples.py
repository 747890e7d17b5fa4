"""Every example's documented commands, and every ``dynstate`` command of README.md and
docs/*.md, run as a user would type them (issue 24).

The commands are parsed out of the markdown, so a page that drifts from the code (an option
renamed, one torchrun refuses) fails here. The only change made to a command is its scratch
folder (``/tmp/ddp`` becomes the test's own; ``s3://bucket/`` the local store), so that runs
never share state.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dynstate import DynstateError, Store, lineage

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# Where each example's commands are run. The verl example's training commands need GPUs:
# test_verl_commands.py runs them up to verl's GPU check, and the rest as written.
COVERED = {
    "ddp": "test_ddp_readme_commands_kill_and_resume_at_another_world_size",
    "trl": "tests/test_trl.py",
    "verl": "tests/test_verl_commands.py",
}


def documented_commands(readme: Path) -> list[str]:
    """The shell commands of a markdown file's ``bash`` blocks: continuation lines joined,
    comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                commands.append(line)
    return commands


def _argv(command: str, scratch: Path) -> list[str]:
    argv = shlex.split(command.replace("/tmp/ddp", str(scratch)))
    # The console scripts of the environment running the tests (a user has them on PATH).
    local = Path(sys.executable).parent / argv[0]
    return [str(local) if local.exists() else argv[0], *argv[1:]]


def _env() -> dict[str, str]:
    # Wide enough that `dynstate ls` prints whole cells (pytest may export a narrow COLUMNS).
    return {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


def test_every_example_is_run_by_a_test() -> None:
    assert sorted(p.name for p in EXAMPLES.iterdir() if (p / "README.md").exists()) == sorted(
        COVERED
    )
    for name, runner in COVERED.items():
        assert documented_commands(EXAMPLES / name / "README.md"), name
        if runner.startswith("test_"):
            assert callable(globals()[runner])


def test_ddp_commands_pass_torchrun_s_own_parser() -> None:
    """torchrun parses every option on its command line, the script's included: an option
    that abbreviates several of torchrun's (``--log``) is refused before any rank starts."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    runs = [c for c in documented_commands(EXAMPLES / "ddp" / "README.md") if "torchrun" in c]
    assert len(runs) == 2
    for command in runs:
        args = parser.parse_args(shlex.split(command)[1:])
        assert args.training_script == "examples/ddp/train.py"
        assert "--store" in args.training_script_args


def _kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL torchrun's ranks (each in its own session) and torchrun, all at once."""
    ranks = psutil.Process(proc.pid).children(recursive=True)
    for p in ranks:
        p.send_signal(signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(ranks, timeout=30)
    return [p.pid for p in ranks]


def _head(url: str) -> int:
    try:
        return Store.open(url).refresh()
    except DynstateError:  # not created yet
        return -1


@pytest.mark.slow
def test_ddp_readme_commands_kill_and_resume_at_another_world_size(tmp_path) -> None:
    commands = documented_commands(EXAMPLES / "ddp" / "README.md")
    first, second, ls = (_argv(c, tmp_path) for c in commands)
    assert first[0].endswith("torchrun") and "--nproc-per-node" in first
    assert second[0].endswith("torchrun") and ls[0].endswith("dynstate")
    url = str(tmp_path / "store")

    out1 = open(tmp_path / "first.out", "w+")  # noqa: SIM115
    proc = subprocess.Popen(first, cwd=ROOT, stdout=out1, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + 240
        # Import, then the rounds of steps 0..5: a checkpoint (every 2 steps) was written.
        while _head(url) < 8 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "first.out").read_text()
        assert len(_kill_tree(proc)) == 2  # kill -9 the ranks, mid-run
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    text = (tmp_path / "first.out").read_text()
    assert "torchrun: error" not in text, text
    starts = [line for line in text.splitlines() if line.startswith("ddp example:")]
    fresh = f"ddp example: fresh start at step 0 of 40, world size 2, store version 1, {url}"
    assert starts == [fresh]
    killed_head = _head(url)
    assert killed_head < 1 + 40  # killed before the end

    result = subprocess.run(
        second, cwd=ROOT, capture_output=True, text=True, timeout=420, env=_env()
    )
    assert result.returncode == 0, result.stdout + result.stderr
    starts = [line for line in result.stdout.splitlines() if line.startswith("ddp example:")]
    assert len(starts) == 1, result.stdout
    match = re.fullmatch(
        r"ddp example: resumed at step (\d+) of 40 from (\S+) \(step (\d+), written at world "
        r"size 2\), world size 3, store version (\d+)(?: \(rolled back to version (\d+), "
        r"dropping versions? [\d-]+\))?, (\S+)",
        starts[0],
    )
    assert match, starts[0]
    at, path, saved, version, back, where = match.groups()
    assert int(at) == int(saved) + 1 and path == str(tmp_path / "ckpt" / "latest.pt")
    assert where == url
    if back is None:  # killed right after a checkpoint: nothing to roll back
        assert int(version) == killed_head
    else:  # the killed run committed rounds after its checkpoint: a reset drops them
        assert int(back) == 1 + int(at) and int(version) == killed_head + 1

    # The policy of the commands drew the steps, before and after the world-size change: the
    # checkpoint names it, and every step's round recorded its rows' outcomes.
    import torch

    ckpt = torch.load(tmp_path / "ckpt" / "latest.pt", weights_only=True)
    assert ckpt["world"] == 3
    assert ckpt["sampler"]["select"] == {
        "policy": "learnability",
        "params": {"floor": 0.01, "neutral": 0.25},
    }
    records = Store.open(url).outcome_records().to_pylist()
    assert sorted({r["step"] for r in records}) == list(range(40))
    # the first epoch (steps 0-4 at world size 2, 8 of the 40 rows a step) drew with replacement:
    # without a policy its permutation trains each row once
    first = [r["row"] for r in records if r["step"] < 5]
    assert len(first) == 40 and len(set(first)) < 40, first

    # One round per step, each once, in order, along the head's lineage.
    store = Store.open(url)
    steps = [store.commit_record(v).meta.get("step") for v in reversed(lineage(store))]
    assert [s for s in steps if s is not None] == list(range(40))

    listing = subprocess.run(ls, cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env())
    assert listing.returncode == 0, listing.stderr
    assert f"store:    {url}" in listing.stdout and "ddp-example" in listing.stdout


# -- the `dynstate` commands of README.md and docs/*.md ----------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Commands not run here, and why; everything else in a shell block must run as written.
NOT_RUN = {
    "serve": "a server that runs until stopped (tests/test_serve.py starts it)",
}


def documented_cli_commands() -> list[tuple[str, str]]:
    """(file, command) for each ``dynstate`` command line in a shell block (bash, console or
    untyped) of README.md and docs/*.md, in document order: continuations joined, ``$ ``
    prompts and trailing comments dropped; synopses (``URL``, ``[OPTIONS]``) are not
    commands."""
    out = []
    for doc in DOCS:
        for lang, block in re.findall(r"```(\w*)\n(.*?)```", doc.read_text(), flags=re.S):
            if lang not in ("", "bash", "console", "sh", "shell"):
                continue
            for line in re.sub(r"\\\n\s*", "", block).splitlines():
                line = line.strip().removeprefix("$ ").split(" # ", 1)[0].split("  #", 1)[0]
                if not line.startswith("dynstate ") or re.search(r"\[|\bURL\b|COMMAND|…", line):
                    continue
                out.append((doc.name, line.strip()))
    return out


def _docs_store(root: Path, checkpoints: list[str]) -> None:
    """The store the docs' examples talk about: ./runs/run1 with versions 0-50 (an import, then
    one round of prompt/answer/n rows per step), the tag ``ckpt``, and the checkpoints they
    inspect, written as verl writes ``data.pt`` (the StatefulDataLoader's state)."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import VersionedDataset, VersionedSampler

    def row(prompt: str, answer: int, n: int) -> dict:
        return {"prompt": prompt, "answer": str(answer), "n": n}

    store = Store.open(str(root / "runs" / "run1"), create=True)
    store.append([row(f"{i}+1=?", i + 1, i) for i in range(40)])
    for step in range(49):
        rows = [row(f"{step}*{k}=?", step * k, 100 * step + k) for k in range(step % 3)]
        store.append(rows, meta={"step": step, "generator": "docs"})
        if step == 28:
            store.tag("ckpt", store.head)
    ds = VersionedDataset(str(root / "runs" / "run1"))
    loader = StatefulDataLoader(ds, batch_size=4, sampler=VersionedSampler(ds, seed=0))
    it = iter(loader)
    for path in checkpoints:
        next(it)
        file = root / path if path.endswith(".pt") else root / path / "data.pt"
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(loader.state_dict(), file)


@pytest.mark.slow  # ~20 CLI processes, a few seconds each
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_docs_cli_commands_run_as_written(tmp_path) -> None:
    """Every ``dynstate`` command the README and docs show, in their order, on the store they
    describe; ``s3://bucket/`` URLs are pointed at the local store (their options are what
    drifts), other S3 URLs name endpoints of the reader's own."""
    commands = documented_cli_commands()
    _docs_store(tmp_path, [shlex.split(c)[2] for _, c in commands if " inspect " in f" {c} "])
    assert len(commands) >= 20, commands
    ran = 0
    for doc, command in commands:
        name = shlex.split(command)[1]
        if name in NOT_RUN or ("s3://" in command and "s3://bucket/" not in command):
            continue
        argv = _argv(command.replace("s3://bucket/", "./"), tmp_path)
        result = subprocess.run(
            argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env()
        )
        assert result.returncode == 0, f"{doc}: {command}\n{result.stdout}{result.stderr}"
        ran += 1
    assert ran >= 20
