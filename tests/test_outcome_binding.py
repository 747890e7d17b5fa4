"""Outcomes bind to the rows they were scored on (issue 40.2): outcomes whose rows were read at
a version that a reset took off the lineage — a reset alone, or a reset and then appends that
put other rows at the same numbers — are refused with a CommitConflictError naming both
versions, and the store is left as it was; rebasing over plain appends still lands every score
on the row it was scored on. For ``append``, ``commit_staged`` and ``outcome_stats(pending=)``,
on memory://, a local directory and S3."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from dynstate import CommitConflictError, InvalidDataError, Store
from dynstate.writes import Writer


def rows(tag: str, n: int) -> list[dict[str, Any]]:
    return [{"text": f"{tag} {i}"} for i in range(n)]


def scored(*row_numbers: int, step: int = 0) -> list[dict[str, Any]]:
    return [{"row": r, "step": step, "score": 1.0} for r in row_numbers]


def state(url: str) -> tuple[int, pa.Table, pa.Table, list[str]]:
    """What a fresh handle sees: the head, its statistics, its raw outcome records and the
    files under data/ (a refused commit leaves no shard or outcome file behind)."""
    store = Store.open(url)
    return (
        store.head,
        store.outcome_stats(),
        store.outcome_records(),
        sorted(store.storage.list("data")),
    )


def at_v2(url: str) -> Store:
    """Writer W's handle at version 2: 30 rows (v1) and 10 more (v2)."""
    w = Store.open(url, create=True)
    w.append(rows("first", 30))
    w.append(rows("second", 10))
    assert w.head == 2
    return w


def reset_then_append(url: str) -> None:
    """An operator resets to version 1 (30 rows), another writer appends 10 new rows: row
    35 of version 4 is not the row 35 of version 2."""
    assert Store.open(url).reset(1) == 3
    assert Store.open(url).append(rows("new", 10)) == 4


# -- append ------------------------------------------------------------------------------------


def test_outcomes_of_rows_a_reset_replaced_are_refused(store_url: str) -> None:
    w = at_v2(store_url)
    trained = w.snapshot().to_arrow().slice(35, 1).to_pylist()  # W trains on row 35 of v2
    reset_then_append(store_url)
    before = state(store_url)
    with pytest.raises(CommitConflictError, match=r"version 2\b.*version 4\b"):
        w.append([], outcomes=scored(35))
    assert state(store_url) == before
    # a refusal is no look at the store: trying again is refused again
    with pytest.raises(CommitConflictError, match=r"version 2\b.*version 4\b"):
        w.append(rows("with", 2), outcomes=scored(35))
    assert state(store_url) == before
    # nor does the handle's own commit of new rows only launder them
    assert w.append(rows("plain", 1)) == 5
    with pytest.raises(CommitConflictError, match=r"version 2\b.*version 5\b"):
        w.append([], outcomes=scored(35))
    # the row W trained on is another row now; named explicitly, the new rows take scores
    assert Store.open(store_url).snapshot().to_arrow().slice(35, 1).to_pylist() != trained
    assert w.append([], outcomes=scored(35), rows_version=5) == 6
    assert Store.open(store_url).outcome_records().column("row").to_pylist() == [35]


def test_a_reset_alone_is_refused_also_for_rows_it_kept(store_url: str) -> None:
    """Row 5 exists on both sides of the reset and the old row check passed it; the scores of
    an abandoned lineage's step go nowhere. Row 35 is gone: the reset is named, not the row
    count."""
    w = at_v2(store_url)
    assert Store.open(store_url).reset(1) == 3
    before = state(store_url)
    with pytest.raises(CommitConflictError, match=r"version 2\b.*version 3\b"):
        w.append([], outcomes=scored(5))
    with pytest.raises(CommitConflictError, match=r"version 2\b.*version 3\b"):
        w.append(rows("round", 3), outcomes=scored(35))
    assert state(store_url) == before
    # after a look at the head, the handle's outcomes bind there
    w.refresh()
    assert w.append([], outcomes=scored(5)) == 4


