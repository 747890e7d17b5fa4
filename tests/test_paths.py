"""The file-name grammar (dynstate.paths): every maker's output parses back to its parts with
its own matcher and with no other; near-misses are refused; a store built by real writes
holds only names the grammar knows; and gc and verify decide by the grammar."""

from __future__ import annotations

import ast
import hashlib
import os
import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynstate import Store, paths
from dynstate.maintenance.gc import collect_garbage
from dynstate.maintenance.verify import verify_store
from dynstate.records import manifest as m

VERSIONS = st.integers(min_value=0, max_value=10**20 - 1)
HEX32 = st.text("0123456789abcdef", min_size=32, max_size=32)
DIGESTS = st.binary().map(lambda b: hashlib.sha256(b).hexdigest())
TAG_NAMES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", fullmatch=True).filter(
    lambda n: ".." not in n
)
FOLDERS = st.sampled_from([paths.META_DIR, paths.DATA_DIR, *paths.META_SUBDIRS])


def only_kind(rel: str) -> str:
    """The one kind whose matcher accepts ``rel`` (fails if none or several do)."""
    kinds = [kind for kind, match in paths.MATCHERS.items() if match(rel) is not None]
    assert len(kinds) == 1, f"{rel!r} is matched by {kinds}"
    return kinds[0]


@given(VERSIONS)
def test_versioned_names_parse_back(version: int) -> None:
    for maker, match, kind in (
        (paths.log_path, paths.match_log, "log"),
        (paths.checkpoint_path, paths.match_checkpoint, "checkpoint"),
        (paths.outcome_checkpoint_path, paths.match_outcome_checkpoint, "outcome_checkpoint"),
    ):
        rel = maker(version)
        assert match(rel) == version
        assert only_kind(rel) == kind
        assert paths.classify(rel) == (kind, version)


@given(DIGESTS)
def test_content_addressed_names_parse_back(digest: str) -> None:
    for maker, match, kind in (
        (paths.chunk_path, paths.match_chunk, "chunk"),
        (paths.schema_path, paths.match_schema, "schema"),
        (paths.aggregate_path, paths.match_aggregate, "aggregate"),
    ):
        rel = maker(digest)
        assert match(rel) == digest
        assert only_kind(rel) == kind
    assert paths.is_digest(digest)


@given(HEX32, HEX32)
def test_lease_names_parse_back(lease: str, other: str) -> None:
    assert paths.match_lease(paths.lease_path(lease)) == lease
    assert paths.match_claim(paths.claim_path(lease)) == lease
    assert paths.match_holder(paths.holder_path(lease, other)) == (lease, other)
    assert paths.match_shard(paths.shard_path(lease, other)) == (lease, other)
    assert paths.lease_of(paths.shard_path(lease, other)) == lease
    for rel, kind in (
        (paths.lease_path(lease), "lease"),
        (paths.claim_path(lease), "claim"),
        (paths.holder_path(lease, other), "holder"),
        (paths.shard_path(lease, other), "shard"),
        (paths.probe_path(other), "probe"),
    ):
        assert only_kind(rel) == kind
        assert paths.lease_file_of(rel) == (lease if kind in ("lease", "claim", "holder") else None)
    assert paths.match_probe(paths.probe_path(other)) == other


@given(HEX32, FOLDERS)
def test_temporary_files_parse_back_in_every_folder_dynstate_writes(
    unique: str, folder: str
) -> None:
    rel = paths.tmp_path(f"{folder}/some-file.json", unique)
    assert rel == f"{folder}/.tmp-{unique}"
    assert paths.match_tmp(rel) == unique
    assert only_kind(rel) == "tmp"


@given(TAG_NAMES)
def test_tag_names_parse_back(name: str) -> None:
    assert paths.match_tag(paths.tag_path(name)) == name
    assert only_kind(paths.tag_path(name)) == "tag"


def test_fresh_names_are_fresh_and_parse() -> None:
    lease = paths.new_id()
    shards = {paths.shard_path(lease) for _ in range(100)}
    assert len(shards) == 100 and all(paths.lease_of(s) == lease for s in shards)
    assert len({paths.probe_path() for _ in range(100)}) == 100
    assert all(only_kind(paths.probe_path()) == "probe" for _ in range(10))
    assert all(only_kind(paths.tmp_path(paths.log_path(1))) == "tmp" for _ in range(10))
    for rel in paths.FIXED_FILES:
        assert only_kind(rel) == "fixed"


