"""Hostile command-line input: every bad input is one clean `error:` line (exit 1, or 2 for a
usage error) that names the URL, version or flag and says what to do, and leaves the store
byte for byte as it was. Each test here names one property the installed CLI must hold."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dynstate import Store, paths
from dynstate.cli import cli


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env={"COLUMNS": "120", **(env or {})})


def tree(root: str) -> str:
    """A hash of every file and folder name under ``root`` and every file's bytes."""
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        h.update(os.path.relpath(folder, root).encode() + b"/\0")
        for name in sorted(files):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def build(url: str) -> Store:
    """Versions 1-3 appends with steps 0-2; 2 and 3 record outcomes."""
    store = Store.open(url, create=True)
    store.append([{"prompt": "a", "n": 1}, {"prompt": "b", "n": 2}], meta={"step": 0})
    store.append(
        [{"prompt": "c", "n": 3}],
        meta={"step": 1},
        outcomes=[{"row": 0, "step": 1, "score": 1.0}, {"row": 1, "step": 1, "score": 0.0}],
    )
    store.append(
        [{"prompt": "d", "n": 4}],
        meta={"step": 2},
        outcomes=[{"row": 2, "step": 2, "score": 0.3}],
    )
    return store


@pytest.fixture
def store_url(tmp_path) -> str:
    url = str(tmp_path / "run")
    build(url)
    return url


def assert_clean(result, code: int) -> None:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.stderr


# -- VERSION arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["show", "head", "stats", "reset"])
@pytest.mark.parametrize("version", ["\u00b9", "\u2460"])  # superscript one, circled one
def test_a_version_of_non_ascii_digits_is_an_unknown_tag(store_url, command, version) -> None:
    """A VERSION written with digits other than 0-9 (isdigit() is true for them, int() refuses
    them) is an unknown tag: one `error:` line naming the version and the store, saying how
    to list versions and tags, never a Python ValueError; the store is unchanged."""
    before = tree(store_url)
    result = invoke(command, store_url, version)
    assert_clean(result, 1)
    assert "ValueError" not in result.stderr and "int()" not in result.stderr
    assert version in result.stderr and store_url in result.stderr
    assert "dynstate ls" in result.stderr
    assert tree(store_url) == before


def test_a_version_of_arabic_indic_digits_is_not_version_one(store_url) -> None:
    """Only the digits 0-9 make a version number: `show URL \\u0661` (ARABIC-INDIC DIGIT
    ONE) is an unknown tag, not version 1."""
    result = invoke("show", store_url, "\u0661")
    assert_clean(result, 1)
    assert "\u0661" in result.stderr


# -- a damaged store ------------------------------------------------------------------------


def test_a_missing_commit_record_in_the_kept_range_is_reported_as_damage(store_url) -> None:
    """A commit record missing between the gc floor and the head is damage, not garbage
    collection: the error names the version and points to `dynstate verify` / a restore, and
    never says the version was collected (no gc ever ran) or to use a later version."""
    os.remove(os.path.join(store_url, "_dynstate", "log", f"{1:020d}.json"))
    before = tree(store_url)
    for args in (("show", store_url, "1"), ("head", store_url, "1"), ("diff", store_url, "1", "3")):
        result = invoke(*args)
        assert_clean(result, 1)
        assert "garbage collection" not in result.stderr, result.stderr
        assert "version 1" in result.stderr and store_url in result.stderr
        assert "verify" in result.stderr or "restore" in result.stderr
    assert tree(store_url) == before


def test_a_regular_file_as_url_is_no_store_there(tmp_path) -> None:
    """A URL that names a regular file is reported as holding no store (naming the path),
    not as an I/O failure to retry."""
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    result = invoke("ls", str(path))
    assert_clean(result, 1)
    assert str(path) in result.stderr
    assert "retry" not in result.stderr and "Errno" not in result.stderr, result.stderr
    assert path.read_text() == "hello\n"


# -- numeric options ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, flag",
    [
        (("head", "{url}", "--min-pass-rate", "nan"), "--min-pass-rate"),
        (("head", "{url}", "--max-pass-rate", "nan"), "--max-pass-rate"),
        (("stats", "{url}", "--success-above", "nan"), "--success-above"),
        (("stats", "{url}", "--success-above", "inf"), "--success-above"),
        (("stats", "{url}", "--half-life", "0"), "--half-life"),
        (("stats", "{url}", "--half-life", "-1"), "--half-life"),
        (("stats", "{url}", "--half-life", "nan"), "--half-life"),
        (("compact", "{url}", "--target-size", "0.0001"), "--target-size"),
    ],
)
def test_a_malformed_number_is_a_usage_error_naming_the_flag(store_url, args, flag) -> None:
    """A NaN, an infinity, or a value below an option's range is a usage error (exit 2) that
    names the flag as typed, not the library's Python argument name; nothing is written."""
    before = tree(store_url)
    result = invoke(*(a.format(url=store_url) for a in args))
    assert_clean(result, 2)
    assert flag in result.stderr, result.stderr
    python_name = flag.lstrip("-").replace("-", "_")
    assert f"{python_name} for" not in result.stderr, result.stderr
    assert tree(store_url) == before


