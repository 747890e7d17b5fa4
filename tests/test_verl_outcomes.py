"""Outcomes as data state through verl's real ``fit()`` (issue 21, points 3 and 4): each step's
outcomes (one record per response, GRPO groups included, the score verl logs as
``critic/score``) committed with the step's round, the stateful "hardest first" example
generator (examples/verl/hardest_first.py) choosing its sources from the per-row statistics,
its state committed with its round and loaded on resume, and the ``dynstate/*`` figures in
the metrics verl's tracker logs. Killed at the instants the existing kill chains use and
resumed: batches, final store, outcome records, statistics and generator states equal the
uninterrupted run's.

Legacy trainer: the CPU driver of tests/test_verl.py (tests/verl_cpu.py); V1 trainer: the one of
tests/test_verl_v1.py (tests/verl_v1_standins.py). verl missing is a failure, never a skip."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
import verl  # noqa: F401 - a broken install must fail these tests

import dynstate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "verl"))

import test_verl  # noqa: E402
from hardest_first import hardest_rows  # noqa: E402
from test_verl import (  # noqa: E402
    IMPORTED,
    STEPS,
    batches,
    call,
    content,
    events,
    new_run,
    output,
    rounds,
)

world = test_verl.world  # the module's fixture: one zygote that has imported verl

pytestmark = pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")

HARDEST = {
    "path": os.path.join(ROOT, "examples", "verl", "hardest_first.py"),
    "name": "HardestFirst",
    "max_new": 3,
}
EPOCH = {"batch_size": 6}
# the kill chains draw their rows by a learnability policy (issue 22): the CPU stand-in policy
# gets every row always right or always wrong, so tried rows weigh the floor and rows never
# tried (the generated ones, too) the neutral weight
LEARN = {"policy": "learnability"}
LEARN_STATE = {"policy": "learnability", "params": {"floor": 0.01, "neutral": 0.25}}
RESPONSES = 2  # actor_rollout_ref.rollout.n in both drivers: a GRPO group of 2 per prompt


def outcome_state(url: str, storage_options=None) -> dict:
    """What a run leaves of outcomes: the head's records and statistics, and the generator
    state committed with each step's round."""
    store = dynstate.Store.open(url, storage_options=storage_options)
    states = {step: store.generator_state(v) for step, v in round_versions(store).items()}
    return {
        "records": store.outcome_records().to_pylist(),
        "stats": store.outcome_stats().to_pylist(),
        "states": states,
    }


def round_versions(store) -> dict[int, int]:
    """Step -> the version of its round on the head's lineage (rollback resets excluded)."""
    out = {}
    for v in dynstate.lineage(store):
        meta = store.commit_record(v).meta
        if "step" in meta and "rollback_from" not in meta and "verl_resume_step" not in meta:
            assert meta["step"] not in out
            out[meta["step"]] = v
    return out


def tracked(spec: dict) -> dict[int, dict[str, float]]:
    """The dynstate/* figures of each step in verl's console tracker output (the last run's
    line wins for a step trained twice)."""
    out: dict[int, dict[str, float]] = {}
    with open(spec["output"]) as f:
        for line in f:
            if not line.startswith("step:"):
                continue
            step = int(line.split(" - ", 1)[0][len("step:") :])
            figures = re.findall(r"dynstate/([\w./]+):(?:np\.float\d+\()?([-0-9.e+]+)", line)
            if figures:
                out[step] = {k: float(v) for k, v in figures}
    return out