H32, H64, V = "a" * 32, "b" * 64, "0" * 19 + "7"

NEAR_MISSES = [
    # wrong length
    f"_dynstate/log/{V[1:]}.json",
    f"_dynstate/log/0{V}.json",
    f"_dynstate/checkpoints/{V}0.json",
    f"_dynstate/chunks/{H64[1:]}.json",
    f"_dynstate/schemas/{H64}b.json",
    f"data/{H32[1:]}-{H32}.parquet",
    f"data/{H32}-{H32}0.parquet",
    f"_dynstate/leases/{H32[1:]}.json",
    f"_dynstate/probe/{H32}0",
    f"_dynstate/.tmp-{H32[1:]}",
    # upper-case hex, non-ASCII digits
    f"_dynstate/chunks/{H64.upper()}.json",
    f"data/{H32.upper()}-{H32}.parquet",
    f"_dynstate/leases/{H32.upper()}.outcome.json",
    f"_dynstate/aggregates/{'B' * 64}.parquet",
    "_dynstate/log/" + "\u0660" * 20 + ".json",
    f"_dynstate/probe/{'A' * 32}",
    # extra suffix or prefix
    f"_dynstate/log/{V}.json.bak",
    f"_dynstate/log/{V}.json\n",
    f"_dynstate/log/x{V}.json",
    f"data/{H32}-{H32}.parquet.tmp",
    f"_dynstate/leases/{H32}.outcome.json~",
    f"_dynstate/leases/{H32}.{H32}.{H32}.json",
    f"_dynstate/.tmp-{H32}.json",
    f"_dynstate/tags/{'t' * 129}.json",
    "_dynstate/tags/.hidden.json",
    "_dynstate/store.json.bak",
    # wrong folder, sub-folder, absolute, traversal
    f"_dynstate/schemas/{V}.json",
    f"_dynstate/log/{H64}.json",
    f"_dynstate/aggregates/{H64}.json",
    f"data/sub/{H32}.parquet",
    f"/_dynstate/log/{V}.json",
    f"/data/{H32}.parquet",
    f"_dynstate/log/../log/{V}.json",
    f"data/../data/{H32}.parquet",
    f"_dynstate/log/../../{V}.json",
    "_dynstate/tags/../gc.json",
    "_dynstate/tags/a..b.json",
    f"elsewhere/.tmp-{H32}",
    f"_dynstate/log/sub/.tmp-{H32}",
    "",
]


@pytest.mark.parametrize("rel", NEAR_MISSES)
def test_matchers_refuse_near_misses(rel: str) -> None:
    assert paths.classify(rel) is None
    assert all(match(rel) is None for match in paths.MATCHERS.values())


@pytest.mark.parametrize(
    "path",
    ["data/../../x.parquet", "data/sub/x.parquet", "data/.hidden.parquet", "data/x.parquet\n",
     "/data/x.parquet", "data/x.json", 7, None],
)  # fmt: skip
def test_a_record_may_name_only_a_safe_file_in_data(path: object) -> None:
    assert not paths.is_shard_reference(path)


def test_a_record_may_name_older_safe_shard_names() -> None:
    assert paths.is_shard_reference("data/notes.parquet")
    assert paths.is_shard_reference(paths.shard_path(paths.new_id()))


def _populate(root: Path) -> Store:
    """A store whose files cover every kind real writes leave: records, checkpoints, chunks
    (a round of 300 one-row shards), schemas, tags, outcome files, outcome checkpoints and
    aggregates, the gc floor, leases, holder files (a part unpickled), claims (a staged part
    committed), and the temporary file and probe a crash would leave."""
    store = Store.open(str(root), create=True)
    store.append([{"a": i} for i in range(300)], shard_bytes=1)
    for i in range(3):
        store.append([{"a": i}], outcomes=[{"row": i, "step": i, "score": 1.0}],
                     generator_state={"i": i})  # fmt: skip
    committed = store.stage([{"a": 10}])
    store.commit_staged([committed])  # its claim stays as a tombstone
    store.tag("kept", store.head)
    pending = store.stage([{"a": 11}])
    pickle.loads(pickle.dumps(pending))  # a holder file, renewed by this process from now on
    collect_garbage(store, keep=2, grace_s=0, dry_run=False)
    # As a process killed mid-probe and a writer killed between its write and its rename
    # leave them, two hours ago (gc leaves such files alone for BUSY_S).
    probe = paths.probe_path()
    store.storage.put(probe, b"clock")
    digest = hashlib.sha256(b"x").hexdigest()
    tmp = paths.tmp_path(paths.chunk_path(digest))
    (root / tmp).write_bytes(b"{}")
    # and the intent of a tagger killed between its intent and its tag's create
    intent = paths.tag_intent_path(paths.new_id())
    store.storage.put(intent, m.encode({"format": m.FORMAT, "version": 1, "tag": "t"}))
    for rel in (probe, tmp, intent):
        stamp = os.stat(root / rel).st_mtime - 7200
        os.utime(root / rel, (stamp, stamp))
    return store


