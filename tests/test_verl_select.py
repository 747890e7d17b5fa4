"""Selecting tasks through verl's real ``fit()``, both trainers (issue 22, points 3 and 5):
``data.dynstate.select`` configures a policy of :mod:`dynstate.loading.selection` with no
custom sampler class; every step's rows follow it, the ``dynstate/select/*`` figures verl's
tracker logs show it at work, and a run SIGKILLed and resumed trains exactly the
uninterrupted run's batches and ends with its store.

The policy of both runs: a pass-rate band ``[0.5, 1]`` with rows never tried in. The CPU
stand-in policy answers ``a + b`` wrong exactly when it is divisible by 3, so every row has pass
rate 0 or 1 once tried, and the band drops the failed ones. Mix mode with ``lag`` 1: step
``s`` draws by the statistics of the round of step ``s - 1`` (the import's for step 1).
Fresh rows (generated ones, taking their share of each step first) do not go through the
policy; imported rows are drawn only by it, so those are the ones checked against the band.

Legacy trainer: the CPU driver of tests/test_verl.py (tests/verl_cpu.py), here; V1 trainer: the
same checks (``check_selection``) on the driver of tests/test_verl_v1.py, in that file, so that
one pytest-xdist worker runs every V1 driver in turn (tests/conftest.py). verl missing is a
failure, never a skip.
"""

from __future__ import annotations

import os
import sys

import pytest
import verl  # noqa: F401 - a broken install must fail these tests
from omegaconf import OmegaConf

import dynstate
from dynstate.errors import InvalidDataError
from dynstate.history.story import step_story

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import test_verl  # noqa: E402
from test_verl import (  # noqa: E402
    IMPORTED,
    STEPS,
    assert_refused_unchanged,
    batches,
    call,
    content,
    events,
    new_run,
    output,
    resumed_copy,
)
from test_verl_outcomes import outcome_state, round_versions, tracked  # noqa: E402

world = test_verl.world  # the module's fixture: one zygote that has imported verl

pytestmark = pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")

BAND = {"policy": "band", "lo": 0.5, "hi": 1.0}
SELECT = {"mode": "mix", "fresh_share": 0.5, "lag": 1, "select": BAND}


def _rates(store, version: int) -> tuple[list[int], list[int]]:
    stats = store.outcome_stats(version)
    return stats.column("attempts").to_pylist(), stats.column("successes").to_pylist()


def _in_band(attempts: int, successes: int) -> bool:
    return attempts == 0 or BAND["lo"] <= successes / attempts <= BAND["hi"]


def check_selection(url: str, log: dict[int, dict], imported: int, figures: dict) -> None:
    """Every imported row a step trained is in the band by the statistics of the round of the
    step before (lag 1), some rows were out of it by then (the band had work to do), and the
    step's ``dynstate/select/*`` figures are those of the store."""
    store = dynstate.Store.open(url)
    by_step = round_versions(store)
    assert sorted(by_step) == sorted(log)
    excluded_seen = 0
    for step, b in sorted(log.items()):
        drew_by = by_step[step - 1] if step > 1 else 1  # the import is version 1
        attempts, successes = _rates(store, drew_by)
        for row in b["rows"]:
            if row < imported:
                assert _in_band(attempts[row], successes[row]), (step, row, drew_by)
        excluded_seen += sum(
            not _in_band(a, s)
            for a, s in zip(attempts[:imported], successes[:imported], strict=True)
        )
        # the figures: what this round makes eligible, and how the step's rows were drawn
        f = figures[step]
        after = _rates(store, by_step[step])
        eligible = sum(_in_band(a, s) for a, s in zip(*after, strict=True))
        assert f["select/eligible"] == eligible, step
        # the step's story (dynstate show, serve) names the policy the round ran with and
        # counts the same eligible rows from the store alone
        story = step_story(store, by_step[step])
        assert story["policy"] == {
            "policy": "band",
            "params": {"lo": BAND["lo"], "hi": BAND["hi"], "untried": True},
        }, step
        assert story["weights"]["eligible"] == eligible, step
        assert f["select/stats_version"] == drew_by, step
        untried = [r for r in b["rows"] if attempts[r] == 0]
        assert f["select/drawn_untried"] == len(untried), step
        rates = [successes[r] / attempts[r] for r in b["rows"] if attempts[r]]
        for i in range(5):
            name = f"select/drawn_pass_rate_{i / 5:.1f}_{(i + 1) / 5:.1f}"
            assert f[name] == sum(min(int(r * 5), 4) == i for r in rates), (step, name)
    assert excluded_seen > 0, "no row ever left the band: the policy was not tested"
    # drawn with replacement (the epoch's permutation would visit each row once): a row that
    # fell out of the band could have been drawn again, and was not
    drawn = [r for step in sorted(log) for r in sorted(set(log[step]["rows"])) if r < imported]
    assert len(drawn) > len(set(drawn)), "no imported row was drawn twice: not the policy's draw"


