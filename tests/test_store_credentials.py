"""Credentials stay out of every message and every log line, at any verbosity — botocore's
and s3fs's DEBUG output (request headers, signatures) included."""

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


def test_secrets_never_reach_a_debug_log(s3_endpoint, everything_logged, monkeypatch) -> None:
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
