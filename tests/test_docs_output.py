"""The output docs/cli.md shows is the output the commands print, and the ``s3://bucket/``
commands of README.md and docs/*.md run against S3.

tests/test_examples.py runs every documented ``dynstate`` command as written, but checks only
its exit code, and points ``s3://bucket/`` at a local folder. Here:

* each console example of docs/cli.md (a ``$ dynstate …`` line, then the output the page
  shows) is run as written on a store rebuilt to the history the example describes, and its
  output is compared with the page's, parsed from docs/cli.md when the test runs. Only what
  differs from run to run is masked (times, sizes, ids, hashes, the scratch folder); a ``...``
  line of the page stands for any lines.
* every command that names ``s3://bucket/…`` runs against the suite's loopback S3 server
  (tests/conftest.py), in which a bucket named ``bucket`` is created, so the URLs are used as
  written (no rewriting), on the store tests/test_examples.py's ``_docs_store`` builds.
"""

from __future__ import annotations

import io
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_examples import DOCS, NOT_RUN, _argv, _docs_store, _env, documented_cli_commands

from dynstate import Store

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "cli.md"
DOC_BUCKET = "bucket"  # the bucket the docs' S3 URLs name


def _run_as_written(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` through the installed ``dynstate``, in ``cwd``, as a user types it."""
    return subprocess.run(
        _argv(command, cwd), cwd=cwd, capture_output=True, text=True, timeout=120, env=_env()
    )


# -- parsing the console examples of docs/cli.md -----------------------------------------------


@dataclass(frozen=True)
class ConsoleExample:
    command: str  # as typed after the prompt, continuations joined
    expected: tuple[str, ...]  # the lines the page shows after it
    line: int  # where the command is in docs/cli.md (1-based)


def console_examples(doc: Path = CLI_MD) -> list[ConsoleExample]:
    """Each ``$ dynstate …`` line of a fenced block of ``doc`` whose first line is a prompt,
    with the lines up to the next prompt or the end of the block as its output."""
    text = doc.read_text()
    out = []
    for fence in re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        lines = fence.group(1).splitlines()
        if not lines or not lines[0].startswith("$ "):
            continue
        first = text.count("\n", 0, fence.start(1)) + 1
        i = 0
        while i < len(lines):
            start = i
            command = lines[i].removeprefix("$ ")
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            expected = []
            while i < len(lines) and not lines[i].startswith("$ "):
                expected.append(lines[i])
                i += 1
            while expected and not expected[-1].strip():
                expected.pop()
            if command.startswith("dynstate "):
                out.append(ConsoleExample(command.strip(), tuple(expected), first + start))
    return out


# -- masking what differs from run to run -------------------------------------------------------

MASKS = [
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?Z?"), "<time>"),
    (re.compile(r"\b\d+(?:\.\d+)? (?:B|KiB|MiB|GiB)\b"), "<size>"),
    (re.compile(r"\(\d[\d,]* bytes\)"), "(<bytes>)"),
    (re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|s)\b"), "<duration>"),
    (re.compile(r"\(id [0-9a-f]+…?\)"), "(id <id>)"),
    (re.compile(r"\b[0-9a-f]{32}-[0-9a-f]{32}\b"), "<name>"),
    (re.compile(r"\b[0-9a-f]{12,64}\b"), "<hash>"),
]

# Parts of an example's output that depend on a history its page does not give, masked for that
# example only (and why). Keep this short: everything else is compared as shown.
LOOSE: dict[str, list[tuple[str, str]]] = {}

# Console examples not run here, and why (their stores cannot be rebuilt as the page shows).
SKIPPED: dict[str, str] = {}


def _normal(lines: list[str] | tuple[str, ...], scratch: Path, loose: list[str]) -> list[str]:
    out = []
    for line in lines:
        line = line.replace(str(scratch), "<tmp>")
        for pattern, repl in MASKS:
            line = pattern.sub(repl, line)
        for pattern in loose:
            line = re.sub(pattern, "<loose>", line)
        # Column widths follow the masked values: compare the cells, not the padding.
        out.append(" ".join(line.split()))
    return out


def _matches(expected: list[str], actual: list[str]) -> bool:
    """Line for line, a ``...`` line of ``expected`` standing for any number of lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(_matches(expected[1:], actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and _matches(expected[1:], actual[1:])


# -- the stores the console examples describe ---------------------------------------------------


def _arith(lo: int, hi: int) -> list[dict]:
    return [{"prompt": f"what is {i} + {i}?", "answer": str(2 * i)} for i in range(lo, hi)]


def _reset_history(root: Path, s3: Any) -> None:
    """ls --all and diff: four rounds of gen-a (3 rows each, tag ``ckpt`` on version 2), a
    reset to version 2, then a round of gen-b (2 rows)."""
    store = Store.open(str(root / "runs" / "run1"), create=True)
    for step in range(4):
        store.append(_arith(3 * step, 3 * step + 3), meta={"step": step, "generator": "gen-a"})
        if step == 1:
            store.tag("ckpt", store.head)
    store.reset(2)
    store.append(_arith(12, 14), meta={"step": 4, "generator": "gen-b"})


def _scored(root: Path, s3: Any) -> None:
    """stats and head --sort: 10 rows, rows 0-4 scored at steps 0-3 (rows 0-2 always fail,
    row 3 passes at steps 1 and 3, row 4 always passes), one outcomes-only round a step."""
    store = Store.open(str(root / "runs" / "run1"), create=True)
    store.append(_arith(0, 10))
    scores = {0: [0, 0, 0, 0], 1: [0, 0, 0, 0], 2: [0, 0, 0, 0], 3: [0, 1, 0, 1], 4: [1, 1, 1, 1]}
    for step in range(4):
        outcomes = [{"row": r, "step": step, "score": float(s[step])} for r, s in scores.items()]
        store.append([], meta={"step": step}, outcomes=outcomes)


def _chat(root: Path, s3: Any) -> None:
    """head --added: an import of 6 chat prompts, then rounds of 3 two-line prompts at steps
    0 and 1 (``n`` = 50 (step + 1) + k)."""

    def prompt(text: str) -> list[dict]:
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]

    store = Store.open(str(root / "runs" / "run1"), create=True)
    store.append([{"prompt": prompt(f"seed {i}"), "n": i} for i in range(6)])
    for step in range(2):
        rows = [
            {"prompt": prompt(f"task {step}-{k}\nmore"), "n": 50 * (step + 1) + k} for k in range(3)
        ]
        store.append(rows, meta={"step": step})


def _tagged_floor(root: Path, s3: Any) -> None:
    """gc --keep 5: 26 one-row rounds (versions 1-26), tags ``old`` on version 4 and ``mid`` on
    version 10, and a file of the user's own in data/."""
    store = Store.open(str(root / "runs" / "run1"), create=True)
    for step in range(26):
        store.append(_arith(step, step + 1), meta={"step": step})
    store.tag("old", 4)
    store.tag("mid", 10)
    (root / "runs" / "run1" / "data" / "NOTES.txt").write_text("notes of my own\n")


def _remote_checkpoint(root: Path, s3: Any) -> None:
    """inspect of a checkpoint from elsewhere: the loader state after one batch of 2 of a
    seed-1 sampler over 10 rows of s3://bucket/runs/run1, in ckpt/global_step_7/data.pt."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import VersionedDataset, VersionedSampler

    url = _fresh_doc_bucket(s3) + "runs/run1"
    Store.open(url, create=True).append(_arith(0, 10))
    ds = VersionedDataset(url)
    loader = StatefulDataLoader(
        ds, batch_size=2, sampler=VersionedSampler(ds, seed=1, batch_size=2)
    )
    next(iter(loader))
    (root / "ckpt" / "global_step_7").mkdir(parents=True)
    torch.save(loader.state_dict(), root / "ckpt" / "global_step_7" / "data.pt")


Builder = Callable[[Path, Any], None]
# The store each console example runs on, by its command as the page shows it; the builders
# named ``needs_s3`` write to the loopback S3 server.
STORES: dict[str, Builder] = {
    "dynstate ls ./runs/run1 --all": _reset_history,
    "dynstate diff ./runs/run1 4 6": _reset_history,
    "dynstate head ./runs/run1 --sort pass_rate --min-attempts 1 -n 3": _scored,
    "dynstate stats ./runs/run1 --top 2 --bins 4": _scored,
    "dynstate head ./runs/run1 3 --added --columns prompt,n": _chat,
    "dynstate gc ./runs/run1 --keep 5": _tagged_floor,
    "dynstate inspect ckpt/global_step_7": _remote_checkpoint,
}
NEEDS_S3 = {_remote_checkpoint}


def _example_params() -> list[Any]:
    params = []
    for ex in console_examples():
        marks = []
        if STORES.get(ex.command) in NEEDS_S3:
            marks.append(pytest.mark.s3)
        if ex.command in SKIPPED:
            marks.append(pytest.mark.skip(reason=SKIPPED[ex.command]))
        name = shlex.split(ex.command)[1]
        params.append(pytest.param(ex, marks=marks, id=f"{name}@cli.md:{ex.line}"))
    return params


def test_console_examples_are_found() -> None:
    """The parser finds the page's console examples (so the test below never passes for
    lack of them), each a ``dynstate`` command with output."""
    examples = console_examples()
    assert len(examples) >= 7, examples
    assert all(ex.expected for ex in examples), examples
    names = {shlex.split(ex.command)[1] for ex in examples}
    assert {"ls", "head", "diff", "stats", "gc", "inspect"} <= names, names
    assert set(SKIPPED) <= {ex.command for ex in examples}, "a skip for an example not shown"


@pytest.mark.slow  # one CLI process per example, a second or two each
@pytest.mark.parametrize("example", _example_params())
def test_cli_md_console_output_is_what_the_command_prints(
    example: ConsoleExample, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Each console example of docs/cli.md, run as written on the store it describes, prints
    the lines the page shows, up to times, sizes, ids and hashes."""
    builder = STORES.get(example.command)
    assert builder is not None, (
        f"docs/cli.md:{example.line}: no store for the example {example.command!r}: add a "
        "builder to STORES (or, with a reason, to SKIPPED)"
    )
    s3 = request.getfixturevalue("s3_server") if builder in NEEDS_S3 else None
    builder(tmp_path, s3)
    result = _run_as_written(example.command, tmp_path)
    assert result.returncode == 0, f"{example.command}\n{result.stdout}{result.stderr}"
    loose = [pattern for pattern, _ in LOOSE.get(example.command, [])]
    expected = _normal(example.expected, tmp_path, loose)
    actual = _normal(result.stdout.splitlines(), tmp_path, loose)
    matched = _matches(expected, actual)
    assert matched, (
        f"docs/cli.md:{example.line}: $ {example.command}\n"
        + "--- the page shows\n"
        + "\n".join(example.expected)
        + "\n--- the command prints\n"
        + result.stdout
    )


# -- the s3://bucket/ commands, against S3 ------------------------------------------------------


def _s3_client(s3: Any) -> Any:
    import boto3

    env = s3.env()
    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


def _fresh_doc_bucket(s3: Any) -> str:
    """``s3://bucket/`` on the loopback server, created if missing and emptied."""
    client = _s3_client(s3)
    if DOC_BUCKET not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        s3.create_bucket(DOC_BUCKET)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=DOC_BUCKET):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=DOC_BUCKET, Key=obj["Key"])
    return f"s3://{DOC_BUCKET}/"


class _S3Root(str):
    """A root for ``_docs_store`` that joins with ``/`` as a URL does (a Path would fold
    ``s3://`` into ``s3:/``)."""

    def __truediv__(self, part: str) -> _S3Root:
        return _S3Root(f"{self.rstrip('/')}/{part}")


def documented_s3_commands() -> list[tuple[str, str]]:
    """(file, command) for each documented ``dynstate`` command naming ``s3://bucket/``: those of
    the shell blocks (as tests/test_examples.py finds them), then the whole commands written
    inline (in backticks) in README.md and docs/*.md, in document order, each once."""
    found = [(doc, c) for doc, c in documented_cli_commands() if f"s3://{DOC_BUCKET}/" in c]
    for doc in DOCS:
        for span in re.findall(r"(?<!`)`(dynstate [^`\n]+)`(?!`)", doc.read_text()):
            if f"s3://{DOC_BUCKET}/" in span and not re.search(r"\[|\bURL\b|COMMAND|…", span):
                found.append((doc.name, span.strip()))
    seen: set[str] = set()
    return [(doc, c) for doc, c in found if not (c in seen or seen.add(c))]


