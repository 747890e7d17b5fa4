"""The encoding every store file shares, apart from what the records hold
(:mod:`dynstate.records.manifest`): JSON with a SHA-256 checksum over its canonical form
(:func:`encode`, :func:`decode`), one bounded parser for any store file (:func:`load_json`),
content hashes and timestamps. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
import sys
import threading
from datetime import datetime, timezone
from typing import Any

from ..errors import (
    ChecksumMismatchError,
    CorruptStoreError,
    InvalidDataError,
    UnsupportedFormatError,
)

# The highest store format this dynstate reads (dynstate.records.manifest writes 1, and 2 for
# records and stores that hold outcomes or a generator state).
READ_FORMAT = 2


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical(obj: Any, *, allow_nan: bool = True) -> bytes:
    return dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan
    ).encode()


_INT_LIMIT = threading.Lock()


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` whatever this process's ``sys.set_int_max_str_digits``: a process that
    lowered it (to 640 at least) still writes every integer within the store's bound
    (:data:`MAX_INT_DIGITS`, checked by magnitude before this), as every reader converts one
    whatever its own limit. Only a conversion that fails is done again, with the limit raised
    to the bound for that call (under a lock: it is the interpreter's; other threads meanwhile
    see a higher limit, never a lower one)."""
    try:
        return json.dumps(obj, **kwargs)
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            raise
    with _INT_LIMIT:
        before = sys.get_int_max_str_digits()
        if before == 0 or before >= MAX_INT_DIGITS:
            return json.dumps(obj, **kwargs)  # raises again: it is past the bound
        sys.set_int_max_str_digits(MAX_INT_DIGITS)
        try:
            return json.dumps(obj, **kwargs)
        finally:
            sys.set_int_max_str_digits(before)


def encode(obj: dict[str, Any]) -> bytes:
    """Serialize a record with a checksum over its canonical JSON, so tampering is caught.
    The file is itself canonical (the body's text with the checksum member added), which
    C's encoder writes ~8x faster than an indented file and :func:`decode` verifies without
    re-encoding what it parsed."""
    body = {k: v for k, v in obj.items() if k != "checksum"}
    try:
        text = canonical(body, allow_nan=False)  # RFC 8259: no NaN or Infinity
    except ValueError as exc:  # that, or an int past this process's sys.set_int_max_str_digits
        if "float" in str(exc):
            advice = "a record holds finite numbers only (no NaN or infinity)"
        else:
            advice = f"keep integers within {MAX_INT_DIGITS:,} digits"
        raise InvalidDataError(
            f"a record cannot be written: {exc}; nothing was written — {advice}"
        ) from exc
    # A process whose int limit is lifted writes what every other reader refuses (the
    # inputs were checked already, naming the value: check_int; this is the last line).
    if _LONG_RUN in text.translate(_DIGITS_ONLY) and _longest_int(text) > MAX_INT_DIGITS:
        raise InvalidDataError(
            f"a record would hold an integer of {_longest_int(text):,} digits, over the "
            f"{MAX_INT_DIGITS:,} every reader of the store accepts; nothing was written — "
            "store such a value as a string"
        )
    return canonical({**body, "checksum": sha256(text)}, allow_nan=False)


def _canonical_file_matches(data: bytes, expected: str) -> bool:
    """Whether ``data`` is the canonical text of a record's body with its top-level
    ``"checksum":"<expected>"`` member added (what :func:`encode` writes) and that text
    hashes to ``expected``. Removing the member's first occurrence and hashing the rest
    settles it: only the writer's own canonical text has that hash, and a member moved
    elsewhere, or written with escapes, leaves bytes that do not. Files in any other
    layout (indented, as dynstate wrote them before) answer False."""
    member = b'"checksum":"' + expected.encode() + b'"'
    at = data.find(member)
    if at <= 0:
        return False
    end = at + len(member)
    if data[at - 1 : at] == b",":
        text = data[: at - 1] + data[end:]
    elif data[end : end + 1] == b",":
        text = data[:at] + data[end + 1 :]
    else:
        text = data[:at] + data[end:]
    return sha256(text) == expected


# Bounds on what any store file may hold. Records nest a few levels around a ``meta`` of at
# most 32 (rounds.MAX_META_DEPTH). Integers: at most 4,300 digits, Python's default limit —
# but a process may lift that limit (PYTHONINTMAXSTRDIGITS=0) or lower it (to 640 at least),
# so neither side asks it: writers compare magnitudes (check_int, encode) and readers count
# digits and convert without it (_bounded_int).
MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 4300
# The largest magnitude of MAX_INT_DIGITS digits, compared as an int (no str conversion).
MAX_INT = 10**MAX_INT_DIGITS - 1
# The lowest limit sys.set_int_max_str_digits accepts: shorter runs convert in any process.
_SAFE_DIGITS = 640
# The largest count, version or size a record may name: what Arrow's int64 offsets can hold.
MAX_COUNT = 2**63 - 1

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
# Digits to "0", everything else to " ": a digit run longer than the bound is then one
# substring search, a twentieth of what a regex scan costs on a 80 KB chunk of shard entries.
_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)
_SAFE_RUN = b"0" * (_SAFE_DIGITS + 1)


def whole(value: object) -> int | None:
    """``value`` as an int when it is a whole number by type — an int or what stands for one
    (numpy's integers, ``operator.index``) — never a bool, a float or text; else None."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None  # numpy's and torch's booleans too (operator.index takes a bool tensor)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def int_fits(value: int) -> bool:
    """Whether every reader parses ``value`` back (:data:`MAX_INT_DIGITS` digits at most),
    decided by magnitude: the same answer whatever this process's int string limit."""
    return -MAX_INT <= value <= MAX_INT