def check_outcomes_of_run(url: str, log: dict[int, dict], imported: int, storage_options=None):
    """Per step: the round's commit holds exactly the step's outcomes (one per response, the
    batch's rows and sequence scores), the version before it none of them; the round's rows
    vary the hardest rows by the statistics before it plus the step's batch; statistics are
    those of the records."""
    store = dynstate.Store.open(url, storage_options=storage_options)
    lineage = list(dynstate.lineage(store))  # newest first
    by_step = round_versions(store)
    assert sorted(by_step) == sorted(log)
    final = store.snapshot().to_arrow().to_pylist()
    for step, v in by_step.items():
        previous = lineage[lineage.index(v) + 1]  # the version the round was appended to
        mine = [r for r in store.outcome_records(v).to_pylist() if r["step"] == step]
        assert not [r for r in store.outcome_records(previous).to_pylist() if r["step"] == step]
        b = log[step]
        assert [r["row"] for r in mine] == b["rows"]
        assert [r["score"] for r in mine] == pytest.approx(b["scores"])
        # GRPO: every prompt of the step has its n responses recorded (a policy draws with
        # replacement, so a row drawn twice in a step has twice n)
        counts = np.bincount(b["rows"])
        assert set(counts[counts > 0] % RESPONSES) == {0}
        # the generator's sources: the hardest rows by the statistics of the version before
        # the round, with the step's own scores added, and the picks its state held then
        stats = store.outcome_stats(previous)
        attempts = np.asarray(stats.column("attempts").to_pylist())
        successes = np.asarray(stats.column("successes").to_pylist())
        for row, score in zip(b["rows"], b["scores"], strict=True):
            attempts[row] += 1
            successes[row] += score > 0.5
        before = store.generator_state(previous) or {"picked": {}}
        picked = {int(r): n for r, n in before["picked"].items()}
        expected = hardest_rows(attempts, successes, picked, HARDEST["max_new"])
        start = store.snapshot(previous).num_rows
        added = final[start : store.snapshot(v).num_rows]
        assert [r["_dynstate_source"] for r in added] == [[r] for r in expected], step
    # statistics at the head against the records, brute force
    records = store.outcome_records().to_pylist()
    stats = {s["row"]: s for s in store.outcome_stats().to_pylist()}
    assert len(stats) == len(final)
    for row, s in stats.items():
        mine = [r["score"] for r in records if r["row"] == row]
        assert s["attempts"] == len(mine)
        assert s["successes"] == sum(x > 0.5 for x in mine)
        if mine:
            assert s["mean_score"] == pytest.approx(sum(mine) / len(mine))
    # generated rows were trained on too (they reach training in later epochs/steps)
    assert any(s["attempts"] for row, s in stats.items() if row >= imported)


# -- legacy trainer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hardest_reference(world):
    spec = new_run(world, "hardest-ref", datagen=HARDEST, dynstate={"select": LEARN}, **EPOCH)
    assert call(world, spec) == 0, output(spec)
    (run,) = events(spec)
    assert run[0]["resumed_from"] == 0 and run[-1]["event"] == "done"
    return spec, batches(run), content(spec), outcome_state(spec["store"])


def test_legacy_records_outcomes_state_and_figures_with_each_round(hardest_reference):
    spec, ref_batches, final, state = hardest_reference
    assert sorted(ref_batches) == list(range(1, STEPS + 1))
    check_outcomes_of_run(spec["store"], ref_batches, IMPORTED)
    # the stateful generator: its state after each round, as committed with it
    made = 0
    for step in range(1, STEPS + 1):
        made += rounds(spec)[step]["rows"]
        assert state["states"][step]["made"] == made
    assert made == len(final) - IMPORTED > 0
    check_figures(spec["store"], tracked(spec), STEPS)


def check_policy_at_work(ckpt: str, step: int, figures: dict[int, dict[str, float]] | None):
    """The checkpoint's sampler state names the learnability policy, and (with the tracker's
    figures) every step logged the version whose statistics drew its rows."""
    import torch

    data = torch.load(os.path.join(ckpt, f"global_step_{step}", "data.pt"), weights_only=True)
    assert dynstate.find_sampler_state(data)["select"] == LEARN_STATE
    if figures is not None:
        assert figures and all("select/stats_version" in f for f in figures.values()), figures


def check_figures(url: str, figures: dict[int, dict[str, float]], steps: int) -> None:
    """The dynstate/* figures verl's tracker logged with each step are those of its round."""
    assert sorted(figures) == list(range(1, steps + 1))
    store = dynstate.Store.open(url)
    for step, v in round_versions(store).items():
        f = figures[step]
        meta = store.commit_record(v).meta
        stats = store.outcome_stats(v).to_pylist()
        rates = [s["successes"] / s["attempts"] for s in stats if s["attempts"]]
        assert f["version"] == v and f["rows_added"] == meta["rows"]
        assert f["rows_total"] == store.snapshot(v).num_rows
        assert f["rows_trained"] == len(rates)
        bands = [f[f"pass_rate_{i / 5:.1f}_{(i + 1) / 5:.1f}"] for i in range(5)]
        assert bands == [sum(min(int(r * 5), 4) == i for r in rates) for i in range(5)]


