# ruff: noqa: E501  (the MISTAKES table keeps one case a line)
"""The documented commands no other test runs, run as a user types them, and the mistakes a
user makes with the CLI commands the docs show (an outside audit of README.md, docs/*.md and
examples/*/README.md).

Already run elsewhere, and not repeated here: every ``dynstate`` line of a shell block of
README.md and docs/*.md (tests/test_examples.py, exit code; tests/test_docs_output.py, the
console output of docs/cli.md and the ``s3://bucket/`` commands on S3), every python block
(tests/test_readme.py, tests/test_docs_python.py), the examples' commands
(tests/test_examples.py, tests/test_trl.py, tests/test_trl_filter.py, tests/test_trl_ranks.py,
tests/test_verl_commands.py), the demo (tests/test_demo.py), ``python -m dynstate``
(tests/test_cli.py) and ``dynstate serve URL --port 0`` (tests/test_serve.py).

Run here:

* the commands written inline in the prose (README.md's offline commands on S3 and
  ``dynstate inspect checkpoints/global_step_40 --open-store``, ``python -m dynstate.cli …``,
  ``dynstate ls … | head``, ``python -m dynstate.serve DIR --port 0``);
* docs/serve.md's ``dynstate serve`` commands on their documented ports, and README.md's;
* docs/object-stores.md's console command (its endpoint does not resolve here: it must fail as
  the docs say an unreachable endpoint fails);
* the ``python tools/…`` commands of the docs, which take minutes to hours: each option they
  pass must be one the script's ``--help`` lists;
* a table of user mistakes on the CLI (missing store, URL typos, unknown versions and tags, bad
  option values): each must be one ``error:`` line (exit 1) or a click usage error (exit 2)
  naming what is wrong, never a traceback.

Each ``test_defect_*`` test failed on the code before its fix; its docstring says what broke
and why.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_docs_output import _fresh_doc_bucket, _S3Root
from test_examples import DOCS, _argv, _docs_store, _env, documented_cli_commands

from dynstate import Store

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_MD = ROOT / "docs" / "cli.md"
SERVE_MD = ROOT / "docs" / "serve.md"
OBJECT_STORES_MD = ROOT / "docs" / "object-stores.md"
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
BIN = Path(sys.executable).parent
DYNSTATE = str(BIN / "dynstate")

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


# -- helpers ------------------------------------------------------------------------------------


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or _env()
    )


def _python_argv(command: str) -> list[str]:
    """A ``python …`` command as written, run by this environment's interpreter."""
    argv = shlex.split(command)
    assert argv[0] == "python", command
    return [sys.executable, *argv[1:]]


def _inline(doc: Path, pattern: str) -> list[tuple[int, str]]:
    """(line, span) of each inline code span of ``doc`` matching ``pattern``."""
    text = doc.read_text()
    out = []
    for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text):
        if re.fullmatch(pattern, m.group(1)):
            out.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def _fenced(doc: Path) -> list[tuple[int, str]]:
    """(line, command) of each line of the fenced blocks of ``doc`` (continuations joined,
    trailing comments dropped)."""
    text = doc.read_text()
    out = []
    for m in re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        first = text.count("\n", 0, m.start(1)) + 1
        lines = m.group(1).split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if line:
                out.append((first + start, line))
    return out


