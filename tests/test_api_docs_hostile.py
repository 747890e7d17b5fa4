"""The documented public API against the real one, as an outside tester who reads only the docs
(docs/api.md and the API tables of docs/selection.md, outcomes.md, resume.md,
dynamic-sampling.md, ray.md).

``test_defect_*``: a mismatch between a doc and the code, or an edge input a user would try
that the code mishandled; each failed on the code before its fix and says why in its
docstring. ``test_guard_*``: mechanical checks that hold today and catch drift."""

from __future__ import annotations

import ast
import inspect
import math
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

import dynstate
from dynstate import (
    CommitConflictError,
    DynstateError,
    InvalidDataError,
    Store,
    VersionCollectedError,
    VersionedDataset,
    VersionNotFoundError,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"
API_DOCS = ("api.md", "selection.md", "outcomes.md", "resume.md", "dynamic-sampling.md", "ray.md")


def _store(tmp_path: Path, rounds: int = 3) -> tuple[Store, list[dict[str, Any]]]:
    """A local store: v1 an import of 4 rows, then ``rounds`` rounds of one row (steps 0..)."""
    store = Store.open(tmp_path / "store", create=True)
    rows = [{"q": f"q{i}", "n": i} for i in range(4)]
    store.append(rows)
    for step in range(rounds):
        row = {"q": f"s{step}", "n": 100 + step}
        store.append([row], meta={"step": step})
        rows.append(row)
    return store, rows


# -- the doc's signature-like forms, parsed ---------------------------------------------------

_CALL = re.compile(
    r"`((?:dynstate\.)?[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)"
    r"\(([^`]*)\)(?:\s*->[^`]*)?`"
)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


def _resolve(name: str) -> Any:
    """The dynstate callable a doc's ``Name`` / ``Store.method`` / ``dynstate.name`` means, or
    None (a user's ``fn``, ``logging.getLogger``, a method of an unnamed object)."""
    import dynstate.ray

    parts = name.split(".")
    if parts[0] == "dynstate":
        parts = parts[1:]
    for module in (dynstate, dynstate.ray):
        obj: Any = module
        try:
            for part in parts:
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if callable(obj) and getattr(obj, "__module__", "").startswith("dynstate"):
            return obj
    return None


def _split_args(text: str) -> list[str] | None:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth < 0:
            return None  # `Store.snapshot(v).to_arrow()`: not one call
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def _forms(text: str) -> list[dict[str, Any]]:
    """Every ``Callee(args)`` in backticks whose callee is a public dynstate callable."""
    forms = []
    for m in _CALL.finditer(text):
        name, argtext = m.groups()
        obj, args = _resolve(name), _split_args(argtext)
        if obj is None or args is None:
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        line_start = text.rfind("\n", 0, m.start()) + 1
        line = text[line_start : text.find("\n", m.start())]
        forms.append(
            {
                "name": name,
                "args": args,
                "sig": sig,
                "line": text.count("\n", 0, m.start()) + 1,
                "bold": text[max(0, m.start() - 2) : m.start()] == "**",
                # a table row whose first cell names the callee: `| `X` | `X(...)` ...`
                "table_row": bool(re.match(r"\|\s*`" + re.escape(name.split(".")[-1]) + "`", line))
                and line.find("`" + name + "(") == line.find("`", line.find("|", 1)),
            }
        )
    return forms


def _form_problems(doc: str, form: dict[str, Any]) -> list[str]:
    """Parameter names the form shows that the signature lacks; more positional arguments than
    it takes; literal defaults that differ (only in forms written as signatures: bold
    bullets, forms with a bare ``*``, or forms with two or more literal defaults — a call
    example such as ``rollback(store, step=-1)`` has one)."""
    where = f"docs/{doc}:{form['line']} {form['name']}({', '.join(form['args'])})"
    params = {n: p for n, p in form["sig"].parameters.items() if n != "self"}
    varkw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    positional = [
        p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    problems, literals = [], {}
    star, n_pos = False, 0
    for arg in form["args"]:
        if arg in ("...", "*"):
            star |= arg == "*"
            continue
        key, eq, value = arg.partition("=")
        key = key.strip()
        if eq and _IDENT.match(key):
            if key not in params and not varkw:
                problems.append(f"{where}: no parameter {key!r}")
            if "..." not in value:
                try:
                    literals[key] = ast.literal_eval(value.strip())
                except (ValueError, SyntaxError):
                    pass
        elif star and _IDENT.match(arg):
            if arg not in params and not varkw:
                problems.append(f"{where}: no parameter {arg!r}")
        elif not star:
            n_pos += 1
    if n_pos > len(positional):
        problems.append(f"{where}: {n_pos} positional arguments, the code takes {len(positional)}")
    if form["bold"] or star or len(literals) >= 2:
        for key, value in literals.items():
            p = params.get(key)
            if p is None:
                continue
            if p.default is p.empty:
                problems.append(f"{where}: {key} has no default; the doc shows {value!r}")
            elif not (p.default == value and isinstance(p.default, type(value))) and not (
                type(value) is int and type(p.default) is float and p.default == value
            ):
                problems.append(f"{where}: {key} defaults to {p.default!r}, not {value!r}")
    return problems


def test_guard_every_documented_parameter_exists_with_its_default() -> None:
    """Every parameter name the API docs show in a call or signature of a public dynstate
    callable exists in its real signature (or the callable takes ``**kwargs``), no form passes
    more positional arguments than the code takes, and the literal defaults a signature-form
    shows are the code's. (Self-check first: the checker reports a bogus name, a wrong
    default and a surplus positional argument, so this test can fail.)"""
    bogus = _forms(
        "| `compact` | `compact(store, target_bytes=..., verison=None)` |\n"
        "- **`Store.outcome_stats(version=None, *, success_above=0.7)`**\n"
        "`dynstate.lineage(store, 1, 2)`"
    )
    found = [p for f in bogus for p in _form_problems("selfcheck.md", f)]
    assert any("'verison'" in p for p in found), found
    assert any("success_above defaults to None" in p for p in found), found
    assert any("3 positional" in p for p in found), found

    problems, checked = [], 0
    for doc in API_DOCS:
        for form in _forms((DOCS / doc).read_text()):
            checked += 1
            problems += _form_problems(doc, form)
    assert checked >= 40, f"only {checked} forms found: has the docs' format changed?"
    assert not problems, "\n".join(problems)


def test_defect_signature_forms_omit_parameters() -> None:
    """docs/api.md:91-93 (the Maintenance table) writes full signatures — `collect_garbage(...)`
    on :90 lists every parameter down to `progress` and `clock` — but
    `compact(store, target_bytes=..., version=None)` lacks `meta` and `progress`,
    `verify_store(store, all_versions=False)` lacks `progress` and `records_progress`, and
    `export(snapshot, out, fmt="parquet", overwrite=False)` lacks `progress` and
    `storage_options` (how an export reaches an s3:// OUT at all). A user reading the table
    cannot learn that these exist. Checked for every table-row or bold signature form of
    docs/api.md that does not end in `...`."""
    missing = []
    text = (DOCS / "api.md").read_text()
    for form in _forms(text):
        if not (form["table_row"] or form["bold"]) or "..." in form["args"][-1:]:
            continue
        shown = {a.partition("=")[0].strip() for a in form["args"]}
        params = [n for n in form["sig"].parameters if n != "self"]
        positional = [
            n
            for n, p in form["sig"].parameters.items()
            if n != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        n_bare = sum(1 for a in form["args"] if _IDENT.match(a))
        named_positionally = set(positional[:n_bare])  # `snapshot` for `snap`: any name
        absent = [n for n in params if n not in shown and n not in named_positionally]
        if absent:
            missing.append(f"docs/api.md:{form['line']} {form['name']}: {absent}")
    assert not missing, "\n".join(missing)


# -- versions: numbers of every kind -------------------------------------------------------


def test_defect_numpy_int_version_refused_by_snapshot_and_friends(tmp_path: Path) -> None:
    """docs/api.md:61 (and :11-12, :99): a version is "a number, a tag or None"; api.md:99
    takes numpy and torch integers as dataset indices. `Store.snapshot(np.int64(2))` raises
    `VersionNotFoundError: version must be an int, a tag name or None` — so do `resolve`,
    `tag`, `reset`, `outcome_stats`, `outcome_records`, `generator_state`, `compact(version=)`,
    `consumption_records`, `VersionedDataset(store, np.int64(2))` and
    `rollback(version=np.int64(2))` — while `commit_record`, `shard_list` and `Store.lineage`
    of the same handle take it. A version read from a numpy array or a pandas/Arrow column
    (`to_numpy()`, `decode_index` on a numpy batch) is a numpy int; and a wrong type would be
    an `InvalidDataError` ("a wrong argument", api.md:195), not "no such version"."""
    store, _ = _store(tmp_path)
    v = np.int64(2)
    assert store.commit_record(v).version == 2  # accepted here ...
    assert store.snapshot(v).num_rows == 5  # ... refused here
    assert store.outcome_stats(v).num_rows == 5
    assert VersionedDataset(store, v).version == 2


def test_defect_store_lineage_of_a_negative_version_is_empty(tmp_path: Path) -> None:
    """docs/api.md:11 `lineage(v)` / api.md:109 "the versions whose rows a version carries":
    `Store.lineage(99)` (past the head) raises `VersionNotFoundError`, but `Store.lineage(-1)`
    silently yields nothing — a caller walking "the lineage of the version I computed" gets an
    empty history instead of an error for an off-by-one."""
    store, _ = _store(tmp_path)
    with pytest.raises(VersionNotFoundError):
        list(store.lineage(99))
    with pytest.raises(VersionNotFoundError):
        list(store.lineage(-1))


def test_defect_shard_list_of_a_negative_version_says_gc_removed_it(tmp_path: Path) -> None:
    """docs/api.md:193: `VersionCollectedError` means "the version was removed by gc".
    `Store.shard_list(-1)` on a store gc never touched raises `VersionCollectedError: version
    -1 ... was removed by garbage collection (oldest kept is 0)` — a false diagnosis (a user
    would go looking for the gc that deleted their data); `shard_list(99)` says
    `VersionNotFoundError`, as -1 should."""
    store, _ = _store(tmp_path)
    assert store.floor == 0
    with pytest.raises(VersionNotFoundError) as info:
        store.shard_list(-1)
    assert not isinstance(info.value, VersionCollectedError), str(info.value)


# -- encode_index ---------------------------------------------------------------------------


def test_defect_encode_index_aliases_rows_it_cannot_encode() -> None:
    """docs/api.md:105: `encode_index` is "an index meaning row r of version v" (resume.md:74:
    rows below 2**40). It checks nothing: `encode_index(1, 2**40)` is the index of row 0 of
    version 2, `encode_index(-1, 5)` is the plain row 5 (the dataset's current version), and a
    numpy version wraps negative. `VersionedDataset` then silently returns another row than
    the one encoded — the one thing an index must never do (api.md:99 refuses every other
    ambiguous index). Expected: `InvalidDataError`/`RowOutOfRangeError`."""
    for version, row in ((1, 2**40), (-1, 5), (1, -1)):
        with pytest.raises(DynstateError):
            dynstate.encode_index(version, row)


# -- rollback and step arguments --------------------------------------------------------------


def test_defect_rollback_records_a_fractional_step(tmp_path: Path) -> None:
    """docs/api.md:44-45: a training step is an int (`append(meta={"step": 1.0})` is refused
    with `InvalidDataError`); resume.md:182-183: `rollback(store, step=s)` writes
    `{"rollback_step": s}`. `rollback(store, step=1.5)` is accepted: it resets to step 1's
    version and stores `rollback_step: 1.5` in the record, a step no round has, which every
    later step query (`version_at_step`, a mix-mode sampler, `dynstate steps`) then reads.
    Expected: `InvalidDataError`, store unchanged."""
    store, _ = _store(tmp_path)
    head = store.head
    with pytest.raises(InvalidDataError):
        dynstate.rollback(store, step=1.5)
    assert store.refresh() == head


# -- bare Python errors escaping the public API -----------------------------------------------


def _bare_cases() -> list[Any]:
    def commit_record_str(store: Store) -> Any:
        return store.commit_record("1")  # api.md:11 `commit_record`; resolve takes "1"

    def version_at_step_none(store: Store) -> Any:
        return dynstate.version_at_step(store, None)  # api.md:110

    def rollback_step_str(store: Store) -> Any:
        return dynstate.rollback(store, step="1")  # api.md:111, a step read from argv/json

    def read_shard_past_end(store: Store) -> Any:
        snap = store.snapshot()
        return snap.read_shard(len(snap.shards))  # api.md:12 `read_shard(i)`

    def commit_staged_one_part(store: Store) -> Any:
        return store.commit_staged(store.stage([{"q": "x", "n": 1}]))  # a part, not a list

    def export_a_store(store: Store) -> Any:
        return dynstate.export(store, str(Path(store.url).parent / "out.parquet"))  # api.md:93

    def encode_index_float(store: Store) -> Any:
        return dynstate.encode_index(1.0, 2)  # api.md:105

    def tag_none(store: Store) -> Any:
        return store.tag(None)  # api.md:11 `tag`

    cases = [
        commit_record_str,
        version_at_step_none,
        rollback_step_str,
        read_shard_past_end,
        commit_staged_one_part,
        export_a_store,
        encode_index_float,
        tag_none,
    ]
    return [pytest.param(c, id=c.__name__) for c in cases]


@pytest.mark.parametrize("call", _bare_cases())
def test_defect_bare_python_error(tmp_path: Path, call: Any) -> None:
    """docs/api.md:185: "Every error is a `DynstateError`" (a wrong argument is an
    `InvalidDataError`, :195; a row/shard outside a version a `RowOutOfRangeError`, :196).
    Each of these documented calls, given an input a user plausibly passes, raises a bare
    `TypeError` / `IndexError` / `AttributeError` with no URL and no hint — and escapes an
    `except DynstateError` that a training loop or the CLI relies on. (`read_shard(-1)` even
    returns the last shard, where `locate(-1)` raises `RowOutOfRangeError`.)"""
    store, _ = _store(tmp_path)
    with pytest.raises(DynstateError):
        call(store)


# -- gc ---------------------------------------------------------------------------------------


def test_defect_gc_dry_run_none_deletes(tmp_path: Path) -> None:
    """docs/api.md:90: `collect_garbage` is "a dry run unless asked ... `dry_run=False`
    removes". `dry_run=None` — what a config's `dry_run: null` or an unset option passes, and
    what `None` means elsewhere in this API (the default: `outcome_stats(success_above=None)`)
    — is taken as a deleting run: with `keep=1` it collects every version but the head.
    Expected: a dry run, or `InvalidDataError`; never a deletion not asked for with `False`."""
    store, _ = _store(tmp_path)
    try:
        dynstate.collect_garbage(store, keep=1, grace_s=0, dry_run=None)
    except InvalidDataError:
        pass
    assert Store.open(store.url).floor == 0
    assert store.snapshot(1).num_rows == 4


@pytest.mark.parametrize("older_than_s", [math.nan, -3600.0, "1h"], ids=["nan", "negative", "str"])
def test_defect_gc_older_than_s_unchecked(tmp_path: Path, older_than_s: Any) -> None:
    """docs/api.md:90 `collect_garbage(store, ..., older_than_s=None, grace_s=3600, ...)`:
    `grace_s` below 0 is refused with `InvalidDataError`, `older_than_s` is not checked at
    all: NaN and a negative age plan to collect every version but the head ("older than NaN
    seconds" is every version), and `"1h"` (what `dynstate gc --older-than 1h` takes) raises
    a bare `ValueError` from `float()`. A retention rule is the input that deletes data; a
    nonsense one must be refused, naming it."""
    store, _ = _store(tmp_path)
    with pytest.raises(InvalidDataError, match="older"):
        dynstate.collect_garbage(store, older_than_s=older_than_s)


def test_defect_gc_keep_numpy_int_refused_with_a_false_message(tmp_path: Path) -> None:
    """docs/api.md:90 `collect_garbage(store, keep=None, ...)`; the message of a refusal must
    say what to do. `keep=np.int64(2)` (a count computed with numpy) is refused with "keep must
    be at least 1 (the head), not np.int64(2)" — 2 is at least 1, so the message sends the user
    looking for the wrong mistake. Either take it (as `VersionedSampler(batch_size=np.int64)`
    does) or say it must be a Python int."""
    store, _ = _store(tmp_path)
    try:
        result = dynstate.collect_garbage(store, keep=np.int64(2))
    except InvalidDataError as exc:
        assert "at least 1" not in str(exc), str(exc)
    else:
        assert result.floor_after == store.head - 1


# -- staged parts -------------------------------------------------------------------------------


def test_defect_recommitting_a_part_after_gc_collected_its_record_says_stage_again(
    tmp_path: Path,
) -> None:
    """docs/api.md:29-30: "Parts a kept version already holds are refused as committed
    (`CommitConflictError` naming the version), also after gc removed the record of that
    commit." After the part is committed (v5), two more rounds and `gc keep=1` (floor = head
    = 7, v5's record gone but the head still holds the part's rows), committing the same part
    again (a driver replaying pickled parts on resume) raises `CommitConflictError` saying
    "no version from 7 to 7 holds them yet ... if its process died before creating its record,
    the round was NOT stored ... then stage the round again". The head holds them: following
    the advice duplicates the round's rows."""
    store, _ = _store(tmp_path)
    url = store.url
    part = store.stage([{"q": "part", "n": -1}])
    saved = pickle.dumps([part])
    committed = store.commit_staged([part], meta={"step": 3})
    for step in (4, 5):
        store.append([{"q": f"s{step}", "n": step}], meta={"step": step})
    dynstate.collect_garbage(Store.open(url), keep=1, grace_s=0, dry_run=False)
    head = Store.open(url)
    assert "part" in head.snapshot().to_arrow().column("q").to_pylist()
    with pytest.raises(CommitConflictError) as info:
        Store.open(url).commit_staged(pickle.loads(saved), meta={"step": 9})
    message = str(info.value)
    assert "stage the round again" not in message and "NOT stored" not in message, message
    assert re.search(rf"version ({committed}|{head.head})\b", message), message


# -- dynstate.ray ---------------------------------------------------------------------------------


def test_defect_ray_functions_refuse_a_pathlib_path(tmp_path: Path) -> None:
    """docs/ray.md:14-17: `write_round(store_or_url, ...)`, `commit_round`,
    `write_ray_dataset`, `to_ray_dataset(store_or_url, version=None)`; ray.md:70 "a local path
    works on one machine". `Store.open` and `VersionedDataset` take a `pathlib.Path`; every
    `dynstate.ray` function refuses one before doing anything: `InvalidDataError: expected a
    Store or a store URL, not PosixPath` (a message naming no URL). Here: a Path to no store
    must say `StoreNotFoundError`, as `Store.open` and a str URL do."""
    pytest.importorskip("ray.data")
    from dynstate.ray import to_ray_dataset

    with pytest.raises(dynstate.StoreNotFoundError):
        to_ray_dataset(str(tmp_path / "nowhere"))
    with pytest.raises(dynstate.StoreNotFoundError):
        to_ray_dataset(tmp_path / "nowhere")


# -- guards: the documented behaviour that holds -----------------------------------------------


def test_guard_rows_read_back_are_the_rows_appended(tmp_path: Path) -> None:
    """api.md:11-12, :99: rows read through `Snapshot.to_arrow`, the shard files themselves
    (format.md: `data/*.parquet` listed in order by the version's shard list), and
    `VersionedDataset` in every batch format equal what was appended, over small shards, a
    compaction and a rollback; a pathlib path and numpy/torch indices are taken."""
    import torch

    store = Store.open(tmp_path / "store", create=True)
    oracle: list[dict[str, Any]] = []
    for step in range(4):
        rows = [
            {"i": len(oracle) + k, "t": None if k % 3 == 0 else "é" * k, "f": k / 7}
            for k in range(40 * step)  # step 0 adds no rows
        ]
        store.append(rows, shard_bytes=600, meta={"step": step})
        oracle += rows
    snap = store.snapshot()
    assert len(snap.shards) > 4
    assert snap.to_arrow().to_pylist() == oracle
    on_disk = [
        r for s in snap.shards for r in pq.read_table(tmp_path / "store" / s.path).to_pylist()
    ]
    assert on_disk == oracle
    ds = VersionedDataset(tmp_path / "store")
    order = [*range(len(oracle) - 1, -1, -7), 0, 0]
    assert ds.__getitems__(order) == [oracle[i] for i in order]
    assert ds.read_batch(np.array(order), "arrow").to_pylist() == [oracle[i] for i in order]
    assert ds.read_batch(order, "columns")["i"] == [oracle[i]["i"] for i in order]
    assert ds[np.int64(5)] == oracle[5] and ds[torch.tensor(6)] == oracle[6]
    dynstate.compact(store, target_bytes=1 << 20)
    assert store.snapshot().to_arrow().to_pylist() == oracle
    dynstate.rollback(store, step=2)
    kept = store.snapshot().num_rows
    assert kept == 40 + 80 and store.snapshot().to_arrow().to_pylist() == oracle[:kept]
    # an index of the version before the rollback still reads that version's row
    assert ds[dynstate.encode_index(snap.version, len(oracle) - 1)] == oracle[-1]


def test_guard_outcome_stats_match_an_oracle_and_pending_equals_committed(tmp_path: Path) -> None:
    """api.md:58-80: `outcome_stats` — attempts, successes (`score > success_above`), mean,
    `ewma_score` weighted `2 ** ((step - last_step) / half_life)`, first/last step — folded
    here from `outcome_records`; `pending=` equals the statistics after the commit, at the
    default and at other `success_above` / `half_life`."""
    store = Store.open(tmp_path / "store", create=True)
    store.append([{"q": str(i)} for i in range(12)])
    rng = np.random.default_rng(0)
    for step in range(6):
        outcomes = {
            "row": rng.integers(0, 12, 9).tolist(),
            "step": [step] * 9,
            "score": rng.choice([0.0, 0.25, 0.6, 1.0], 9).tolist(),
        }
        asked = [
            store.outcome_stats(pending=outcomes, **kw).to_pylist()
            for kw in ({}, {"success_above": 0.3}, {"half_life": 2.5})
        ]
        store.append([], meta={"step": step}, outcomes=outcomes)
        after = [
            store.outcome_stats(**kw).to_pylist()
            for kw in ({}, {"success_above": 0.3}, {"half_life": 2.5})
        ]
        assert asked == after
    records = store.outcome_records().to_pylist()
    for kw, above, half in (({}, 0.5, 10.0), ({"success_above": 0.3, "half_life": 2.5}, 0.3, 2.5)):
        stats = Store.open(store.url).outcome_stats(**kw).to_pylist()
        for row, got in enumerate(stats):
            mine = [r for r in records if r["row"] == row]
            if not mine:
                assert got["attempts"] == 0 and got["mean_score"] is None
                continue
            last = max(r["step"] for r in mine)
            w = [2 ** ((r["step"] - last) / half) for r in mine]
            assert got["attempts"] == len(mine)
            assert got["successes"] == sum(r["score"] > above for r in mine)
            assert got["mean_score"] == pytest.approx(sum(r["score"] for r in mine) / len(mine))
            assert got["ewma_score"] == pytest.approx(
                sum(wi * r["score"] for wi, r in zip(w, mine, strict=True)) / sum(w)
            )
            assert (got["first_step"], got["last_step"]) == (min(r["step"] for r in mine), last)


def test_guard_documented_refusals_are_typed_and_name_the_store(tmp_path: Path) -> None:
    """A sample of the refusals the docs promise, each the documented `DynstateError` subclass
    with a message naming the store's URL."""
    store, _ = _store(tmp_path)
    url = store.display_url
    with pytest.raises(dynstate.StoreNotFoundError, match=re.escape(str(tmp_path / "none"))):
        Store.open(tmp_path / "none")
    cases = [
        (lambda: store.snapshot(99), VersionNotFoundError),
        (lambda: store.snapshot("no-such-tag"), VersionNotFoundError),
        (lambda: store.snapshot().locate(99), dynstate.RowOutOfRangeError),
        (lambda: store.append([], meta={"step": 1.0}), InvalidDataError),
        (
            lambda: store.append([], outcomes=[{"row": 99, "step": 9, "score": 1.0}]),
            InvalidDataError,
        ),
        (
            lambda: store.append(
                [], outcomes=[{"row": 0, "step": 0, "score": 1.0}], rows_version=-1
            ),
            InvalidDataError,
        ),
        (lambda: store.append([], generator_state={"a": (1, 2)}), InvalidDataError),
        (lambda: store.append([{"q": 1, "n": "x"}]), dynstate.SchemaMismatchError),
        (lambda: dynstate.collect_garbage(store, keep=0), InvalidDataError),
        (lambda: dynstate.compact(store, target_bytes=0), InvalidDataError),
        (
            lambda: dynstate.export(store.snapshot(), tmp_path / "store" / "x.parquet"),
            InvalidDataError,
        ),
        (lambda: dynstate.rollback(store), InvalidDataError),
    ]
    for call, error in cases:
        with pytest.raises(error) as info:
            call()
        assert url in str(info.value), str(info.value)
    store.tag("t", 2)
    with pytest.raises(dynstate.StoreExistsError):
        store.tag("t", 3)
