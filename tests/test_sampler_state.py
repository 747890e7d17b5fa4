"""Every malformed sampler state is refused before anything changes: a typed error with a
one-line message, the sampler exactly as it was (issue 13)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from dynstate import (
    DynstateError,
    StateMismatchError,
    Store,
    UnsupportedFormatError,
    VersionedDataset,
    VersionedSampler,
)


@pytest.fixture()
def setup(tmp_path):
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(20)])
    ds = VersionedDataset(store)
    sampler = VersionedSampler(ds, seed=1, batch_size=4, mode="mix", lag=2)
    it = iter(sampler)
    for _ in range(8):  # two whole steps: a state at a step's end (format 2)
        next(it)
    return ds, sampler.state_dict()


def _with(**changes):
    def edit(state):
        state.update(changes)

    return edit


def _without(key):
    def edit(state):
        del state[key]

    return edit


BAD = [
    ("negative position", _with(position=-1), "position=-1"),
    ("string position", _with(position="8"), "position='8'"),
    ("float position", _with(position=8.0), "position=8.0"),
    ("bool position", _with(position=True), "position=True"),
    ("position past the version", _with(position=21), "position=21"),
    ("huge position", _with(position=2**62), "position="),
    ("negative epoch", _with(epoch=-1), "epoch=-1"),
    ("negative step", _with(step=-3), "step=-3"),
    ("missing position", _without("position"), "lacks position"),
    ("missing several", lambda s: [s.pop(k) for k in ("seed", "step")], "lacks seed, step"),
    ("missing format", _without("format"), "format"),
    ("format zero", _with(format=0), "format"),
    ("format as text", _with(format="2"), "format"),
    ("not a state", lambda s: s.clear(), "not a dynstate sampler state"),
    ("wrong kind", _with(kind="torch.RandomSampler"), "not a dynstate sampler state"),
    ("version as text", _with(version="1"), "version='1'"),
    ("negative version", _with(version=-1), "version"),
    ("unknown mode", _with(mode="stream"), "mode='stream'"),
    ("base ahead of position", _with(base_next=12), "base_next=12"),
    ("fresh version older", _with(fresh_version=0), "fresh_version=0"),
    ("fresh row before the version", _with(fresh_next=3), "fresh_next=3"),
    ("fresh row past its version", _with(fresh_next=99), "row 99"),
    ("shuffle as int", _with(shuffle=1), "shuffle=1"),
    ("zero replicas", _with(num_replicas=0), "num_replicas=0"),
    ("nan share", _with(fresh_share=float("nan")), "fresh_share"),
    ("no version yet a position", _with(version=None, fresh_version=None), "no version"),
    ("format 4 without within_step", _with(format=4, select=None), "within_step=None"),
    ("negative within_step", _with(format=4, select=None, within_step=-1), "within_step=-1"),
    ("within_step as text", _with(format=4, select=None, within_step="2"), "within_step='2'"),
    (
        "within_step with no version",
        _with(format=4, select=None, within_step=2, version=None, fresh_version=None),
        "without a pinned version",
    ),
    ("other store", _with(store_id="0" * 32), "belongs to store"),
    ("rows differ", _with(base_rows=19, position=4, base_next=4), "has 20 rows"),
    ("other seed", _with(seed=2), "seed=2"),
    ("other drop_last", _with(drop_last=True), "drop_last=True"),
    ("other batch size", _with(batch_size=5), "batch_size=5"),
]


@pytest.mark.parametrize("name,edit,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_state_is_refused_and_changes_nothing(setup, name, edit, needle):
    ds, good = setup
    sampler = VersionedSampler(ds, seed=1, batch_size=4, mode="mix", lag=2)
    sampler.load_state_dict(good)
    before = sampler.state_dict()
    state = copy.deepcopy(good)
    edit(state)
    with pytest.raises(StateMismatchError) as info:
        sampler.load_state_dict(state)
    message = str(info.value)
    assert needle in message and "\n" not in message
    assert sampler.state_dict() == before


def test_newer_format_says_upgrade(setup):
    ds, good = setup
    sampler = VersionedSampler(ds, seed=1, batch_size=4, mode="mix", lag=2)
    with pytest.raises(UnsupportedFormatError, match="upgrade dynstate"):
        # 3: a state with a selection policy; 4: one saved within a step
        sampler.load_state_dict({**good, "format": 5})


def test_constructor_refuses_bad_settings(setup):
    ds, _ = setup
    for kwargs in (
        {"num_replicas": 2, "rank": 2},
        {"num_replicas": 0},
        {"rank": -1, "num_replicas": 2},
        {"batch_size": 0},
        {"batch_size": 2.5},
        {"seed": "1"},
        {"drop_last": "yes"},
        {"mode": "mix"},
        {"mode": "mix", "batch_size": 2, "lag": 0},
    ):
        with pytest.raises(DynstateError):
            VersionedSampler(ds, **kwargs)


def test_state_with_ranks_loads_weights_only_and_continues(setup):
    ds, good = setup
    buf = io.BytesIO()
    torch.save(good, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state == good
    # mix mode would wait for rounds: take the epoch-mode reading of the same position
    state.update(mode="epoch", base_next=state["position"])
    a = VersionedSampler(ds, seed=1, batch_size=4, num_replicas=2, rank=1)
    a.load_state_dict(state)
    b = VersionedSampler(ds, seed=1, batch_size=4)
    b.load_state_dict(state)
    rest_b = list(b)
    assert list(a) == [i for k in range(0, len(rest_b), 8) for i in rest_b[k : k + 8][1::2]]


def test_format_1_state_loads(tmp_path):
    """A state written by dynstate before ranks (format 1) resumes where it was."""
    store = Store.open(str(tmp_path / "s"), create=True)
    store.append([{"id": i} for i in range(20)])
    ds = VersionedDataset(store)
    ref = VersionedSampler(ds, seed=4)
    order = list(ref)
    old = {
        "format": 1,
        "kind": "dynstate.VersionedSampler",
        "store_id": ds.store_id,
        "store_url": store.display_url,
        "mode": "epoch",
        "shuffle": True,
        "seed": 4,
        "batch_size": None,
        "fresh_share": 0.25,
        "lag": 1,
        "epoch": 0,
        "version": 1,
        "base_rows": 20,
        "position": 7,
        "step": 0,
        "fresh_next": 20,
        "fresh_version": 1,
    }
    sampler = VersionedSampler(ds, seed=4)
    sampler.load_state_dict(old)
    assert list(sampler) == order[7:]


def test_position_is_one_immutable_value_with_the_state_form(setup):
    """Issue 20.8: the position is a frozen value; its plain-types form is the position part
    of the state, and a loaded state gives the sampler that very value."""
    import dataclasses

    from dynstate.loading.state import Position, check_state

    ds, state = setup
    pos = Position.from_state(check_state(state, ds.store_id, ds.store.display_url))
    with pytest.raises(dataclasses.FrozenInstanceError):
        pos.slot = 0  # type: ignore[misc]
    assert {k: state[k] for k in pos.state("mix")} == pos.state("mix")
    sampler = VersionedSampler(ds, seed=1, batch_size=4, mode="mix", lag=2)
    sampler.load_state_dict(copy.deepcopy(state))
    assert sampler.pos == pos and sampler.position == pos.slot and sampler.step == pos.step
    with pytest.raises(AttributeError):
        sampler.position = 3  # the position changes only as one value