def test_the_handles_own_reset_binds_its_later_outcomes_to_the_new_head(tmp_path) -> None:
    """A rollback on resume: the handle resets, then scores rows of the version it reset to
    (and rows appended since): accepted, and they land on the rows of the kept lineage. A
    reset by another handle in between is still refused."""
    url = str(tmp_path / "store")
    w = at_v2(url)
    assert w.reset(1) == 3
    w.append([], meta={"step": 0}, outcomes=scored(5, 29))
    assert Store.open(url).outcome_records().column("row").to_pylist() == [5, 29]
    assert Store.open(url).reset(1) == 5  # another handle resets and appends
    assert Store.open(url).append(rows("new", 10)) == 6
    with pytest.raises(CommitConflictError, match="version 4"):
        w.append([], meta={"step": 1}, outcomes=scored(5))


def test_rebase_over_plain_appends_lands_scores_on_the_rows_read(store_url: str) -> None:
    w = at_v2(store_url)
    read = w.snapshot().to_arrow()
    other = Store.open(store_url)
    other.append(rows("other", 5))
    other.append([], outcomes=scored(1, step=7))
    version = w.append(rows("mine", 2), outcomes=scored(35, 3, 35, step=1))
    assert version == 5
    records = Store.open(store_url).outcome_records()
    assert records.column("row").to_pylist() == [1, 35, 3, 35]
    assert records.column("step").to_pylist() == [7, 1, 1, 1]
    head = Store.open(store_url).snapshot().to_arrow()
    for row in (35, 3):
        assert head.slice(row, 1).to_pylist() == read.slice(row, 1).to_pylist()
    # an explicit rows_version bounds the rows by that version's
    with pytest.raises(InvalidDataError, match=r"row 41\b.*version 2\b"):
        w.append([], outcomes=scored(41, step=2), rows_version=2)
    assert w.append([], outcomes=scored(41, step=2), rows_version=3) == 6


def test_a_reset_while_the_append_commits_is_refused(tmp_path: Any, monkeypatch) -> None:
    """The check runs again on the parent the record is finally built on: a reset and an
    append land between the checks and the record's create; the round and its outcome file
    are removed. A plain append there is rebased over."""
    url = str(tmp_path / "store")
    w = at_v2(url)
    written_round = Writer._write_round
    meanwhile: list[Any] = []

    def then_others(self: Writer, *args: Any, **kwargs: Any) -> Any:
        result = written_round(self, *args, **kwargs)
        if meanwhile:
            meanwhile.pop()(url)
        return result

    monkeypatch.setattr(Writer, "_write_round", then_others)
    meanwhile.append(reset_then_append)
    before_files = sorted(Store.open(url).storage.list("data"))
    with pytest.raises(CommitConflictError, match=r"version 2\b.*version 4\b"):
        w.append(rows("round", 3), outcomes=scored(35))
    after = state(url)
    assert after[0] == 4 and after[2].num_rows == 0
    assert len(after[3]) == len(before_files) + 1  # the other writer's shard only

    w.refresh()  # W reads again at 4
    meanwhile.append(lambda u: Store.open(u).append(rows("plain", 4)))
    assert w.append(rows("round", 3), outcomes=scored(35)) == 6
    assert Store.open(url).outcome_records().column("row").to_pylist() == [35]


# -- commit_staged -------------------------------------------------------------------------------


def test_commit_staged_binds_outcomes_as_append_does(store_url: str) -> None:
    w = at_v2(store_url)
    staged = w.stage(rows("staged", 2))
    Store.open(store_url).append(rows("plain", 3))
    # over a plain append: committed, the score on the row read
    assert w.commit_staged([staged], outcomes=scored(35)) == 4
    assert Store.open(store_url).outcome_records().column("row").to_pylist() == [35]

    staged = w.stage(rows("staged", 2))
    assert Store.open(store_url).reset(2) == 5
    Store.open(store_url).append(rows("new", 10))
    before = state(store_url)
    with pytest.raises(CommitConflictError, match=r"version 4\b.*version 6\b"):
        w.commit_staged([staged], outcomes=scored(36, step=1))
    after = state(store_url)
    assert after[:3] == before[:3]
    # nothing written; the refusal of the caller's outcomes leaves the part staged, for the
    # caller to commit without them or discard
    assert after[3] == before[3]
    w.discard([staged])
    gone = state(store_url)[3]
    assert gone == [n for n in before[3] if not any(n in s.path for s in staged.shards)]


