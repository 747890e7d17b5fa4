"""Credentials stay out of every message and every log line, at any verbosity — botocore's
and s3fs's DEBUG output (request headers, signatures) included, on both S3 clients."""

from __future__ import annotations

import io
import logging

import pytest
from conftest import s3_url

from dynstate import DynstateError, InvalidDataError, Store
from dynstate.storage import redact

pytestmark = pytest.mark.s3

KEY = "AKIDDYNSTATETEST0001"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYSECRET01"


@pytest.fixture
def everything_logged():
    """Every record of every logger, DEBUG and up, formatted as a handler would."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    names = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp", "dynstate")
    levels = {n: logging.getLogger(n).level for n in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_secrets_never_reach_a_debug_log(
    client: str, s3_endpoint, everything_logged, monkeypatch
) -> None:
    if client == "s3fs":
        monkeypatch.setenv("DYNSTATE_S3_CLIENT", "s3fs")
    else:
        monkeypatch.delenv("DYNSTATE_S3_CLIENT", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    options = {"key": KEY, "secret": SECRET}
    url = s3_url()
    store = Store.open(url, create=True, storage_options=options)
    store.append([{"id": 1}])
    assert Store.open(url, storage_options=options).snapshot().num_rows == 1
    with pytest.raises(DynstateError) as info:
        Store.open(s3_url(), storage_options=options)  # not a store: an error message too
    text = everything_logged.getvalue()
    assert "dynstate DEBUG committed version 1" in text  # the capture saw the run
    if client == "s3fs":
        assert "botocore" in text and "Authorization" in text  # the headers were logged
    for secret in (KEY, SECRET, SECRET.split("/")[1]):
        assert secret not in text
        assert secret not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"s3://{KEY}:{SECRET}@bucket/store",
        f"s3://{KEY}:Sec/ret@bucket/store",
        "s3://KEY:p@ss/w@rd@bucket/store",
    ],
)
def test_credentials_in_the_url_are_refused_unprinted(url: str) -> None:
    with pytest.raises(InvalidDataError) as info:
        Store.open(url)
    message = str(info.value)
    # The URL is shown as s3://***@bucket/store and the rest of the message is fixed text.
    assert message.startswith("s3://***@bucket/store has credentials in the URL; pass them")
    assert SECRET not in message and "Sec/ret" not in message and "p@ss" not in message
    assert info.value.__cause__ is None and info.value.__context__ is None


def test_redact() -> None:
    assert redact("s3://KEY:Sec/ret@bucket/run1?token=x") == "s3://***@bucket/run1"
    assert redact("s3://bucket/runs/a@b") == "s3://bucket/runs/a@b"  # an @ in a path is kept
    assert redact("/local/path@1") == "/local/path@1"


def test_options_s3fs_hands_on_to_botocore_are_accepted(s3_endpoint) -> None:
    from dynstate.storage import open_storage

    open_storage(s3_url(), {"profile": "default", "anon": False})  # no error: both are known
    with pytest.raises(InvalidDataError, match="unknown storage option 'no_such_option'"):
        open_storage(s3_url(), {"no_such_option": 1})


# -- the one scrubber ------------------------------------------------------------------------

AWS_SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY/EXAMPLE1"  # AWS secret keys hold "/" and "+"
SESSION = "IQoJb3JpZ2luX2VjEH8aCXVzLWVhc3QtMSJHMEUCIQD/abc+def/ghi=="


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        (f"s3://{KEY}:{AWS_SECRET}@bucket/run", (AWS_SECRET, "K7MDENG", "EXAMPLE1")),
        ("sftp://user:p@ss/w:rd@host:22/data failed", ("p@ss", "w:rd")),
        ("see http://u:Zq9/Xw7@h/x.", ("Zq9", "Xw7")),
        (
            "GET https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential="
            "AKIDSHORT%2F20261201%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=ab12cd34"
            "&X-Amz-Security-Token=FwoG/zz+yy",
            ("AKIDSHORT", "ab12cd34", "FwoG", "zz+yy"),
        ),
        ("https://acct.blob.core.windows.net/c/b?sv=2020&sig=Sh0rt%2Fsig", ("Sh0rt",)),
        ("Authorization: AWS4-HMAC-SHA256 Credential=AKID/2026, Signature=f00d", ("AKID/", "f00d")),
        ("aws_secret_access_key = sh/rt+1", ("sh/rt+1",)),
        ('{"SessionToken": "Tok/en+short"}', ("Tok/en",)),
        (f"{{'aws_session_token': '{SESSION}'}}", (SESSION, "abc+def")),
    ],
)
def test_scrub_hides_every_shape_of_secret(text: str, hidden: tuple[str, ...]) -> None:
    from dynstate.storage.credentials import scrub

    clean = scrub(text)
    assert "***" in clean
    for part in hidden:
        assert part not in clean, (part, clean)


def test_scrub_hides_known_secrets_as_written_and_url_encoded(monkeypatch) -> None:
    from urllib.parse import quote, quote_plus

    from dynstate.storage.credentials import scrub

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION)
    for form in (AWS_SECRET, quote(AWS_SECRET, safe=""), quote_plus(AWS_SECRET), SESSION):
        assert scrub(f"the value {form} was here") == "the value *** was here"
    # A secret passed by the caller (a storage option) too, and a short one only where a rule
    # finds it: a short word is not blanked everywhere.
    assert scrub("opt MyOwnS3cret/Value here", ["MyOwnS3cret/Value"]) == "opt *** here"
    assert scrub("testing is testing", ["testing"]) == "testing is testing"


@pytest.mark.parametrize(
    "text",
    [
        "s3://bucket/runs/a@b has no store",
        "/local/path@1 and http://127.0.0.1:8000/versions?step=3&limit=50&before=9",
        "version 12 not found in s3://bucket/run1 (latest is 9)",
        "token_count=5 and key points",
    ],
)
def test_scrub_leaves_ordinary_text_alone(text: str) -> None:
    from dynstate.storage.credentials import scrub

    assert scrub(text) == text


def test_there_is_one_scrubber() -> None:
    """The CLI and serve call the storage package's scrubber; no copy with its own rules."""
    import dynstate.cli.errors as cli_errors
    import dynstate.serve.api as serve_api
    import dynstate.serve.app as serve_app
    from dynstate.storage import credentials

    assert not hasattr(cli_errors, "scrub") and not hasattr(cli_errors, "_USERINFO")
    assert serve_api.scrub is credentials.scrub and serve_app.scrub is credentials.scrub
    assert not hasattr(serve_api, "_USERINFO") and not hasattr(serve_api, "_MIN_SECRET")


@pytest.mark.parametrize(
    "text",
    ["a." * 200_000, "http://x/" + "a@" * 200_000, "x://" * 100_000, "a-b+c." * 70_000],
    ids=["dots", "ats", "schemes", "scheme-chars"],
)
def test_scrub_is_linear_in_hostile_text(text: str) -> None:
    """serve scrubs every response, rows included: no text may make it quadratic (a 400 kB
    "a.a.a…" took minutes with an unbounded scheme pattern)."""
    import time

    from dynstate.storage.credentials import scrub

    started = time.monotonic()
    scrub(text)
    assert time.monotonic() - started < 5