def check_int(value: int, what: str) -> None:
    """InvalidDataError unless :func:`int_fits` ``value``; ``what`` says whose value and
    where (``"meta for URL ... at meta['x']"``)."""
    if not int_fits(value):
        raise InvalidDataError(
            f"{what} is an integer of {value.bit_length():,} bits, over the "
            f"{MAX_INT_DIGITS:,} decimal digits every reader of the store accepts (whatever "
            "this process's sys.set_int_max_str_digits); store it as a string"
        )


def _damaged(where: str, why: str) -> CorruptStoreError:
    return CorruptStoreError(
        f"{where} {why}; the file is damaged — run `dynstate verify` and restore it from a "
        "backup or reset to an earlier version"
    )


def _nesting(data: bytes) -> int:
    """How deep ``data``'s arrays and objects nest (brackets inside strings do not count),
    found without recursion so that a file of 200,000 ``[`` cannot exhaust the stack."""
    depth = peak = 0
    for byte in _JSON_STRING.sub(b'""', data).translate(None, _NOT_BRACKETS):
        if byte in b"[{":
            depth += 1
            if depth > peak:
                peak = depth
                if peak > MAX_JSON_DEPTH:
                    break
        else:
            depth -= 1
    return peak


def _depth(obj: Any) -> int:
    """How deep a parsed value's lists and dicts nest (as :func:`_nesting` counts the text's
    brackets), without recursion; stops counting past the bound. Only for what ``json``
    parsed: its containers are exactly ``dict`` and ``list``."""
    level = [obj] if type(obj) in _CONTAINERS else []
    depth = 0
    while level and depth <= MAX_JSON_DEPTH:
        depth += 1
        below = []
        for value in level:
            children = value.values() if type(value) is dict else value
            # A record's long lists hold numbers: one C-level pass over their types settles
            # that they hold no container, instead of a Python test per element.
            if not _CONTAINERS.isdisjoint(set(map(type, children))):
                below += [child for child in children if type(child) in _CONTAINERS]
        level = below
    return depth


_CONTAINERS = frozenset((dict, list))


def _longest_int(text: bytes) -> int:
    """The most digits of any integer in the JSON ``text`` (digit runs in strings are not
    integers), counted without converting one."""
    longest = 0

    def count(number: str) -> int:
        nonlocal longest
        longest = max(longest, len(number.lstrip("-")))
        return 0

    json.loads(text, parse_int=count)
    return longest


def _bounded_int(where: str) -> Any:
    def parse(text: str) -> int:
        digits = len(text.lstrip("-"))
        if digits > MAX_INT_DIGITS:
            raise _damaged(where, f"holds an integer of {digits:,} digits")
        if digits <= _SAFE_DIGITS:
            return int(text)
        # int(str) obeys this process's limit, which may be as low as 640 digits: a Decimal
        # converts to int without it, so every process reads what the bound lets through.
        from decimal import Decimal

        return int(Decimal(text))

    return parse


def load_json(data: bytes | str, where: str) -> Any:
    """Parse any store file's JSON (records, tags, hints, ``gc.json``, leases, ``store.json``)
    with bounded nesting and integer size: damage or hostile content is a CorruptStoreError
    naming ``where``, never a RecursionError or ValueError."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    deep = _damaged(where, f"nests deeper than {MAX_JSON_DEPTH} levels")
    # The per-integer hook costs a call per number: only files with a long digit run pay it.
    parse_int = _bounded_int(where) if _SAFE_RUN in raw.translate(_DIGITS_ONLY) else None
    try:
        # The C parser guards its own recursion (a file of 200,000 "[" is a RecursionError,
        # not a crash), so the depth is checked on what it returns: walking the parsed
        # containers costs a fraction of scanning the text's strings and brackets first.
        obj = json.loads(raw, parse_int=parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _damaged(where, f"is not valid JSON ({exc})") from exc
    except RecursionError as exc:
        if _nesting(raw) > MAX_JSON_DEPTH:
            raise deep from None
        raise _damaged(where, f"cannot be read as JSON ({exc})") from exc
    except ValueError as exc:
        raise _damaged(where, f"cannot be read as JSON ({exc})") from exc
    # Most files have fewer brackets than the bound: counting them settles it without a walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth(obj) > MAX_JSON_DEPTH:
        raise deep
    return obj


def decode(data: bytes, where: str) -> dict[str, Any]:
    """Parse and verify a record written by :func:`encode`; ``where`` names it in errors."""
    obj = load_json(data, where)
    if not isinstance(obj, dict):
        raise CorruptStoreError(f"{where} does not hold a JSON object; the file is damaged")
    fmt = obj.get("format")
    if isinstance(fmt, bool) or not isinstance(fmt, int):
        raise CorruptStoreError(f"{where} has no format number; it was not written by dynstate")
    if fmt > READ_FORMAT:
        raise UnsupportedFormatError(
            f"{where} uses store format {fmt} but this dynstate reads formats up to "
            f"{READ_FORMAT}; upgrade dynstate (pip install -U dynstate)"
        )
    expected = obj.get("checksum")
    body = {k: v for k, v in obj.items() if k != "checksum"}
    # A canonical file (every file this dynstate writes) is verified by hashing its own
    # bytes; re-encoding what was parsed, ~4x the cost, only for files written otherwise.
    fast = (
        isinstance(expected, str)
        and len(expected) == 64
        and isinstance(data, (bytes, bytearray, memoryview))
        and _canonical_file_matches(bytes(data), expected)
    )
    if not fast and expected != sha256(canonical(body)):
        raise ChecksumMismatchError(
            f"{where} does not match its checksum: the record was modified after it was "
            "written; restore it or reset the store to an earlier version"
        )
    return body