def _files(root: Path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
        for d, _, files in os.walk(root)
        for f in files
    )


def test_every_file_a_real_store_holds_is_matched_by_exactly_one_matcher(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _populate(root)
    files = _files(root)
    kinds = {only_kind(rel) for rel in files}
    assert kinds == set(paths.MATCHERS), f"kinds never written: {set(paths.MATCHERS) - kinds}"


def test_gc_deletes_only_what_the_matchers_accept(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _populate(root)
    near = [
        rel
        for rel in NEAR_MISSES
        if rel and not rel.startswith("/") and ".." not in rel and "\n" not in rel
    ]
    for rel in near:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"not ours")
    # Names the old per-module regexes took for records below the floor (``$`` before a
    # newline, ``\d`` for any Unicode digit): not ours, so never deleted.
    odd = [paths.log_path(0) + "\n", "_dynstate/checkpoints/" + "\u0660" * 20 + ".json"]
    for rel in odd:
        (root / rel).write_bytes(b"not ours")
    result = collect_garbage(Store.open(str(root)), grace_s=0, dry_run=False)
    removed = {r.path: paths.classify(r.path) for r in result.removed}
    assert all(match is not None and match.kind in paths.COLLECTABLE for match in removed.values())
    assert {match.kind for match in removed.values() if match} == {"probe", "tmp", "tag_intent"}
    for rel in near + odd:
        assert (root / rel).exists(), rel
    assert set(odd) <= set(result.foreign)
    assert verify_store(Store.open(str(root)), all_versions=True).ok


def test_gc_asks_the_grammar_what_is_a_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An orphaned shard is removed because the shard matcher accepts its name: with that
    matcher refusing, the same file is a foreign name and stays."""
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"a": 1}])
    orphan = paths.shard_path(paths.new_id())
    store.storage.put(orphan, b"left by a dead writer")
    monkeypatch.setitem(paths.MATCHERS, "shard", lambda rel: None)
    result = collect_garbage(Store.open(str(tmp_path / "store")), grace_s=0, dry_run=False)
    assert orphan in result.foreign and store.storage.exists(orphan)
    monkeypatch.undo()
    result = collect_garbage(Store.open(str(tmp_path / "store")), grace_s=0, dry_run=False)
    assert [r.path for r in result.removed] == [orphan]


def test_verify_checks_what_the_checkpoint_matcher_accepts(tmp_path: Path) -> None:
    """A file beside the checkpoints that no maker makes is not a checkpoint (verify ignores
    it); a damaged file under a checkpoint's name is reported."""
    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"a": 1}])
    store.storage.put(paths.checkpoint_path(1) + ".bak", b"not json")
    assert verify_store(store).ok
    store.storage.put(paths.checkpoint_path(1), b"not json")
    report = verify_store(store)
    assert len(report.problems) == 1 and paths.checkpoint_path(1) in report.problems[0]


MAINTENANCE = Path(__file__).resolve().parent.parent / "dynstate" / "maintenance"
DECODERS = {"decode", "decode_chunk", "from_json", "load_json", "schema_from_json"}


@pytest.mark.parametrize("module", ["gc.py", "references.py", "verify.py", "retention.py"])
def test_gc_and_verify_decode_nothing_themselves(module: str) -> None:
    """They read records, checkpoints and chunks through the log, and judge names through
    dynstate.paths: no decoder and no file-name pattern of their own (retention's one
    pattern reads durations)."""
    tree = ast.parse((MAINTENANCE / module).read_text())
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not called & DECODERS, called & DECODERS
    if module != "retention.py":
        assert "re" not in imported and "endswith" not in called
