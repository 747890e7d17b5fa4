"""verl V1 sync with DAPO group filtering (``algorithm.filter_groups.enable=true``) on a dynstate
train set, through verl's real ``TaskRunnerV1.run`` → ``fit()`` on the CPU stand-ins
(tests/verl_v1_standins.py, ``policy="dapo"``: for a third of the prompts the stand-in answers
right in one session and wrong in the other, so their groups pass the filter and the others do
not).

Checked: the consumption records of an uninterrupted run against the trained batches the driver
logged (exactly once per step and across steps, some groups filtered, some carried), the
``dynstate/filter/*`` figures verl's tracker printed; kill chains (SIGKILL mid-refill, right
after a checkpoint that holds a carry, right after a round commit) that end with the
uninterrupted run's batches, rewards, records and store; ``surplus=drop`` with a
``reward_extra_info`` metric, two loader workers and mix mode; a resume whose filter settings
differ from the checkpoint's, refused naming the verl key with the store untouched; and the
settings refused before Ray starts.

Every driver runs here in turn (one Ray cluster at a time; tests/conftest.py keeps this module
on one xdist worker, as test_verl_v1.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from collections import Counter

import pytest
import transfer_queue  # noqa: F401  - V1's queue: a missing install must fail here
import verl  # noqa: F401  - a missing verl must fail, not skip

import dynstate
from dynstate.errors import InvalidDataError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import verl_v1_standins as standins  # noqa: E402

DRIVER_TIMEOUT = 900
STEPS = 5
FILTER = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=reward"]
# what the log's record keeps (version numbers differ between runs: resets renumber them)
CARRY = "dynstate_carry.pt"  # the carry's trajectories, in verl's global_step_N
RECORD_KEYS = ("carried_in", "drawn", "gen_batches", "trained", "filtered", "dropped", "carry")

pytestmark = pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("verl_dapo")
    model = standins.make_model_dir(str(folder / "model"))
    train, val = standins.write_data(str(folder), n_train=30, n_val=4)
    return {"model": model, "train": train, "val": val}


def _spec(files: dict, folder, name: str, **extra) -> dict:
    spec = {
        **files,
        "store": str(folder / f"{name}-store"),
        "ckpt": str(folder / f"{name}-ckpt"),
        "log": str(folder / f"{name}.jsonl"),
        "pids": str(folder / f"{name}-pids.json"),
        "output": str(folder / f"{name}-out.txt"),
        "steps": STEPS,
        "save_freq": 2,
        "test_freq": 0,
        "num_workers": 0,
        "policy": "dapo",
        "overrides": FILTER,
    }
    spec.update(extra)
    return spec


def run_driver(spec: dict, kill: tuple[int, str] | None = None) -> int:
    return standins.run_driver(spec, kill, timeout=DRIVER_TIMEOUT)


def _records(url: str) -> dict[int, dict]:
    return {r["step"]: r for r in dynstate.consumption_records(dynstate.Store.open(url))}


def _plain(record: dict) -> dict:
    return {k: record[k] for k in RECORD_KEYS}


def _groups(entry: dict) -> list[tuple[int, tuple[float, ...]]]:
    """The logged batch as groups: (row, its responses' scores), in the order trained."""
    rows, scores = entry["rows"], entry["scores"]
    out: list[tuple[int, tuple[float, ...]]] = []
    for row, score in zip(rows, scores, strict=True):
        if out and out[-1][0] == row and len(out[-1][1]) < 2:
            out[-1] = (row, (*out[-1][1], score))
        else:
            out.append((row, (score,)))
    return out


def check_run(url: str, log: dict[int, dict], *, surplus: str = "carry") -> dict[int, dict]:
    """The store's consumption records against the batches the driver logged, folded by hand:
    each step trains its carried-in groups, then the accepted drawn ones in draw order; a group
    is filtered exactly when its responses' rewards agree; the exactly-once equation per step and
    across the run; each step's outcomes are the rewards of every group it drew, worked out
    from the prompts."""
    records = _records(url)
    assert sorted(records) == list(range(1, STEPS + 1))
    carry: list = []
    drawn_all: Counter = Counter()
    accounted: Counter = Counter()
    for step in range(1, STEPS + 1):
        rec, entry = records[step], log[step]
        assert _plain(rec) == _plain(entry["consumption"])
        groups = _groups(entry)
        # the trained batch: the record's trained rows, each with its responses' rewards
        assert [r for r, _ in groups] == rec["trained"]
        assert all(len(set(scores)) > 1 for _, scores in groups), "a trained group had no signal"
        # carried in = the previous step's carry, trained first with the scores it was carried with
        assert rec["carried_in"] == [r for r, _ in carry]
        for (row, scores), (crow, cscores) in zip(groups, carry, strict=False):
            assert (row, list(scores)) == (crow, cscores)
        # every filtered group agreed on its rewards (spread 0); the kept ones did not
        assert all(spread == 0.0 for _, spread in rec["filtered"])
        accepted = [r for r in rec["drawn"] if r not in {f for f, _ in rec["filtered"]}]
        surplus_rows = [r for r, _ in rec["carry"]] + [r for r, _ in rec["dropped"]]
        assert rec["trained"] + surplus_rows == rec["carried_in"] + accepted
        if surplus == "drop":
            assert rec["carry"] == [] and all(why == "surplus" for _, why in rec["dropped"])
        else:
            assert rec["dropped"] == []
        # exactly once: carried_in + drawn == trained + filtered + dropped + carry
        lhs = Counter(rec["carried_in"]) + Counter(rec["drawn"])
        rhs = (
            Counter(rec["trained"])
            + Counter(r for r, _ in rec["filtered"])
            + Counter(r for r, _ in rec["dropped"])
            + Counter(r for r, _ in rec["carry"])
        )
        assert lhs == rhs
        assert len(rec["drawn"]) == rec["gen_batches"] * 4
        drawn_all += Counter(rec["drawn"])
        accounted += (
            Counter(rec["trained"])
            + Counter(r for r, _ in rec["filtered"])
            + Counter(r for r, _ in rec["dropped"])
        )
        carry = [(r, s) for r, s in rec["carry"]]
    # over the run: every row drawn was trained, filtered, dropped or is in the last carry
    last = Counter(r for r, _ in carry)
    assert drawn_all + Counter(records[1]["carried_in"]) == accounted + last
    # the outcomes: every group scored at a step (filtered ones too), once, at that step
    standins.audit_outcomes(url, [records[s] for s in sorted(records)], log)
    return records


def tracked_filter_figures(output: str) -> dict[int, dict[str, float]]:
    """verl's console tracker lines: ``step:N - key:value - ...``, the dynstate/filter/* ones."""
    out: dict[int, dict[str, float]] = {}
    with open(output) as f:
        for line in f:
            m = re.search(r"step:(\d+) - ", line)
            if not m or "dynstate/filter/" not in line:
                continue
            figures = dict(re.findall(r"(dynstate/filter/[a-z_]+):([0-9.]+)", line))
            out[int(m.group(1))] = {k: float(v) for k, v in figures.items()}
    return out


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("dapo_ref")
    spec = _spec(files, folder, "ref", trace=str(folder / "ref-trace.jsonl"))
    assert run_driver(spec) == 0
    return {"spec": spec, "log": standins.read_log(spec["log"])}


@pytest.mark.slow
def test_dapo_uninterrupted_records_filter_and_carry(reference):
    spec, log = reference["spec"], reference["log"]
    records = check_run(spec["store"], log)
    filtered = sum(len(r["filtered"]) for r in records.values())
    carried = sum(len(r["carry"]) for r in records.values())
    assert filtered > 0 and carried > 0, (filtered, carried)
    assert any(r["gen_batches"] > 1 for r in records.values()), "no step refilled"
    assert records[2]["carry"], "checkpoint 2 carries nothing: the kill chain would not test it"
    # the tracker's figures are the records'
    figures = tracked_filter_figures(spec["output"])
    for step, rec in records.items():
        assert figures[step] == {
            "dynstate/filter/carried_in": len(rec["carried_in"]),
            "dynstate/filter/drawn": len(rec["drawn"]),
            "dynstate/filter/trained": len(rec["trained"]),
            "dynstate/filter/filtered": len(rec["filtered"]),
            "dynstate/filter/dropped": len(rec["dropped"]),
            "dynstate/filter/carried": len(rec["carry"]),
            "dynstate/filter/gen_batches": rec["gen_batches"],
        }
    # the carry's trajectories are in the checkpoint that needs them
    assert os.path.exists(os.path.join(spec["ckpt"], "global_step_2", "dynstate_carry.pt"))


@pytest.mark.slow
def test_dapo_carry_is_durable_before_verl_names_the_checkpoint(reference):
    """In every checkpoint ``fit()`` saved: the carry file was written to a temporary name and
    fsynced, renamed into place, and its folder and the folder's own entry fsynced, all before
    verl opened its tracker file (``latest_checkpointed_iteration.txt``), which is what a
    resume trusts; so a power cut never leaves a named checkpoint without its carry."""
    spec = reference["spec"]
    ckpt = os.path.abspath(spec["ckpt"])
    with open(spec["trace"]) as f:
        saves = [json.loads(line) for line in f]
    assert len(saves) == STEPS // spec["save_freq"] + (STEPS % spec["save_freq"] > 0)
    for events in saves:
        tracker = events.index(["open", os.path.join(ckpt, "latest_checkpointed_iteration.txt")])
        carries = [p for kind, p in events if kind == "replace" and p.endswith("/" + CARRY)]
        assert len(carries) == 1, events
        folder = os.path.dirname(carries[0])
        carry, tmp = carries[0], carries[0] + ".tmp"
        before = events[:tracker]
        assert ["fsync", tmp] in before, events
        assert before.index(["fsync", tmp]) < before.index(["replace", carry]), events
        renamed = before.index(["replace", carry])
        after = [p for kind, p in before[renamed:] if kind == "fsync"]
        assert folder in after and ckpt in after, events


@pytest.mark.slow
def test_dapo_kill_chain_resumes_exactly(files, reference, tmp_path):
    """SIGKILL mid-refill at step 3 (checkpoint 2 holds a carry), right after checkpoint 4,
    right after the round commit of step 5 (before its checkpoint, the last): the resumed runs
    train the uninterrupted run's groups, rewards and carry, and end with its records and store."""
    spec = _spec(files, tmp_path, "chain")
    for kill in ((3, "refill"), (4, "saved"), (5, "committed")):
        assert run_driver(spec, kill) == -signal.SIGKILL
    assert run_driver(spec) == 0
    got, ref = standins.read_log(spec["log"]), reference["log"]
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == ref[step], f"step {step} trained another batch"
    ours, theirs = _records(spec["store"]), _records(reference["spec"]["store"])
    assert {s: _plain(r) for s, r in ours.items()} == {s: _plain(r) for s, r in theirs.items()}
    assert standins.store_summary(spec["store"]) == standins.store_summary(
        reference["spec"]["store"]
    )
    check_run(spec["store"], got)


@pytest.mark.slow
def test_dapo_drop_surplus_extra_info_metric_two_workers_mix_mode(files, tmp_path):
    """``data.dynstate.surplus=drop``, the metric a ``reward_extra_info`` key (``acc``, from a
    custom reward function), ``data.dataloader_num_workers=2``, ``data.dynstate.mode=mix``
    (``lag`` 5 generation batches, above the workers' prefetch): accepted groups beyond the
    batch are recorded as dropped, never trained; the generator's rows are drawn within the
    epoch; killed right after checkpoint 2, the resumed run equals the uninterrupted one."""
    extra = {
        "num_workers": 2,
        "steps": STEPS,
        "dynstate": {"surplus": "drop", "mode": "mix", "lag": 5, "fresh_share": 0.5},
        "overrides": [
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=acc",
            f"reward.custom_reward_function.path={os.path.join(HERE, 'verl_v1_standins.py')}",
            "reward.custom_reward_function.name=standin_score",
        ],
    }
    # epochs long enough (80 rows, 20 generation batches) that rows committed at step 1 join
    # the epoch before it ends: lag 5 counts generation batches
    train, _ = standins.write_data(str(tmp_path), n_train=80, n_val=4)
    files = {**files, "train": train}
    ref = _spec(files, tmp_path, "drop-ref", **extra)
    assert run_driver(ref) == 0
    ref_log = standins.read_log(ref["log"])
    records = check_run(ref["store"], ref_log, surplus="drop")
    assert sum(len(r["dropped"]) for r in records.values()) > 0
    # mix mode drew rows the generator committed during the epoch
    assert any(r["sampler"]["fresh_next"] > r["sampler"]["base_rows"] for r in records.values())
    spec = _spec(files, tmp_path, "drop-chain", **extra)
    assert run_driver(spec, (2, "saved")) == -signal.SIGKILL
    assert run_driver(spec) == 0
    got = standins.read_log(spec["log"])
    for step in range(1, STEPS + 1):
        assert got[step] == ref_log[step], f"step {step} trained another batch"


# -- a resume with other settings: refused, nothing changed ------------------------------------


def _versions(url: str) -> list[tuple]:
    store = dynstate.Store.open(url)
    return [(c.version, c.op, json.dumps(c.meta, sort_keys=True)) for c in store.versions()]


def _copy_at(reference: dict, tmp_path, name: str, step: int, **extra) -> dict:
    src = reference["spec"]
    spec = _spec({k: src[k] for k in ("model", "train", "val")}, tmp_path, name, **extra)
    shutil.copytree(src["store"], spec["store"])
    shutil.copytree(src["ckpt"], spec["ckpt"])
    with open(os.path.join(spec["ckpt"], "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(step))
    return spec


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            [*FILTER, "algorithm.filter_groups.max_num_gen_batches=3"],
            ["StateMismatchError", "algorithm.filter_groups.max_num_gen_batches: None -> 3"],
        ),
        (
            ["algorithm.filter_groups.enable=false"],
            ["StateMismatchError", "algorithm.filter_groups.enable=true", "consumption record"],
        ),
    ],
)
def test_dapo_resume_with_other_filter_settings_is_refused(reference, tmp_path, overrides, needles):
    spec = _copy_at(reference, tmp_path, "other", 2, overrides=overrides)
    before = _versions(spec["store"])
    out = standins.run_failing_driver(spec, timeout=DRIVER_TIMEOUT)
    for needle in needles:
        assert needle in out, out[-4000:]
    assert _versions(spec["store"]) == before
    assert standins.read_log(spec["log"]) == {}