@pytest.mark.slow
def test_legacy_stateful_generator_killed_at_every_instant_resumes_exactly(
    world, hardest_reference
):
    _, ref_batches, ref_final, ref_state = hardest_reference
    kills = [
        (2, "committed"),  # round 2 (outcomes, state) committed, checkpoint 2 not written
        (3, "committed"),  # round 3 committed, resume from checkpoint 2
        (4, "saved"),  # right after checkpoint 4
        (5, "rollout"),  # inside the agent loop of step 5
        (6, "validation"),  # in validation, after checkpoint 6
    ]
    spec = new_run(world, "hardest-chain", datagen=HARDEST, dynstate={"select": LEARN}, **EPOCH)
    for step, instant in kills:
        status = call(world, {**spec, "kill": [step, instant]})
        assert status == -9, f"not killed at {step}/{instant}: {status}\n{output(spec)}"
    assert call(world, spec) == 0, output(spec)
    runs = events(spec)
    assert [run[0]["resumed_from"] for run in runs] == [0, 0, 2, 4, 4, 6]
    for run in runs:
        for step, b in batches(run).items():
            ref = ref_batches[step]
            assert (b["rows"], b["prompts"], b["scores"]) == (
                ref["rows"],
                ref["prompts"],
                ref["scores"],
            ), f"step {step} differs from the uninterrupted run"
    assert content(spec) == ref_final
    # the abandoned rounds' outcomes (steps 3, 5, 6 of killed runs) do not leak
    assert outcome_state(spec["store"]) == ref_state
    check_policy_at_work(spec["ckpt"], 6, tracked(spec))


@pytest.mark.slow
@pytest.mark.s3
def test_legacy_mix_mode_on_s3_with_workers_resumes_exactly(world, s3_endpoint):
    """Mix mode, a store on the loopback S3 server, two loader workers: the stateful
    generator's rounds, outcomes and state after kills right after a checkpoint and right
    after a round's commit equal the uninterrupted run's."""
    from conftest import s3_url

    mix = {"mode": "mix", "fresh_share": 0.5, "lag": 5, "select": LEARN}
    extra = {"num_workers": 2, "dynstate": mix}
    ref = new_run(world, "hardest-mix-ref", store=s3_url(), datagen=HARDEST, **extra)
    assert call(world, ref) == 0, output(ref)
    (run,) = events(ref)
    ref_batches = batches(run)
    check_outcomes_of_run(ref["store"], ref_batches, IMPORTED)
    ref_state = outcome_state(ref["store"])
    spec = new_run(world, "hardest-mix-chain", store=s3_url(), datagen=HARDEST, **extra)
    for kill in ([4, "saved"], [6, "committed"]):
        assert call(world, {**spec, "kill": kill}) == -9, output(spec)
    assert call(world, spec) == 0, output(spec)
    runs = events(spec)
    assert [r[0]["resumed_from"] for r in runs] == [0, 4, 4]
    for r in runs:
        for step, b in batches(r).items():
            assert (b["rows"], b["scores"]) == (
                ref_batches[step]["rows"],
                ref_batches[step]["scores"],
            ), step
    assert content(spec) == content(ref)
    assert outcome_state(spec["store"]) == ref_state
    check_policy_at_work(spec["ckpt"], 6, tracked(spec))


# -- V1 trainer ----------------------------------------------------------------------------------


# The V1 trainer's outcome checks (the functions above) run on the V1 kill chains of
# tests/test_verl_v1.py: one chain checks the stream and the outcomes, so each expensive V1
# run is made once.


# -- verl's old generator interface, with state ----------------------------------------------