# -- legacy trainer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def select_reference(world):
    spec = new_run(world, "select-ref", dynstate=SELECT)
    assert call(world, spec) == 0, output(spec)
    (run,) = events(spec)
    return spec, batches(run), content(spec), outcome_state(spec["store"])


@pytest.mark.slow
def test_legacy_selection_follows_the_policy_and_resumes_exactly(world, select_reference):
    ref_spec, ref_batches, ref_final, ref_state = select_reference
    assert sorted(ref_batches) == list(range(1, STEPS + 1))
    check_selection(ref_spec["store"], ref_batches, IMPORTED, tracked(ref_spec))
    # the policy's identity is in the checkpoint's sampler state
    import torch

    data = torch.load(os.path.join(ref_spec["ckpt"], "global_step_2", "data.pt"), weights_only=True)
    assert dynstate.find_sampler_state(data)["select"] == {
        "policy": "band",
        "params": {"lo": 0.5, "hi": 1.0, "untried": True},
    }
    spec = new_run(world, "select-chain", dynstate=SELECT)
    for kill in ([3, "committed"], [4, "saved"]):
        assert call(world, {**spec, "kill": kill}) == -9, output(spec)
    assert call(world, spec) == 0, output(spec)
    runs = events(spec)
    assert [r[0]["resumed_from"] for r in runs] == [0, 2, 4]
    for r in runs:
        for step, b in batches(r).items():
            assert (b["rows"], b["scores"]) == (
                ref_batches[step]["rows"],
                ref_batches[step]["scores"],
            ), step
    assert content(spec) == ref_final
    assert outcome_state(spec["store"]) == ref_state


@pytest.mark.slow
def test_legacy_resume_with_another_policy_is_refused_before_the_rollback(world, select_reference):
    other = {**SELECT, "select": {"policy": "band", "lo": 0.2, "hi": 1.0}}
    spec = resumed_copy(world, "select-changed", select_reference[0], 4, dynstate=other)
    assert_refused_unchanged(world, spec, 4, "StateMismatchError", "select=", "'lo': 0.5")


def test_legacy_bad_selection_key_is_refused_when_verl_builds_the_dataset(world):
    spec = new_run(world, "select-bad", dynstate={"select": {"policy": "band", "low": 0.3}})
    assert call(world, spec) == 1
    out = output(spec, tail=10**8)
    assert "InvalidDataError" in out
    assert "data.dynstate.select.low is not a setting of policy band" in out
    assert "it takes lo, hi, untried" in out
    assert events(spec) == []  # refused before any step


# -- the settings, refused by name ----------------------------------------------------------------


def _data(select) -> object:
    return OmegaConf.create({"train_batch_size": 4, "dynstate": {"url": "/x", "select": select}})


@pytest.mark.parametrize(
    ("select", "needles"),
    [
        ({"policy": "band", "lag": 2}, ["select.lag", "data.dynstate.lag", "lo, hi, untried"]),
        ({"policy": "learnability", "lo": 0.1}, ["select.lo", "it takes floor, neutral"]),
        ({"policy": "pools", "bounds": [0.5]}, ["policy pools", "names"]),
        ({"policy": "hardest"}, ["policy=hardest names no policy", "band, learnability, pools"]),
        ({"lo": 0.1}, ["select.policy is not set"]),
        ({"policy": "band", "lo": 0.9, "hi": 0.1}, ["policy band", "lo=0.9 > hi=0.1"]),
        ({"policy": "no_such_module:fn"}, ["no_such_module:fn"]),
        ({"policy": "os.path:join", "floor": 1}, ["select.floor", "it takes params, uses_step"]),
        ("band", ["must be a mapping"]),
    ],
)
def test_bad_selection_settings_are_refused_naming_the_key(select, needles):
    from dynstate.verl import Settings

    with pytest.raises(InvalidDataError) as err:
        Settings.from_config(_data(select))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_selection_settings_make_the_policies():
    from dynstate.verl import Settings

    pools = {"bounds": [0.2, 0.8], "names": ["hard", "mid", "easy"], "shares": [1, 2, 1]}
    cases = [
        (BAND, "band"),
        ({"policy": "learnability", "floor": 0.02}, "learnability"),
        ({"policy": "pools", **pools, "unseen": "mid"}, "pools"),
        ({"policy": "os.path:join", "uses_step": False}, "function"),
    ]
    for select, name in cases:
        assert Settings.from_config(_data(select)).select.name == name
    assert Settings.from_config(_data(None)).select is None
    with pytest.raises(InvalidDataError, match=r"data\.dynstate\.slect is not a dynstate setting"):
        Settings.from_config(OmegaConf.create({"dynstate": {"url": "/x", "slect": BAND}}))