def test_a_reset_while_commit_staged_commits_is_refused(tmp_path: Any, monkeypatch) -> None:
    url = str(tmp_path / "store")
    w = at_v2(url)
    staged = w.stage(rows("staged", 2))
    checked = Writer._check_unleased  # the last step before the record is built
    calls: list[int] = []

    def then_reset(self: Writer, parts: Any) -> None:
        checked(self, parts)
        if not calls:
            calls.append(1)
            reset_then_append(url)

    monkeypatch.setattr(Writer, "_check_unleased", then_reset)
    with pytest.raises(CommitConflictError, match=r"version 2\b.*version 4\b"):
        w.commit_staged([staged], outcomes=scored(35))
    after = state(url)
    assert after[0] == 4 and after[2].num_rows == 0
    assert not [n for n in after[3] if any(n in s.path for s in staged.shards)]


# -- outcome_stats(pending=) -------------------------------------------------------------------


def test_pending_outcomes_bind_as_commits_do(store_url: str) -> None:
    w = at_v2(store_url)
    other = Store.open(store_url)
    other.append(rows("plain", 3))
    # over plain appends: the statistics the commit will have
    pending = w.outcome_stats(pending=scored(35, 35, 4))
    assert pending.column("attempts").to_pylist()[35] == 2
    assert w.append([], outcomes=scored(35, 35, 4)) == 4
    assert Store.open(store_url).outcome_stats().equals(pending)

    reset_then = Store.open(store_url)
    reset_then.reset(2)
    reset_then.append(rows("new", 5))  # version 6: row 41 is another row now
    with pytest.raises(CommitConflictError, match=r"version 4\b.*version 6\b"):
        w.outcome_stats(pending=scored(41, step=1))
    # a refusal is no look: asked again, the same
    with pytest.raises(CommitConflictError, match=r"version 4\b.*version 6\b"):
        w.outcome_stats(pending=scored(41, step=1))
    with pytest.raises(CommitConflictError, match=r"version 4\b.*version 6\b"):
        w.outcome_stats(6, pending=scored(41, step=1), rows_version=4)
    # named at the version read, pending outcomes count there
    stats = w.outcome_stats(6, pending=scored(41, step=1), rows_version=6)
    assert stats.column("attempts").to_pylist()[41] == 1
    # an explicit version with no rows_version: its own rows
    assert w.outcome_stats(6, pending=scored(41, step=1)).equals(stats)


# -- verl's round commit ---------------------------------------------------------------------


def verl_batch(rows_read: list[int], versions: list[int]) -> Any:
    """A scored batch as verl's trainers hand it to the round commit: the dataset's
    ``dynstate_row`` / ``dynstate_version`` per item and verl's ``token_level_scores``."""
    import numpy as np
    import torch
    from verl import DataProto

    return DataProto.from_dict(
        tensors={"token_level_scores": torch.ones(len(rows_read), 3)},
        non_tensors={
            "dynstate_row": np.array(rows_read, dtype=object),
            "dynstate_version": np.array(versions, dtype=object),
        },
    )


def test_verl_batches_bind_their_outcomes_to_the_version_the_sampler_read(
    tmp_path: Any,
) -> None:
    """What DynstateRLDataset.commit_round passes: the batch's outcomes with the newest
    version its items were read at. A batch read before a reset (fresh rows of a newer
    version among them or not) is refused; one read over plain appends commits."""
    from dynstate.verl.outcomes import batch_outcomes, batch_rows_version

    url = str(tmp_path / "store")
    w = at_v2(url)
    Store.open(url).append(rows("plain", 2))  # version 3: rows of version 2 unchanged
    batch = verl_batch([35, 41], [2, 3])
    assert batch_rows_version(batch, w) == 3
    w.refresh()  # the trainer's handle is at the head: only the batch knows its versions
    assert w.append([], outcomes=batch_outcomes(batch, 1), rows_version=3) == 4

    reset_then = Store.open(url)
    reset_then.reset(2)
    reset_then.append(rows("new", 10))  # version 6
    stale = verl_batch([35], [4])
    w.refresh()
    before = state(url)
    with pytest.raises(CommitConflictError, match=r"version 4\b.*version 6\b"):
        w.append([], outcomes=batch_outcomes(stale, 2), rows_version=batch_rows_version(stale, w))
    assert state(url) == before
    # items read on both sides of the reset cannot share one step's commit
    with pytest.raises(CommitConflictError, match=r"version 4\b.*version 6\b"):
        batch_rows_version(verl_batch([35, 36], [4, 6]), w)