OLD_STATEFUL = '''
import datasets
from verl.experimental.dynamic_dataset.dynamicgen_dataset import AbstractDataGenerator


class LeastSolved(AbstractDataGenerator):
    """verl's old interface with state: each call copies the trained row with the fewest
    successes so far (the statistics of the dataset it receives), numbered by its calls.
    ``attempts`` is what the statistics with this step's outcomes (pending=True) count."""

    def __init__(self, config=None):
        super().__init__(config)
        self.calls = 0
        self.attempts = 0

    def state_dict(self):
        return {"calls": self.calls, "attempts": self.attempts}

    def load_state_dict(self, state):
        self.calls, self.attempts = state["calls"], state["attempts"]

    def generate(self, dataset):
        self.calls += 1
        self.attempts = sum(dataset.outcome_stats(pending=True).column("attempts").to_pylist())
        trained = [s for s in dataset.outcome_stats().to_pylist() if s["attempts"]]
        if not trained:
            return []
        pick = min(trained, key=lambda s: (s["successes"], s["row"]))["row"]
        row = dict(dataset.dataframe[pick])
        row["extra_info"] = {**row["extra_info"], "index": 300_000 + self.calls}
        return datasets.Dataset.from_list([row])
'''


@pytest.mark.slow
def test_old_interface_stateful_generator_resumes_exactly(world, tmp_path):
    path = tmp_path / "old_stateful.py"
    path.write_text(OLD_STATEFUL)
    datagen = {"path": str(path), "name": "LeastSolved"}
    ref = new_run(world, "old-stateful-ref", datagen=datagen, **EPOCH)
    assert call(world, ref) == 0, output(ref)
    ref_state = outcome_state(ref["store"])
    assert {s: state["calls"] for s, state in ref_state["states"].items()} == {
        s: s for s in range(1, STEPS + 1)
    }
    # the statistics a generator reads with pending=True are those its round's version has
    store = dynstate.Store.open(ref["store"])
    for step, version in round_versions(store).items():
        attempts = sum(store.outcome_stats(version).column("attempts").to_pylist())
        assert ref_state["states"][step]["attempts"] == attempts > 0
    final = content(ref)
    assert [r["extra_info"]["index"] for r in final[IMPORTED:]] == [
        300_000 + s for s in range(2, STEPS + 1)
    ]
    spec = new_run(world, "old-stateful-chain", datagen=datagen, **EPOCH)
    for kill in ([3, "committed"], [4, "saved"]):
        assert call(world, {**spec, "kill": kill}) == -9, output(spec)
    assert call(world, spec) == 0, output(spec)
    assert [run[0]["resumed_from"] for run in events(spec)] == [0, 2, 4]
    assert content(spec) == final
    assert outcome_state(spec["store"]) == ref_state


OTHER_STATEFUL = f"""
import sys

sys.path.insert(0, {os.path.join(ROOT, "examples", "verl")!r})
from hardest_first import HardestFirst  # noqa: E402


class Renamed(HardestFirst):
    name = "hardest-first-v2"


class SameName(HardestFirst):
    name = "hardest-first"
"""


@pytest.mark.slow
def test_resume_with_another_stateful_generator_is_refused_before_the_rollback(
    world, hardest_reference, tmp_path
):
    """Checkpoint 2 of the hardest-first run (its store holds later rounds): resumed with a
    stateful generator of another name, verl's ``fit()`` stops in ``_load_checkpoint`` naming
    both generators, the store exactly as it was, instead of handing ``load_state_dict`` a
    state another generator wrote. A generator that takes the name (``name = "hardest-first"``)
    resumes and gets the state."""
    path = tmp_path / "other_stateful.py"
    path.write_text(OTHER_STATEFUL)
    source = hardest_reference[0]
    other = {**HARDEST, "path": str(path), "name": "Renamed"}
    spec = test_verl.resumed_copy(
        world, "other-gen", source, 2, datagen=other, dynstate={"select": LEARN}, **EPOCH
    )
    test_verl.assert_refused_unchanged(
        world,
        spec,
        2,
        "StateMismatchError",
        "committed by generator 'hardest-first'",
        "'hardest-first-v2'",
        "nothing was changed",
    )
    same = {**HARDEST, "path": str(path), "name": "SameName"}
    spec = test_verl.resumed_copy(
        world, "same-name", source, 2, datagen=same, dynstate={"select": LEARN}, **EPOCH
    )
    assert call(world, spec) == 0, output(spec)
    assert outcome_state(spec["store"]) == hardest_reference[3]
