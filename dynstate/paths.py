"""The file-name grammar of a store: for every kind of file dynstate writes, a *maker* that
builds its path (relative to the store root) and a *matcher* that parses a path back into its
parts — or returns None for anything the maker could not have made. Pure: no I/O, and it
imports nothing from dynstate, so that the storage backends (which name their temporary
files and clock probes) can use it as well as the records, the log and maintenance.

Writers build names only with the makers; gc deletes only what a matcher of
:data:`COLLECTABLE` accepts, and the log lists checkpoints through the matchers, so a name gc
may delete is decided in exactly one place, next to the code that makes it.
``tests/test_paths.py`` checks that every maker's output parses back to the same parts and
that near-misses (a digit short, upper-case hex, an extra suffix, ``..``) are refused.

Matchers take the whole relative path (``_dynstate/log/00000000000000000007.json``) and match
it in full: a trailing newline, a sub-folder or a Unicode digit is not ours.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

META_DIR = "_dynstate"
DATA_DIR = "data"
LOG_DIR = f"{META_DIR}/log"
CHECKPOINT_DIR = f"{META_DIR}/checkpoints"
CHUNK_DIR = f"{META_DIR}/chunks"
SCHEMA_DIR = f"{META_DIR}/schemas"
TAG_DIR = f"{META_DIR}/tags"
PROBE_DIR = f"{META_DIR}/probe"
LEASE_DIR = f"{META_DIR}/leases"
OUTCOME_DIR = f"{META_DIR}/outcomes"
AGGREGATE_DIR = f"{META_DIR}/aggregates"
TAG_INTENT_DIR = f"{META_DIR}/tag-intents"
# The sub-folders of META_DIR that hold files dynstate writes (gc lists each of them).
META_SUBDIRS = (
    LOG_DIR,
    CHECKPOINT_DIR,
    CHUNK_DIR,
    SCHEMA_DIR,
    TAG_DIR,
    PROBE_DIR,
    LEASE_DIR,
    OUTCOME_DIR,
    AGGREGATE_DIR,
    TAG_INTENT_DIR,
)

STORE_FILE = f"{META_DIR}/store.json"
HEAD_HINT = f"{META_DIR}/_head_hint.json"
GC_FILE = f"{META_DIR}/gc.json"
FIXED_FILES = (STORE_FILE, HEAD_HINT, GC_FILE)

# Versions are padded to 20 digits (2**63 - 1 has 19) so that a listing sorts in version order.
_VERSION = r"([0-9]{20})"
_HEX32 = r"([0-9a-f]{32})"
_HEX64 = r"([0-9a-f]{64})"
# Tag names (and the other user-chosen names): letters, digits, '.', '_', '-', starting with a
# letter or digit, at most 128 characters, and never '..'.
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# What a record may name as a shard: any safe name directly in data/. Wider than what this
# dynstate writes (:func:`shard_path`), because a record is read, never deleted by its name:
# gc keeps to :func:`match_shard`.
_SHARD_REFERENCE = re.compile(rf"{DATA_DIR}/[A-Za-z0-9][A-Za-z0-9._-]*\.parquet")


def new_id() -> str:
    """A fresh 32-hex-digit id (lease ids, holders, the unique part of shard names)."""
    return uuid.uuid4().hex


# Lower-case hex digits: a string of them translates to nothing. One C pass; a regex costs
# ~4x as much on a shard's 41 concatenated row-group digests.
_HEX_DIGITS = b"0123456789abcdef"


def is_hex(text: str) -> bool:
    """Whether ``text`` holds only lower-case hex digits (a whole number of digests is the
    caller's check)."""
    return text.isascii() and not text.encode().translate(None, _HEX_DIGITS)


def is_id(text: Any) -> bool:
    """Whether ``text`` is an id :func:`new_id` makes (a lease, a holder): 32 lower-case hex
    digits, so a name built from it stays in its folder."""
    return isinstance(text, str) and len(text) == 32 and is_hex(text)


def is_digest(text: Any) -> bool:
    """Whether ``text`` is a SHA-256 in lower-case hex (a chunk id, a schema fingerprint, a
    checksum), as chunk and schema file names hold them."""
    return isinstance(text, str) and len(text) == 64 and is_hex(text)


def is_safe_name(name: str) -> bool:
    """Whether ``name`` may be a file name's stem that a user chose (a tag)."""
    return isinstance(name, str) and _SAFE_NAME.fullmatch(name) is not None and ".." not in name


def is_shard_reference(path: Any) -> bool:
    """Whether a record may name ``path`` as a shard (a safe name directly in ``data/``)."""
    return (
        isinstance(path, str) and _SHARD_REFERENCE.fullmatch(path) is not None and ".." not in path
    )


def _one(pattern: str) -> Callable[[str], str | None]:
    compiled = re.compile(pattern)

    def match(rel: str) -> str | None:
        found = compiled.fullmatch(rel) if isinstance(rel, str) else None
        return None if found is None else found.group(1)

    return match


def _version(pattern: str) -> Callable[[str], int | None]:
    one = _one(pattern)

    def match(rel: str) -> int | None:
        found = one(rel)
        return None if found is None else int(found)

    return match


# -- commit records, checkpoints, chunks, schemas ------------------------------------------


def log_path(version: int) -> str:
    """The commit record of ``version``."""
    return f"{LOG_DIR}/{version:020d}.json"


match_log = _version(rf"{LOG_DIR}/{_VERSION}\.json")


def checkpoint_path(version: int) -> str:
    """The checkpoint (complete shard list) of ``version``."""
    return f"{CHECKPOINT_DIR}/{version:020d}.json"


match_checkpoint = _version(rf"{CHECKPOINT_DIR}/{_VERSION}\.json")


def chunk_path(digest: str) -> str:
    """A chunk of shard entries, named by the SHA-256 of its bytes."""
    return f"{CHUNK_DIR}/{digest}.json"


match_chunk = _one(rf"{CHUNK_DIR}/{_HEX64}\.json")


def schema_path(fingerprint: str) -> str:
    """An Arrow schema, named by its fingerprint."""
    return f"{SCHEMA_DIR}/{fingerprint}.json"


match_schema = _one(rf"{SCHEMA_DIR}/{_HEX64}\.json")


# -- tags ----------------------------------------------------------------------------------


def tag_path(name: str) -> str:
    return f"{TAG_DIR}/{name}.json"


def tag_intent_path(unique: str) -> str:
    """A tagger's intent: the version it is about to tag, which gc keeps while the tag's own
    create may still land (written before it, removed once its outcome is known)."""
    return f"{TAG_INTENT_DIR}/{unique}.json"


match_tag_intent = _one(rf"{TAG_INTENT_DIR}/{_HEX32}\.json")


def match_tag(rel: str) -> str | None:
    """The tag name of a tag file (any safe name: a tag of digits only is refused when it is
    made, not here, so that such a file is still listed and reported)."""
    if not (isinstance(rel, str) and rel.startswith(TAG_DIR + "/") and rel.endswith(".json")):
        return None
    name = rel[len(TAG_DIR) + 1 : -len(".json")]
    return name if is_safe_name(name) else None


# -- shards and outcome files (data/) -------------------------------------------------------


class ShardName(NamedTuple):
    lease: str | None  # None: a shard written before leases (still read, still collected)
    unique: str


def shard_path(lease: str, unique: str | None = None) -> str:
    """A fresh name for a shard (or an outcome file) written under ``lease``."""
    return f"{DATA_DIR}/{lease}-{unique or new_id()}.parquet"


_SHARD = re.compile(rf"{DATA_DIR}/(?:{_HEX32}-)?{_HEX32}\.parquet")


def match_shard(rel: str) -> ShardName | None:
    """``data/<lease>-<unique>.parquet``, or ``data/<unique>.parquet`` (written by dynstate
    before leases; no maker makes it now)."""
    found = _SHARD.fullmatch(rel) if isinstance(rel, str) else None
    return None if found is None else ShardName(found.group(1), found.group(2))


def lease_of(rel: str) -> str | None:
    """The lease a shard path was written under, or None (an unleased or foreign name)."""
    found = match_shard(rel)
    return None if found is None else found.lease


# -- leases ---------------------------------------------------------------------------------


def lease_path(lease: str) -> str:
    """The lease file its writer renews while it lives."""
    return f"{LEASE_DIR}/{lease}.json"


match_lease = _one(rf"{LEASE_DIR}/{_HEX32}\.json")


def claim_path(lease: str) -> str:
    """How the lease ended (a commit's claim, gc's expiry, a discard), created exclusively."""
    return f"{LEASE_DIR}/{lease}.outcome.json"


match_claim = _one(rf"{LEASE_DIR}/{_HEX32}\.outcome\.json")


class HolderName(NamedTuple):
    lease: str
    holder: str


def holder_path(lease: str, holder: str) -> str:
    """The file a process that took ``lease`` over renews (its own, never the stager's)."""
    return f"{LEASE_DIR}/{lease}.{holder}.json"


_HOLDER = re.compile(rf"{LEASE_DIR}/{_HEX32}\.{_HEX32}\.json")


def match_holder(rel: str) -> HolderName | None:
    found = _HOLDER.fullmatch(rel) if isinstance(rel, str) else None
    return None if found is None else HolderName(found.group(1), found.group(2))


def lease_file_of(rel: str) -> str | None:
    """The lease a file of the lease folder belongs to (its lease, claim or a holder file)."""
    holder = match_holder(rel)
    return holder.lease if holder is not None else match_lease(rel) or match_claim(rel)


# -- outcomes ---------------------------------------------------------------------------------


def outcome_checkpoint_path(version: int) -> str:
    """The outcome checkpoint of ``version`` (its outcome file list and aggregate)."""
    return f"{OUTCOME_DIR}/{version:020d}.json"


match_outcome_checkpoint = _version(rf"{OUTCOME_DIR}/{_VERSION}\.json")


def aggregate_path(digest: str) -> str:
    """A per-row outcome aggregate, named by the SHA-256 of its bytes."""
    return f"{AGGREGATE_DIR}/{digest}.parquet"


match_aggregate = _one(rf"{AGGREGATE_DIR}/{_HEX64}\.parquet")


# -- short-lived files ------------------------------------------------------------------------


def probe_path(unique: str | None = None) -> str:
    """A probe object: the exclusive-create check, or the stamp read as the storage's clock."""
    return f"{PROBE_DIR}/{unique or new_id()}"


match_probe = _one(rf"{PROBE_DIR}/{_HEX32}")

# Temporary files appear in the folder of the file being written (local disks).
_TMP_DIRS = "|".join(re.escape(d) for d in (META_DIR, DATA_DIR, *META_SUBDIRS))
_TMP = re.compile(rf"(?:{_TMP_DIRS})/\.tmp-{_HEX32}")


def tmp_name(unique: str | None = None) -> str:
    """The name (no folder) of a temporary file written next to ``rel`` before it is linked
    or renamed into place."""
    return f".tmp-{unique or new_id()}"


def tmp_path(rel: str, unique: str | None = None) -> str:
    """The temporary file written next to ``rel`` (same folder)."""
    directory = rel.rsplit("/", 1)[0] if "/" in rel else ""
    return f"{directory}/{tmp_name(unique)}" if directory else tmp_name(unique)


def match_tmp(rel: str) -> str | None:
    """The unique part of a temporary file in a folder dynstate writes to."""
    found = _TMP.fullmatch(rel) if isinstance(rel, str) else None
    return None if found is None else rel.rsplit("-", 1)[1]


def match_fixed(rel: str) -> str | None:
    """``store.json``, ``gc.json`` or the head hint: the file itself."""
    return rel if rel in FIXED_FILES else None


# Every kind of file, by name; a path is matched by at most one of them.
MATCHERS: dict[str, Callable[[str], Any]] = {
    "fixed": match_fixed,
    "log": match_log,
    "checkpoint": match_checkpoint,
    "chunk": match_chunk,
    "schema": match_schema,
    "tag": match_tag,
    "tag_intent": match_tag_intent,
    "shard": match_shard,
    "lease": match_lease,
    "claim": match_claim,
    "holder": match_holder,
    "outcome_checkpoint": match_outcome_checkpoint,
    "aggregate": match_aggregate,
    "probe": match_probe,
    "tmp": match_tmp,
}
# The kinds gc may delete when no kept version needs them (leases go by the lease survey;
# tags and the fixed files never; a tag intent once it is older than any late request).
COLLECTABLE = frozenset(
    {"log", "checkpoint", "chunk", "schema", "shard", "outcome_checkpoint", "aggregate", "probe"}
    | {"tmp", "tag_intent"}
)
# Files named by a version number: collected once the version is below the gc floor.
BY_VERSION = frozenset({"log", "checkpoint", "outcome_checkpoint"})
# Content-addressed metadata every commit naming it writes again (see gc's BUSY_S).
REWRITTEN = frozenset({"chunk", "schema"})


class Match(NamedTuple):
    kind: str
    parts: Any


def classify(rel: str) -> Match | None:
    """The kind of file ``rel`` is and its parts, or None for a name dynstate never writes."""
    for kind, match in MATCHERS.items():
        parts = match(rel)
        if parts is not None:
            return Match(kind, parts)
    return None