# -- refused before Ray starts --------------------------------------------------------------------


def _config(files: dict, tmp_path, overrides: list[str], **extra):
    spec = _spec(files, tmp_path, "cfg", overrides=overrides, trainer_mode="sync", **extra)
    return standins.compose_config(spec)


def test_dapo_is_accepted_with_dynstate(files, tmp_path):
    from dynstate.verl import v1
    from dynstate.verl.main_ppo import select_v1_trainer

    config = _config(files, tmp_path, [*FILTER, "data.gen_batch_size=8"])
    select_v1_trainer(config)
    assert config.trainer.v1.trainer_mode == v1.TRAINER_MODE
    f = v1.filter_settings(config)
    assert f is not None
    assert (f.metric, f.gen_batch_size, f.train_groups, f.max_gen_batches) == ("reward", 8, 4, None)
    assert (f.surplus, f.max_carry) == ("carry", None)


@pytest.mark.parametrize(
    ("overrides", "dyn", "names"),
    [
        (["trainer.v1.sampler.sync_refill_failed_groups=true", *FILTER], {}, ["sync_refill"]),
        (FILTER, {"surplus": "keep"}, ["data.dynstate.surplus", "'keep'"]),
        (
            [*FILTER, "data.gen_batch_size=8"],
            {"max_carry": 2},
            ["data.dynstate.max_carry=2", "data.gen_batch_size - 1 = 7"],
        ),
        (
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=null"],
            {},
            ["algorithm.filter_groups.metric"],
        ),
    ],
)
def test_dapo_refusals_name_the_setting(files, tmp_path, overrides, dyn, names):
    from dynstate.verl.main_ppo import select_v1_trainer

    config = _config(files, tmp_path, overrides, dynstate=dyn)
    with pytest.raises(InvalidDataError) as err:
        select_v1_trainer(config)
    for name in names:
        assert name in str(err.value), str(err.value)
    assert not os.path.exists(tmp_path / "cfg-store")


@pytest.mark.filterwarnings("ignore:Disabled critic:UserWarning")  # verl's validate_config
def test_dapo_on_the_legacy_trainer_is_refused(files, tmp_path):
    """verl 0.9.1's legacy trainer has no filter-groups path: refused, not ignored."""
    from dynstate.verl.main_ppo import check

    config = _config(files, tmp_path, ["trainer.use_v1=false", *FILTER])
    with pytest.raises(InvalidDataError) as err:
        check(config)
    for name in ("algorithm.filter_groups.enable=true", "legacy", "trainer.use_v1=true"):
        assert name in str(err.value), str(err.value)
    assert not os.path.exists(tmp_path / "cfg-store")