def _free_port(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _dead_port() -> int:
    """A loopback port nothing listens on (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> Any:
    import json

    with urllib.request.urlopen(url, timeout=60) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


class Served:
    def __init__(self, proc: subprocess.Popen, line: str):
        self.proc = proc
        self.line = line
        match = re.search(r" at (http://\S+?)/?\s", line + " ")
        self.base = match.group(1).rstrip("/") if match else ""


def _default_sigint() -> None:
    # As in a user's shell: a pytest-xdist worker ignores SIGINT, and its children inherit
    # that (uvicorn then restores "ignored" after its shutdown, and the server exits 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _serve(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> Served:
    proc = subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env or _env(), preexec_fn=_default_sigint,
    )  # fmt: skip
    line = proc.stdout.readline() if proc.stdout else ""
    if "serving" not in line:
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"{argv}: no 'serving' line: {line!r}\n{err}")
    return Served(proc, line)


def _stop(served: Served) -> tuple[int, str]:
    if served.proc.poll() is None:
        served.proc.terminate()
    _, err = served.proc.communicate(timeout=30)
    return served.proc.returncode, err


# -- the stores the commands name ---------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs' store at ./runs/run1 (versions 0-50, tag ``ckpt`` on 30), as
    tests/test_examples.py builds it, with the checkpoint ``checkpoints/global_step_40``. Read
    only: the mistakes below fail before writing."""
    root = tmp_path_factory.mktemp("docs")
    _docs_store(root, ["checkpoints/global_step_40"])
    return root


def _checkpoint_of(url: str, path: Path) -> None:
    """The loader state after one batch of 4, over ``url``, as verl writes ``data.pt``."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import VersionedDataset, VersionedSampler

    ds = VersionedDataset(url)
    loader = StatefulDataLoader(ds, batch_size=4, sampler=VersionedSampler(ds, seed=0))
    next(iter(loader))
    path.mkdir(parents=True, exist_ok=True)
    torch.save(loader.state_dict(), path / "data.pt")


@pytest.fixture(scope="module")
def s3_docs(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``s3://bucket/runs/run1`` on the loopback S3 server (the docs' store), and a scratch
    folder holding checkpoints of it at the paths the docs name (checkpoints/global_step_40,
    ckpt/global_step_40)."""
    root = tmp_path_factory.mktemp("s3docs")
    _docs_store(_S3Root(_fresh_doc_bucket(s3_server)), [])  # type: ignore[arg-type]
    for where in ("checkpoints/global_step_40", "ckpt/global_step_40"):
        _checkpoint_of("s3://bucket/runs/run1", root / where)
    return root


# -- inline commands of README.md ---------------------------------------------------------------


def test_readme_inline_commands_are_the_ones_run_here() -> None:
    """README.md's "Then, offline" paragraph names the commands the tests below run (so a
    rewrite of the paragraph fails here instead of leaving them untested)."""
    spans = {span for _, span in _inline(README, r"dynstate .+")}
    assert "dynstate inspect checkpoints/global_step_40 --open-store" in spans, spans
    assert "dynstate serve s3://bucket/runs/run1" in spans, spans
    assert {"dynstate verify …", "dynstate stats …", "dynstate steps …"} <= spans, spans
    assert "dynstate ls s3://bucket/runs/run1" in spans, spans


def test_readme_inspect_open_store_opens_the_recorded_s3_store(s3_docs: Path) -> None:
    """README.md:67 ``dynstate inspect checkpoints/global_step_40 --open-store``: a store not
    on this machine is opened only when asked."""
    plain = _run([DYNSTATE, "inspect", "checkpoints/global_step_40"], s3_docs)
    assert plain.returncode == 0, plain.stderr
    assert "recorded; not opened" in plain.stdout and "pass --open-store" in plain.stdout
    assert "next batch:" not in plain.stdout
    result = _run(_argv("dynstate inspect checkpoints/global_step_40 --open-store", s3_docs),
                  s3_docs)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "training step:    40 (folder global_step_40)" in result.stdout, result.stdout
    assert re.search(r"^store head: +version 50$", result.stdout, re.M), result.stdout
    assert "next batch:" in result.stdout and "note:" not in result.stdout


@pytest.mark.parametrize("command", ["verify", "stats", "steps"])
def test_readme_offline_commands_on_s3(s3_docs: Path, command: str) -> None:
    """README.md:65-66 ``dynstate verify …``, ``dynstate stats …``, ``dynstate steps …`` with
    the paragraph's URL (``s3://bucket/runs/run1``), against S3."""
    result = _run([DYNSTATE, command, "s3://bucket/runs/run1"], s3_docs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    first = result.stdout.splitlines()[0]
    if command == "verify":
        assert first.startswith("ok: s3://bucket/runs/run1: "), result.stdout
    else:
        assert first == "s3://bucket/runs/run1 version 50", result.stdout


def test_readme_serve_s3_command_serves_the_store(s3_docs: Path) -> None:
    """README.md:69 ``dynstate serve s3://bucket/runs/run1``, as written (default port 8000)."""
    if not _free_port(8000):
        pytest.skip("port 8000 is in use here: the command as written cannot bind it")
    served = _serve(_argv("dynstate serve s3://bucket/runs/run1", s3_docs), s3_docs)
    try:
        assert served.base == "http://127.0.0.1:8000", served.line
        info = _get_json(served.base + "/api/store")
        assert info["url"] == "s3://bucket/runs/run1" and info["head"] == 50
    finally:
        _stop(served)


# -- docs/serve.md ------------------------------------------------------------------------------


def _serve_md_commands() -> list[str]:
    return [c for _, c in _fenced(SERVE_MD) if c.startswith("dynstate serve ") and "URL" not in c]


def test_serve_md_local_command_serves_on_port_8000(docs_root: Path) -> None:
    """docs/serve.md:13 ``dynstate serve ./runs/run1  # http://127.0.0.1:8000/``."""
    command = _serve_md_commands()[0]
    assert command == "dynstate serve ./runs/run1", command
    if not _free_port(8000):
        pytest.skip("port 8000 is in use here")
    served = _serve(_argv(command, docs_root), docs_root)
    try:
        assert served.line.startswith("serving ./runs/run1 (head 50) at http://127.0.0.1:8000/")
        assert _get_json(served.base + "/api/store")["head"] == 50
    finally:
        _, err = _stop(served)
    assert "Traceback" not in err, err


def test_serve_md_s3_command_with_checkpoint_and_open(s3_docs: Path, tmp_path: Path) -> None:
    """docs/serve.md:14 ``dynstate serve s3://bucket/runs/run1 --port 8080 --checkpoint
    ckpt/global_step_40 --open``: port 8080, the checkpoint's page answers, and ``--open`` hands
    the store page to the browser (``$BROWSER``, here a script that records its argument)."""
    command = _serve_md_commands()[1]
    assert "--port 8080" in command and "--open" in command, command
    if not _free_port(8080):
        pytest.skip("port 8080 is in use here")
    opened = tmp_path / "opened.txt"
    browser = tmp_path / "browser.sh"
    browser.write_text(f'#!/bin/sh\necho "$1" >> {opened}\n')
    browser.chmod(0o755)
    served = _serve(_argv(command, s3_docs), s3_docs, env={**_env(), "BROWSER": str(browser)})
    try:
        assert served.base == "http://127.0.0.1:8080", served.line
        ckpt = _get_json(served.base + "/api/checkpoints/0")
        assert ckpt["path"] == "ckpt/global_step_40" and ckpt["training_step"] == 40, ckpt
        assert ckpt["store_url"] == "s3://bucket/runs/run1"
        deadline = time.monotonic() + 20
        while not opened.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert opened.read_text().strip() == "http://127.0.0.1:8080/"
    finally:
        _stop(served)


# -- python -m entry points ---------------------------------------------------------------------


def test_cli_md_python_m_dynstate_cli_is_the_same_command(docs_root: Path) -> None:
    """docs/cli.md:14 ``python -m dynstate.cli …``: the same output, the same one-line error."""
    assert any(s == "python -m dynstate.cli …" for _, s in _inline(CLI_MD, r"python .+"))
    for args in (["ls", "./runs/run1", "--json"], ["show", "./runs/run1", "ckpt"]):
        script = _run([DYNSTATE, *args], docs_root)
        module = _run([sys.executable, "-m", "dynstate.cli", *args], docs_root)
        assert module.returncode == script.returncode == 0, module.stderr
        assert module.stdout == script.stdout
    missing = _run([sys.executable, "-m", "dynstate.cli", "ls", "./runs/nope"], docs_root)
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: no dynstate store at ./runs/nope; check the URL")
    assert len(missing.stderr.splitlines()) == 1, missing.stderr


def test_python_m_dynstate_serve_dir_port_0_answers(docs_root: Path) -> None:
    """docs/benchmarks.md:472 ``python -m dynstate.serve DIR --port 0`` (docs/serve.md:35:
    ``python -m dynstate.serve URL …`` is the same command): it prints the port it picked and
    answers."""
    spans = [s for _, s in _inline(BENCHMARKS_MD, r"python -m dynstate\.serve .+")]
    assert spans == ["python -m dynstate.serve DIR --port 0"], spans
    served = _serve(_python_argv(spans[0].replace("DIR", "./runs/run1")), docs_root)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", served.base), served.line
        assert _get_json(served.base + "/api/store")["head"] == 50
    finally:
        _stop(served)


def test_defect_python_m_dynstate_serve_prints_a_traceback(docs_root: Path) -> None:
    """docs/serve.md:35 says ``python -m dynstate.serve URL …`` is the same command as
    ``dynstate serve``, and docs/cli.md:75 that a failure is one ``error:`` line, never a
    traceback. But dynstate/serve/__main__.py calls the bare click command, outside the
    ``dynstate`` group whose ``invoke`` turns errors into one line: a missing store (or an
    unreachable endpoint, a missing bucket, ...) prints a full Python traceback ending in
    ``dynstate.errors.StoreNotFoundError`` instead."""
    script = _run([DYNSTATE, "serve", "./runs/nope", "--port", "0"], docs_root)
    module = _run([sys.executable, "-m", "dynstate.serve", "./runs/nope", "--port", "0"],
                  docs_root)  # fmt: skip
    assert script.returncode == 1 and len(script.stderr.splitlines()) == 1, script.stderr
    assert "Traceback" not in module.stderr, module.stderr
    assert module.returncode == 1
    assert module.stderr == script.stderr


def test_defect_python_m_dynstate_serve_ctrl_c_differs(docs_root: Path) -> None:
    """Ctrl-C, the documented way to stop the server (``(Ctrl-C stops)``), ends
    ``dynstate serve`` with ``error: interrupted`` and exit 130, but ``python -m
    dynstate.serve`` — "the same command" (docs/serve.md:35) — with click's ``Aborted!`` and
    exit 1: the same bypass of the group's error handling as above."""
    results = []
    for argv in ([DYNSTATE, "serve"], [sys.executable, "-m", "dynstate.serve"]):
        served = _serve([*argv, "./runs/run1", "--port", "0"], docs_root)
        time.sleep(0.3)
        served.proc.send_signal(signal.SIGINT)
        try:
            _, err = served.proc.communicate(timeout=30)
        finally:
            if served.proc.poll() is None:
                served.proc.kill()
        results.append((served.proc.returncode, err))
    (script_code, script_err), (module_code, module_err) = results
    assert script_code == 130 and script_err.strip() == "error: interrupted", results
    assert (module_code, module_err.strip()) == (script_code, script_err.strip()), results


# -- docs/cli.md: a reader that goes away -------------------------------------------------------


def test_cli_md_a_reader_that_goes_away_ends_quietly_with_exit_1(tmp_path: Path) -> None:
    """docs/cli.md:84-87: a reader that goes away (``dynstate ls … | head``) ends the command
    quietly, exit status 1 (a failing pipeline under ``set -o pipefail``). The output must
    outgrow the pipe's buffer for the reader to cut it off, so the command is ``head -n`` of a
    store of 20,000 rows (``ls`` of the docs' store fits in the buffer)."""
    store = Store.open(str(tmp_path / "big"), create=True)
    store.append([{"prompt": f"task {i} " + "x" * 40, "answer": str(i)} for i in range(20000)])
    assert any(s == "dynstate ls … | head" for _, s in _inline(CLI_MD, r"dynstate .+"))
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{DYNSTATE} head ./big -n 20000 | head -n 3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env(),
    )  # fmt: skip
    assert result.returncode == 1, result
    assert len(result.stdout.splitlines()) == 3 and result.stderr == "", result


# -- docs/object-stores.md's console command ----------------------------------------------------


def test_object_stores_console_command_fails_as_an_unreachable_endpoint(tmp_path: Path) -> None:
    """docs/object-stores.md:51 names ``https://minio.internal:9000`` (needs that network; not
    run as a success). As written here, where the name does not resolve, it must fail as
    docs/cli.md:80 says an endpoint that does not answer fails: one line, exit 1, within
    seconds (no wall-clock assertion here: the subprocess timeout bounds it)."""
    commands = [c for _, c in _fenced(OBJECT_STORES_MD) if c.startswith("dynstate ")]
    assert len(commands) == 1 and "minio.internal:9000" in commands[0], commands
    try:
        socket.getaddrinfo("minio.internal", 9000)
        pytest.skip("minio.internal resolves here")
    except OSError:
        pass
    env = {k: v for k, v in _env().items() if "proxy" not in k.lower()}
    result = _run(_argv(commands[0], tmp_path), tmp_path, env=env, timeout=60)
    assert result.returncode == 1, result
    assert result.stderr.startswith(
        "error: cannot reach the S3 endpoint https://minio.internal:9000"
    )
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr


# -- the python tools/… commands of the docs ----------------------------------------------------


def _tool_commands() -> list[tuple[str, int, str]]:
    out = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for line, c in _fenced(doc):
            if re.match(r"(\w+=\S+ )*python tools/", c):
                out.append((doc.name, line, c))
        for line, c in _inline(doc, r"python tools/.+"):
            out.append((doc.name, line, c))
    return out


def test_tool_commands_are_found() -> None:
    commands = _tool_commands()
    assert len(commands) >= 40, commands
    scripts = {shlex.split(re.sub(r"^(\w+=\S+ )+", "", c))[1] for _, _, c in commands}
    assert {"tools/bench/bench_cli.py", "tools/soak_store.py", "tools/trl_curriculum.py"} <= scripts


@pytest.fixture(scope="module")
def tool_help() -> dict[str, tuple[int, str]]:
    return {}


@pytest.mark.parametrize(
    "doc,line,command", [pytest.param(*c, id=f"{c[0]}:{c[1]}") for c in _tool_commands()]
)
def test_tool_command_options_exist(
    doc: str, line: int, command: str, tool_help: dict[str, tuple[int, str]]
) -> None:
    """The benchmark, soak and curriculum commands take minutes to hours (not run): each
    option they pass (``[--s3]``'s optional ones included) must be one the script's
    ``--help`` lists, and the script must exist."""
    argv = shlex.split(re.sub(r"\[([^\]]*)\]", r"\1", re.sub(r"^(\w+=\S+ )+", "", command)))
    script = argv[1]
    assert (ROOT / script).is_file(), f"{doc}:{line}: {script} does not exist"
    if script not in tool_help:
        r = _run([sys.executable, script, "--help"], ROOT)
        tool_help[script] = (r.returncode, r.stdout + r.stderr)
    code, text = tool_help[script]
    assert code == 0, f"{doc}:{line}: {script} --help: {text[-2000:]}"
    missing = [
        a.split("=")[0]
        for a in argv[2:]
        if a.startswith("--") and not re.search(re.escape(a.split("=")[0]) + r"(?![\w-])", text)
    ]
    assert not missing, f"{doc}:{line}: {command}: options not in --help: {missing}"


def test_benchmarks_baseline_commit_exists() -> None:
    """docs/benchmarks.md's ``git worktree add /tmp/before b62b346`` names a commit of this
    repository (read only: nothing is added)."""
    commands = [c for _, c in _fenced(BENCHMARKS_MD) if c.startswith("git worktree add")]
    assert commands == ["git worktree add /tmp/before b62b346"], commands
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    if _run(["git", "rev-parse", "--is-shallow-repository"], ROOT).stdout.strip() == "true":
        pytest.skip("a shallow clone holds no history to name the commit in")
    result = _run(["git", "cat-file", "-t", "b62b346"], ROOT)
    assert result.stdout.strip() == "commit", result


# -- user mistakes on the documented CLI commands -----------------------------------------------

NO_STORE = r"no dynstate store at {url}; check the URL \(a store is created by the run"
NO_VERSION = r"version 999 not found in \./runs/run1 \(latest is 50\); `dynstate ls URL` lists"

# (argv, exit code, a pattern the last line of stderr matches): exit 1 is one `error:` line
# naming what is wrong and what to do; exit 2 click's usage error naming the option.
MISTAKES: list[tuple[str, int, str]] = [
    ("ls ./runs/nope", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("ls ./runs/run2", 1, NO_STORE.format(url=r"\./runs/run2")),
    ("ls ./run/run1", 1, NO_STORE.format(url=r"\./run/run1")),
    ("info ./runs/nope --json", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("show ./runs/nope 12", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("show ./runs/run1 999", 1, NO_VERSION),
    ("show ./runs/run1 nosuchtag", 1, r"no tag 'nosuchtag' in \./runs/run1; `dynstate ls` lists"),
    ("show ./runs/run1 99999999999999999999999999", 1, r"version 9+\.\.\. \(26 digits\) not found"),
    ("head ./runs/run1 999", 1, NO_VERSION),
    ("head ./runs/run1 --tail -n 5 --jsonl --columns nope", 2, r"--columns: no column nope .*columns: prompt, answer, n"),
    ("head ./runs/run1 --sort bogus", 2, r"'--sort': 'bogus' is no statistic; one of pass_rate"),
    ("head ./runs/run1 --json --jsonl", 2, r"give either --json or --jsonl, not both"),
    ("head ./runs/run1 --min-pass-rate 1.5", 2, r"'--min-pass-rate': 1\.5 is not in the range"),
    ("head ./runs/run1 -n -1", 2, r"'-n': -1 is not in the range"),
    ("diff ./runs/run1 4 999", 1, NO_VERSION),
    ("diff ./runs/run1 4", 2, r"Missing argument 'V2'"),
    ("diff ./runs/run1 4 5 -n 3", 2, r"-n counts the rows --rows shows; add --rows"),
    ("stats ./runs/run1 999", 1, NO_VERSION),
    ("stats ./runs/run1 --bins 0", 2, r"'--bins': 0 is not in the range"),
    ("stats ./runs/run1 --half-life nan", 2, r"'--half-life': 'nan' is not a finite number"),
    ("stats ./runs/run1 --column nope", 2, r"--column: no column nope"),
    ("steps ./runs/run1 999", 1, NO_VERSION),
    ("steps ./runs/run1 --limit -1", 2, r"'--limit': -1 is not in the range"),
    ("tag ./runs/run1 step-1000 999", 1, NO_VERSION),
    ("tag ./runs/run1 ckpt 5", 1, r"tag 'ckpt' in \./runs/run1 already names version 30; pass --force"),
    ("tag ./runs/run1 42 10", 1, r"invalid tag name '42' for \./runs/run1: use letters, digits"),
    ("tag ./runs/run1 head 10", 1, r"invalid tag name 'head' for \./runs/run1"),
    ("tag ./runs/run1 step-1000 --delete", 1, r"no tag 'step-1000' in \./runs/run1"),
    ("reset ./runs/run1 999", 1, NO_VERSION),
    ("reset ./runs/nope 40", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("verify ./runs/nope --all", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("gc ./runs/nope --keep 5", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("gc ./runs/run1 --keep -1", 2, r"'--keep': -1 is not in the range"),
    ("gc ./runs/run1 --older-than 2x", 2, r"cannot read duration '2x'; write e\.g\. 90, 30s"),
    ("gc ./runs/run1 --keep 5 --older-than 1d", 2, r"give either --keep or --older-than"),
    ("gc ./runs/run1 --grace soon", 2, r"'--grace': cannot read duration 'soon'"),
    ("compact ./runs/run1 --target-size big", 2, r"cannot read size 'big'; write e\.g\. 128MiB"),
    ("compact ./runs/nope", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("export ./runs/run1 999 ./out.parquet", 1, NO_VERSION),
    ("export ./runs/run1 ckpt ./ds --format csv", 2, r"'--format': 'csv' is not one of"),
    ("export ./runs/run1 ckpt ./runs/run1/data/x.parquet", 1, r"cannot export to \./runs/run1/data/x\.parquet: it lies inside the store at \./runs/run1.*choose an OUT outside"),
    ("export ./runs/run1 ckpt ./runs", 1, r"cannot export to \./runs: it contains the store at \./runs/run1"),
    ("plot ./runs/nope growth.png", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("plot ./runs/run1 ./runs/run1/_dynstate/growth.png", 1, r"cannot plot to .*: it lies inside the store"),
    ("inspect checkpoints/global_step_41", 1, r"no checkpoint at checkpoints/global_step_41; pass a global_step_N directory"),
    ("inspect runs/run1", 1, r"runs/run1 holds no data\.pt; pass a verl global_step_N directory"),
    ("inspect checkpoints/global_step_40 --store ./runs/nope", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("inspect checkpoints/global_step_40 -n -2", 2, r"'-n': -2 is not in the range"),
    ("serve ./runs/nope --port 0", 1, NO_STORE.format(url=r"\./runs/nope")),
    ("serve ./runs/run1 --host ''", 2, r"--host: an empty host would listen on every interface"),
    ("serve ./runs/run1 --port 99999", 2, r"'--port': 99999 is not in the range"),
    ("serve ./runs/run1 --port 0 --host no.such.host.invalid", 1, r"cannot listen on 'no\.such\.host\.invalid' port 0: .*; check --host"),
    ("lss ./runs/run1", 2, r"No such command 'lss'"),
    ("ls ./runs/run1 --limt 5", 2, r"No such option '--limt'"),
    ("ls ./runs/run1 --limit five", 2, r"'--limit': 'five' is not a valid integer"),
    ("ls ./runs/run1 --storage-option nokey", 2, r"--storage-option: expected KEY=VALUE, got 'nokey'"),
    ("ls ./runs/run1 --storage-option client_kwargs=[1]", 2, r"client_kwargs must be a JSON object"),
    ("ls ./runs/run1 --storage-option anon=true", 1, r"unknown storage option 'anon' for \./runs/run1; file:// takes"),
    ("ls s4://bucket/runs/run1", 1, r"cannot open s4://bucket/runs/run1: Protocol not known: s4; check the URL"),
    ("ls gcs://bucket/runs/run1", 1, r"gcs://bucket/runs/run1: write gs://bucket/runs/run1"),
    ("ls s3:// --storage-option endpoint_url=http://127.0.0.1:{dead}", 1, r"s3:// is not a store URL; write s3://bucket/prefix"),
    # an http(s):// store's advice names its host and port, not S3's endpoint settings
    ("ls http://127.0.0.1:{dead}/store", 1, r"check that it is up, and the URL's host and port, and retry$"),
    ("ls s3://my-bucket/runs/exp1 --storage-option endpoint_url=http://127.0.0.1:{dead}", 1, r"cannot reach the S3 endpoint http://127\.0\.0\.1:\d+ \(Connection refused\); check that it is up"),
    ("ls s3://my-bucket/runs/exp1 --storage-option endpoint_url=http://user:pw-secret-1@127.0.0.1:{dead}", 1, r"the S3 endpoint 'http://\*\*\*@127\.0\.0\.1:\d+' has credentials in it; pass them as AWS_ACCESS_KEY_ID"),
    ("ls s3://my-bucket/runs/exp1 --storage-option endpoint_url=htp:/oops", 2, r"endpoint_url must be an http:// or https:// URL"),
]  # fmt: skip


@pytest.mark.parametrize("command,code,pattern", [pytest.param(*m, id=m[0][:60]) for m in MISTAKES])
def test_cli_mistake_is_one_typed_line(
    docs_root: Path, command: str, code: int, pattern: str
) -> None:
    """A user's mistake on a documented command: the documented exit code, no traceback, and
    for exit 1 exactly one ``error:`` line on stderr naming the store, version or option and
    what to do; for exit 2 click's usage error naming the option."""
    command = command.replace("{dead}", str(_dead_port()))
    env = {k: v for k, v in _env().items() if "proxy" not in k.lower()}
    env.update(AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="example-secret-key")
    result = _run(_argv(f"dynstate {command}", docs_root), docs_root, env=env, timeout=60)
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out
    assert result.returncode == code, out
    lines = result.stderr.strip().splitlines()
    assert lines, out
    if code == 1:
        assert len(lines) == 1 and lines[0].startswith("error: "), out
        assert re.search(pattern, lines[0]), out
    else:
        assert lines[0].startswith("Usage: dynstate"), out
        assert lines[-1].startswith("Error: ") and re.search(pattern, lines[-1]), out
    assert "pw-secret-1" not in out and "example-secret-key" not in out


def test_mistakes_leave_the_docs_store_as_it_was(docs_root: Path) -> None:
    """None of the mistakes above wrote to the store (head, tags)."""
    store = Store.open(str(docs_root / "runs" / "run1"))
    assert store.head == 50 and store.tags() == {"ckpt": 30}


# -- defects found by the mistakes --------------------------------------------------------------


@pytest.mark.parametrize("name,text", [
    ("trainer_state.json", '{"global_step": 40}\n'),
    ("latest_checkpointed_iteration.txt", "40\n"),
])  # fmt: skip
def test_defect_inspect_of_a_text_file_is_misdiagnosed(
    tmp_path: Path, name: str, text: str
) -> None:
    """``dynstate inspect PATH`` given a text file a checkpoint folder holds next to the
    checkpoints (verl's ``latest_checkpointed_iteration.txt``, TRL's ``trainer_state.json``)
    says the file "holds Python objects other than plain types and tensors": torch's
    weights-only unpickler refuses the text's first byte as an unknown opcode ("Unsupported
    operand"), and dynstate/loading/checkpoint.py ``_why`` reads every "Weights only load
    failed" as a pickle of Python objects. The file is not a ``torch.save`` file at all, which is
    what the message should say (as it does for a truncated ``data.pt``)."""
    (tmp_path / name).write_text(text)
    result = _run([DYNSTATE, "inspect", name], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "other than plain types and tensors" not in result.stderr, result.stderr
    assert "not a torch.save file" in result.stderr, result.stderr


def test_defect_plot_into_a_missing_folder_leaks_its_temporary_name(docs_root: Path) -> None:
    """``dynstate plot URL OUT.png`` with OUT in a folder that does not exist fails with
    ``cannot write the plot to OUT: [Errno 2] No such file or directory:
    '<folder>/.<uuid>.png.tmp'``: the raw OSError of the temporary file (a name the user never
    chose) and no word on what to do, where ``export`` to a missing folder simply creates it
    (docs/cli.md:525: OUT "follows export's rules"). Expected: the plot written (as export
    does), or one line naming OUT's missing folder and saying to create it."""
    out = "./no-such-folder/growth.png"
    result = _run([DYNSTATE, "plot", "./runs/run1", out], docs_root)
    assert "Traceback" not in result.stderr, result.stderr
    if result.returncode == 0:
        assert (docs_root / out).is_file()
        return
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert ".tmp" not in result.stderr and "[Errno" not in result.stderr, result.stderr


def test_export_into_a_missing_folder_creates_it(docs_root: Path) -> None:
    """The behaviour ``plot`` is compared with above."""
    result = _run([DYNSTATE, "export", "./runs/run1", "ckpt", "./new-folder/rows.parquet"],
                  docs_root)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (docs_root / "new-folder" / "rows.parquet").is_file()


def test_defect_credentials_in_a_store_url_are_not_refused_first(tmp_path: Path) -> None:
    """docs/object-stores.md:361-364: a store URL with credentials in it
    (``s3://KEY:SECRET@bucket/prefix``) "is refused with InvalidDataError before anything is
    sent", as ``Store.open`` does. The CLI (dynstate/cli/options.py ``open_store``) first
    runs its endpoint preflight (a TCP connect to the endpoint, or to AWS S3 when none is set)
    and only then opens the store: with the endpoint down, or no network, the user is told
    ``cannot reach the S3 endpoint …`` — to fix the network — while the real mistake, the
    credentials in the URL, is never named. (The same order hides a query string or ``..``
    in the URL: ``is not a store URL`` only once the endpoint answers.)"""
    env = {k: v for k, v in _env().items() if "proxy" not in k.lower()}
    env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{_dead_port()}",
               AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="example-secret-key")  # fmt: skip
    url = "s3://AKIAEXAMPLE:se/cr+et-value-99@bucket/prefix"
    result = _run([DYNSTATE, "ls", url], tmp_path, env=env, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result
    assert "se/cr+et-value-99" not in result.stdout + result.stderr
    assert "has credentials in the URL" in result.stderr, result.stderr


# -- the inventory: every documented dynstate command is run somewhere --------------------------


def test_every_fenced_dynstate_command_is_run_by_some_test() -> None:
    """Each ``dynstate`` line of a fenced block of README.md and docs/*.md is either one
    tests/test_examples.py runs (``documented_cli_commands``), a synopsis, or one run in this
    file (serve's, object-stores.md's console command)."""
    run_elsewhere = {c for _, c in documented_cli_commands()}
    run_here = {*_serve_md_commands(), *(c for _, c in _fenced(OBJECT_STORES_MD)
                                         if c.startswith("dynstate "))}  # fmt: skip
    unrun = []
    for doc in DOCS:
        for line, c in _fenced(doc):
            c = c.removeprefix("$ ")
            if not c.startswith("dynstate ") or re.search(r"\[|\bURL\b|COMMAND|…", c):
                continue
            if c not in run_elsewhere and c not in run_here:
                unrun.append(f"{doc.name}:{line}: {c}")
    assert not unrun, unrun


def test_defect_verl_make_data_help_writes_a_folder_named_help(tmp_path: Path) -> None:
    """examples/verl/README.md:16 ``python examples/verl/make_data.py data/arith``. The script
    reads ``sys.argv[1]`` as the output folder with no argument parsing, so a user asking
    ``python examples/verl/make_data.py --help`` (or ``-h``) gets 2,200 tasks written to a new
    folder named ``--help`` in the current directory, exit 0, and no usage. Expected: a usage
    line (as every ``tools/`` script and examples/trl/train.py give), nothing written."""
    script = ROOT / "examples" / "verl" / "make_data.py"
    result = _run([sys.executable, str(script), "--help"], tmp_path)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == [], f"--help wrote {written} into the working directory"
    assert "usage" in (result.stdout + result.stderr).lower(), result


def test_readme_trl_block_names_real_api() -> None:
    """README.md's "With TRL" python block is run by no test (tests/test_readme.py runs the
    first block only; tests/test_docs_python.py, which runs docs/trl.md's version of it, reads
    docs/*.md only). It is a fragment (the model, config, tokenizer, reward and generator are
    the reader's): checked statically as tests/test_docs_python.py checks the docs' blocks —
    it compiles, and every dynstate name and argument binds to the real signature."""
    from test_docs_python import Block, check_api, compiled

    text = README.read_text()
    section = text[text.index("## With TRL") :]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m is not None, "README.md's With TRL section has no python block"
    line = text.count("\n", 0, text.index("## With TRL") + m.start(1)) + 1
    b = Block("../README.md", line, m.group(1))
    compiled(b)
    assert check_api(b, -1) == []
    assert "DynstateGRPOTrainer" in b.code and "last_checkpoint" in b.code