def test_json_and_jsonl_together_are_a_usage_error(store_url) -> None:
    """`head --json --jsonl` asks for two output formats at once: a usage error (exit 2)
    naming both flags, not one of them silently."""
    result = invoke("head", store_url, "--json", "--jsonl")
    assert_clean(result, 2)
    assert "--json" in result.stderr and "--jsonl" in result.stderr
    assert result.stdout == ""


# -- tag names ------------------------------------------------------------------------------


def test_head_is_not_accepted_as_a_tag_name(store_url) -> None:
    """`head` always means the latest version on the command line, so `tag URL head V` is
    refused (naming `head`), never creating a tag no command can address; the store is
    unchanged."""
    before = tree(store_url)
    result = invoke("tag", store_url, "head", "1")
    assert result.exit_code != 0, result.stdout
    assert "Traceback" not in result.stderr
    assert "head" in result.stderr
    assert tree(store_url) == before


# -- URLs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["?x=1", "#frag"])
def test_a_query_or_fragment_in_a_url_is_named_as_the_problem(store_url, suffix) -> None:
    """A store URL with a query string or fragment is refused saying so; the error never
    claims that there is no store at the shown (redacted) URL when that URL holds one."""
    url = f"file://{store_url}{suffix}"
    result = invoke("ls", url)
    assert_clean(result, 1)
    assert f"no dynstate store at file://{store_url};" not in result.stderr, result.stderr
    assert "query" in result.stderr or "fragment" in result.stderr, result.stderr


@pytest.mark.parametrize("url", ["s3://", "s3:///run1", "s3://bucket//run1"])
def test_an_s3_url_without_a_bucket_is_refused_before_connecting(url) -> None:
    """An s3:// URL with no bucket or an empty path segment is refused at once as not a
    store URL, showing the form to write (s3://bucket/prefix), as gs:// and az:// URLs are —
    before any endpoint is contacted."""
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:1",  # nothing listens: contacting it fails
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    result = invoke("ls", url, env=env)
    assert_clean(result, 1)
    assert "cannot reach" not in result.stderr, result.stderr
    assert "s3://bucket/prefix" in result.stderr, result.stderr


# -- serve ----------------------------------------------------------------------------------


def test_serve_with_an_empty_host_is_a_usage_error(store_url) -> None:
    """`serve --host ''` (an unset shell variable) is a usage error naming --host; it never
    listens on every interface."""
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "dynstate"), "serve", store_url,
         "--host", "", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"serve --host '' started a server: {out.strip()} {err.strip()}")
    assert proc.returncode == 2, (out, err)
    assert "--host" in err and "Traceback" not in err


def test_serve_on_an_address_it_cannot_bind_says_to_change_the_host(store_url) -> None:
    """A --host this machine cannot listen on is one `error:` line that names the host and
    says to change --host, not --port."""
    result = invoke("serve", store_url, "--host", "192.0.2.1", "--port", "0")
    assert_clean(result, 1)
    assert result.stderr.startswith("error: "), result.stderr
    assert "192.0.2.1" in result.stderr and "--host" in result.stderr, result.stderr
    assert "another --port" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args",
    [("head", "{url}", "--columns", ","), ("diff", "{url}", "1", "3", "--columns", "nope")],
    ids=["head-no-column", "diff-columns-without-rows"],
)
def test_columns_that_choose_nothing_are_usage_errors(store_url, args) -> None:
    """`--columns ,` names no column, and `diff --columns` without `--rows` would choose the
    columns of nothing: both are usage errors naming --columns, not a silent table of row
    numbers or an ignored flag."""
    result = invoke(*(a.format(url=store_url) for a in args))
    assert result.exit_code == 2, result.output
    assert "--columns" in result.output


def test_a_version_whose_record_is_gone_is_not_tagged(store_url) -> None:
    """A tag pins a version for every later reader: a version whose commit record was deleted
    (damage) is refused as a target, naming the record, and no tag is written."""
    (Path(store_url) / paths.log_path(2)).unlink()
    result = invoke("tag", store_url, "pinned", "2")
    assert result.exit_code == 1, result.output
    assert "commit record of version 2" in result.output
    assert not (Path(store_url) / paths.tag_path("pinned")).exists()


@pytest.mark.parametrize(
    ("args", "said"),
    [(("ls", " "), "non-empty"), (("export", "{url}", "3", " "), "name a file")],
    ids=["blank-url", "blank-out"],
)
def test_a_blank_url_or_out_is_refused_saying_what_to_pass(
    store_url, args, said, tmp_path, monkeypatch
) -> None:
    """A URL or OUT of spaces (an unset shell variable in quotes) is refused saying what to
    pass, not as "no dynstate store at ;" or "cannot export to :"."""
    monkeypatch.chdir(tmp_path)  # where a blank OUT would have been written
    result = invoke(*(a.format(url=store_url) for a in args))
    assert result.exit_code == 1, result.output
    assert said in result.output
