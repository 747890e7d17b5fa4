"""Selection's resume promises beyond one world size: mix mode with a policy resumed at
another world size continues the stream the sampler promises for elastic resume (the new
ranks take alternate slots of the draw one rank with their joint batch makes from the same
state), and a resume at step 10,000 does the same work as one at step 10 — counted as
storage operations and statistics builds, not timed."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynstate import Learnability, Store, VersionedDataset, VersionedSampler, find_sampler_state
from dynstate.storage import Storage

sys.path.insert(0, str(Path(__file__).parent))
from test_selection import Run, _train


@pytest.mark.parametrize("policy", ["learnability", "pools"])
def test_mix_mode_resumed_at_another_world_size(tmp_path, policy):
    """Saved at 2 ranks, resumed at 3 (batch 3 each): every step the 3 ranks take the
    alternate thirds of what one rank with a batch of 9 draws from the same state and
    store — fresh rows and policy rows alike — and the stores end equal."""
    run = Run(
        url=str(tmp_path / "run"),
        mode="mix",
        policy=policy,
        ranks=2,
        batch=3,
        drop_last=True,
        steps=13,
        rows=30,
    )
    _, states = _train(run, stop=5, ckpt_at=4)
    assert states is not None
    state = find_sampler_state(states[0])
    assert state == find_sampler_state(states[1]) and state["mode"] == "mix"
    shutil.copytree(run.url, tmp_path / "copy")
    three, _ = _train(run, start=5, sampler_state=state, ranks=3)
    one_run = dataclasses.replace(run, url=str(tmp_path / "copy"), batch=9)
    one, _ = _train(one_run, start=5, sampler_state={**state, "batch_size": 9}, ranks=1)
    assert three.keys() == one.keys() and len(three) == 8
    for step, batches in three.items():
        joint = one[step][0]
        assert batches == [joint[0::3], joint[1::3], joint[2::3]], step
    heads = [Store.open(u).snapshot().to_arrow() for u in (run.url, one_run.url)]
    assert heads[0].equals(heads[1])
    assert Store.open(run.url).outcome_stats().equals(Store.open(one_run.url).outcome_stats())


def _state_at(url: str, first_step: int, steps: int) -> dict[str, Any]:
    """A mix-mode learnability run whose steps are numbered from ``first_step`` (as a run
    resumed many times, or a trainer counting from 9,990): ``steps`` steps, a round with
    outcomes each; returns the sampler state after them."""
    store = Store.open(url, create=True)
    store.append([{"id": i} for i in range(40)])
    sampler = VersionedSampler(
        VersionedDataset(store),
        mode="mix",
        batch_size=4,
        lag=1,
        first_step=first_step,
        select=Learnability(),
    )
    it = iter(sampler)
    for k in range(steps):
        rows = [next(it) & ((1 << 40) - 1) for _ in range(4)]
        step = first_step + k
        outcomes = [{"row": r, "step": step, "score": float(r % 3 == 0)} for r in rows]
        store.append([{"id": 100 + k}], meta={"step": step}, outcomes=outcomes)
    return sampler.state_dict()


def _resume_work(url: str, state: dict[str, Any], first_step: int, monkeypatch) -> dict[str, Any]:
    """What a fresh handle does to load ``state`` and draw the next step: storage operations
    by kind, statistics tables read, weights built over every row."""
    ops: Counter[str] = Counter()
    stats_calls = [0]
    real_call, real_stats = Storage._call, Store.outcome_stats

    def counting_call(self, what, rel, fn, **kw):
        ops[what] += 1
        return real_call(self, what, rel, fn, **kw)

    def counting_stats(self, *args, **kw):
        stats_calls[0] += 1
        return real_stats(self, *args, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(Storage, "_call", counting_call)
        patch.setattr(Store, "outcome_stats", counting_stats)
        sampler = VersionedSampler(
            VersionedDataset(Store.open(url)),
            mode="mix",
            batch_size=4,
            lag=1,
            first_step=first_step,
            select=Learnability(),
        )
        sampler.load_state_dict(state)
        rows = [i & ((1 << 40) - 1) for _, i in zip(range(4), iter(sampler), strict=False)]
    assert sampler._selector is not None
    return {
        "ops": dict(ops),
        "stats": stats_calls[0],
        "rebuilds": sampler._selector.rebuilds,
        "reweighed": sampler._selector.reweighed,
        "rows": len(rows),
        "step": sampler.pos.step - first_step,
    }


def test_resume_at_step_10000_costs_what_step_10_costs(tmp_path, monkeypatch):
    """Two stores of the same shape, one counting its steps from 0 and one from 9,990; a
    state after 10 steps resumes at step 10 in one and step 10,000 in the other. Loading it
    and drawing the next step does exactly the same storage operations, reads one
    statistics table and builds the weights once, in both: nothing of the 10,000 steps
    before is replayed (the draw is keyed by the step)."""
    early = _state_at(str(tmp_path / "early"), 0, 10)
    late = _state_at(str(tmp_path / "late"), 9_990, 10)
    assert (early["step"], late["step"]) == (10, 10_000)
    at_10 = _resume_work(str(tmp_path / "early"), early, 0, monkeypatch)
    at_10000 = _resume_work(str(tmp_path / "late"), late, 9_990, monkeypatch)
    assert at_10000 == at_10
    assert at_10["stats"] == 1 and at_10["rebuilds"] == 1 and at_10["rows"] == 4
    assert 0 < sum(at_10["ops"].values()) < 60, at_10["ops"]  # a few dozen metadata reads


@pytest.mark.slow
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mode=st.sampled_from(["epoch", "mix"]),
    policy=st.sampled_from(["learnability", "band", "pools", "function"]),
    before=st.sampled_from([1, 2]),
    after=st.sampled_from([1, 2, 3]),
    ckpt_at=st.integers(0, 6),
    seed=st.integers(0, 2**31),
)
def test_world_size_change_property(tmp_path_factory, mode, policy, before, after, ckpt_at, seed):
    """Over mode, policy, the world size before and after and the checkpoint step: the ranks
    resumed at the new world size take the alternate slots of the draw one rank with their
    joint batch makes from the same state and store, step by step (batch 3, fresh_share 0.34
    and drop_last, for which the fresh counts agree)."""
    tmp = tmp_path_factory.mktemp("elastic")
    run = Run(
        url=str(tmp / "run"),
        mode=mode,
        policy=policy,
        ranks=before,
        batch=3,
        drop_last=True,
        steps=ckpt_at + 5,
        rows=20,
        seed=seed,
    )
    _, states = _train(run, stop=ckpt_at + 1, ckpt_at=ckpt_at)
    assert states is not None
    state = find_sampler_state(states[0])
    shutil.copytree(run.url, tmp / "copy")
    split, _ = _train(run, start=ckpt_at + 1, sampler_state=state, ranks=after)
    joint_run = dataclasses.replace(run, url=str(tmp / "copy"), batch=3 * after)
    joint, _ = _train(
        joint_run, start=ckpt_at + 1, sampler_state={**state, "batch_size": 3 * after}, ranks=1
    )
    assert split.keys() == joint.keys() and len(split) == 4
    for step, batches in split.items():
        assert batches == [joint[step][0][r::after] for r in range(after)], step