def _facts(command: str, stdout: str, s3: Any, before: Store) -> None:
    """What the docs say each S3 command does, checked on its output and on the bucket;
    ``before`` is the store as it was before the command ran."""
    argv = shlex.split(command)
    name, url = argv[1], argv[2]
    after = Store.open(url)
    if name == "ls":
        assert f"store:    {url}" in stdout, stdout
        assert f"head:     version {before.head}:" in stdout and "tags: ckpt" in stdout, stdout
    elif name == "show":
        assert re.search(rf"^version: +{argv[3]}$", stdout, flags=re.M), stdout
        assert re.search(r"^op: +append$", stdout, flags=re.M), stdout
    elif name == "verify":  # exit 0: no problem found
        assert "problem:" not in stdout and stdout.startswith(f"ok: {url}: "), stdout
    elif name == "gc":  # --keep 50: the floor moves to the 50th newest version, with --yes only
        keep = int(argv[argv.index("--keep") + 1])
        floor = before.head - keep + 1
        assert f"floor: version {floor}, set by --keep {keep}" in stdout, stdout
        assert after.floor == (floor if "--yes" in argv else before.floor), stdout
    elif name == "compact":  # 256MiB holds every shard of the head: one shard, same rows
        assert after.head == before.head + 1 and len(after.snapshot().shards) == 1, stdout
        assert after.snapshot().to_arrow().equals(before.snapshot().to_arrow())
    elif name == "export":
        import pyarrow.parquet as pq

        bucket, key = argv[4].removeprefix("s3://").split("/", 1)
        body = _s3_client(s3).get_object(Bucket=bucket, Key=key)["Body"].read()
        assert pq.read_table(io.BytesIO(body)).equals(before.snapshot(int(argv[3])).to_arrow())
    else:
        raise AssertionError(f"no facts known for {command!r}: add them to _facts")


@pytest.mark.slow  # a 50-version store on S3, then ~7 CLI processes
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_docs_s3_bucket_commands_run_against_s3(s3_server: Any, tmp_path: Path) -> None:
    """Every ``s3://bucket/`` command of README.md and docs/*.md, run as written against a
    loopback S3 server holding the bucket ``bucket`` and the docs' store at runs/run1 (built as
    ``_docs_store`` builds it locally), exits 0 and does what the docs say it does."""
    commands = documented_s3_commands()
    assert len(commands) >= 6, commands
    _docs_store(_S3Root(_fresh_doc_bucket(s3_server)), [])  # type: ignore[arg-type]
    ran = []
    for doc, command in commands:
        if shlex.split(command)[1] in NOT_RUN:
            continue
        before = Store.open(shlex.split(command)[2])
        result = _run_as_written(command, tmp_path)
        assert result.returncode == 0, f"{doc}: {command}\n{result.stdout}{result.stderr}"
        _facts(command, result.stdout, s3_server, before)
        ran.append(shlex.split(command)[1])
    assert {"ls", "show", "verify", "gc", "compact", "export"} <= set(ran), ran
