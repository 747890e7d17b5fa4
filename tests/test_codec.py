"""Records on disk: written as canonical JSON with their checksum, verified from their own
bytes; files in the earlier, indented layout still read; any change to either is refused."""

from __future__ import annotations

import json

import pytest

from dynstate import Store
from dynstate.errors import ChecksumMismatchError
from dynstate.records import codec

BODY = {
    "format": 1,
    "version": 7,
    "add": [{"path": "data/a.parquet", "rows": 3, "groups": {"rows": [1, 2]}}],
    "meta": {"note": 'ünïcode, "quoted", {braces}', "checksum": "not the record's"},
    "created": "2026-12-02T04:00:00.000Z",
}


def indented(body: dict) -> bytes:
    """A record as dynstate wrote them before records were canonical files."""
    obj = {**body, "checksum": codec.sha256(codec.canonical(body))}
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False).encode()


def test_a_record_is_written_canonical_and_verified_without_re_encoding(monkeypatch) -> None:
    raw = codec.encode(BODY)
    obj = json.loads(raw)
    assert raw == codec.canonical(obj)
    # What any reader of the format checks (an older dynstate included) holds too.
    assert obj["checksum"] == codec.sha256(codec.canonical(BODY))

    def no_re_encoding(_obj):
        raise AssertionError("a canonical file was re-encoded to verify it")

    monkeypatch.setattr(codec, "canonical", no_re_encoding)
    assert codec.decode(raw, "x") == BODY


def test_an_indented_record_of_an_earlier_dynstate_still_reads() -> None:
    assert codec.decode(indented(BODY), "x") == BODY


def _moved_into_meta(raw: bytes) -> bytes:
    obj = json.loads(raw)
    obj["meta"] = {**obj["meta"], "checksum": obj.pop("checksum")}
    obj["checksum"] = obj["meta"]["checksum"]
    return codec.canonical(obj)


def _escaped_key_and_copy_in_meta(raw: bytes) -> bytes:
    # The top-level member written with an escape, and a literal copy inside ``meta``: the
    # copy is the one a byte search finds first.
    obj = json.loads(raw)
    digest = obj.pop("checksum")
    obj["meta"] = {**obj["meta"], "checksum": digest}
    text = codec.canonical(obj)
    return text[:-1] + b',"check\\u0073um":"' + digest.encode() + b'"}'


TAMPERED = {
    "value changed in place": lambda raw: raw.replace(b'"version":7', b'"version":8'),
    "string changed in place": lambda raw: raw.replace(b"quoted", b"QUOTED"),
    "member added": lambda raw: raw[:-1] + b',"extra":1}',
    "checksum of another body": lambda raw: codec.canonical(
        {**BODY, "version": 8, "checksum": json.loads(raw)["checksum"]}
    ),
    "checksum moved into meta": _moved_into_meta,
    "escaped key, literal copy": _escaped_key_and_copy_in_meta,
    "indented, value changed": lambda raw: indented(BODY).replace(b'"version": 7', b'"version": 8'),
}


@pytest.mark.parametrize("damage", sorted(TAMPERED))
def test_a_changed_record_is_a_checksum_mismatch(damage: str) -> None:
    changed = TAMPERED[damage](codec.encode(BODY))
    assert changed != codec.encode(BODY)
    with pytest.raises(ChecksumMismatchError, match="x does not match its checksum"):
        codec.decode(changed, "x")


def test_a_store_of_indented_records_opens_reads_and_grows(tmp_path) -> None:
    """A store whose every record is in the earlier layout (rewritten here the way that
    dynstate wrote them) opens and reads; its next commit is written canonical."""
    url = str(tmp_path / "s")
    store = Store.open(url, create=True)
    for i in range(3):
        store.append([{"id": i}])
    meta = tmp_path / "s" / "_dynstate"
    rewritten = 0
    for path in meta.rglob("*.json"):
        obj = json.loads(path.read_bytes())
        if "checksum" in obj:
            body = {k: v for k, v in obj.items() if k != "checksum"}
            path.write_bytes(indented(body))
            rewritten += 1
    assert rewritten >= 5  # store.json, the records of versions 0-3, a checkpoint
    again = Store.open(url)
    assert [r["id"] for r in again.snapshot().to_arrow().to_pylist()] == [0, 1, 2]
    version = again.append([{"id": 3}])
    raw = (meta / "log" / f"{version:020d}.json").read_bytes()
    assert raw == codec.canonical(json.loads(raw))
    assert Store.open(url).snapshot().num_rows == 4
