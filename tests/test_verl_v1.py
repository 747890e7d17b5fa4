"""dynstate on verl's V1 trainer (``trainer.use_v1=true``, verl 0.9's default): verl's real
``TaskRunnerV1.run`` → ``fit()`` → ``step()`` in ``sync`` mode with the dynstate trainer
(``trainer.v1.trainer_mode=dynstate``), TransferQueue on a local Ray cluster, verl's agent loop
and reward workers on verl's default rule-based reward; stand-ins only for the GPU worker
group, the LLM server and weight sync (tests/verl_v1_standins.py).

Drivers are SIGKILLed at the four instants of issue 12 — in rollout, right after a checkpoint,
in validation, right after a commit — and every resume must train exactly the uninterrupted
run's batches and end with its store. Also: a selection policy (the checks of
tests/test_verl_select.py), the ``python -m dynstate.verl.main_ppo`` entry point for both
trainers up to where verl starts GPU workers, and the settings V1 refuses.

These tests fail (never skip) when verl or TransferQueue is missing. One file: the V1
trainer's kill chains, selection, resume refusals and entry point share the module's files and
helpers, and every test that starts a V1 driver (each with its own Ray cluster) is here so that
one pytest-xdist worker runs them in turn (tests/conftest.py), never two at once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
import transfer_queue  # noqa: F401  - V1's queue: a missing install must fail here
import verl  # noqa: F401  - a missing verl must fail, not skip

import dynstate
from dynstate.errors import InvalidDataError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import test_verl_outcomes as outcomes  # noqa: E402
import test_verl_select as select  # noqa: E402
import verl_v1_standins as standins  # noqa: E402

DRIVER_TIMEOUT = 900
NO_GPU = "Total available GPUs 0 is less than total desired GPUs 1"

# verl's optional training engines (megatron, torchtitan, ...) warn when absent on import
pytestmark = pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("verl_v1")
    model = standins.make_model_dir(str(folder / "model"))
    train, val = standins.write_data(str(folder), n_train=30, n_val=4)
    return {"model": model, "train": train, "val": val}


def _spec(files: dict, tmp_path, store: str, **extra) -> dict:
    spec = {
        **files,
        "store": store,
        "ckpt": str(tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"),
        "log": str(tmp_path / f"log-{uuid.uuid4().hex[:6]}.jsonl"),
        "pids": str(tmp_path / f"pids-{uuid.uuid4().hex[:6]}.json"),
    }
    spec.update(extra)
    return spec


def run_driver(spec: dict, kill: tuple[int, str] | None = None) -> int:
    return standins.run_driver(spec, kill, timeout=DRIVER_TIMEOUT)


def _assert_same_run(reference: dict, spec: dict, steps: int, storage_options=None) -> None:
    got = standins.read_log(spec["log"])
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step] == reference["log"][step], f"step {step} trained another batch"
    summary = standins.store_summary(spec["store"], storage_options)
    assert summary["rounds"] == reference["store"]["rounds"]
    assert summary["rows"] == reference["store"]["rows"]


def _reference(files: dict, tmp_path, store: str, **extra) -> dict:
    spec = _spec(files, tmp_path, store, **extra)
    assert run_driver(spec) == 0
    log = standins.read_log(spec["log"])
    summary = standins.store_summary(store, extra.get("storage_options"))
    return {"log": log, "store": summary, "spec": spec}


# -- kill and resume on verl's real V1 loop -----------------------------------------------------


@pytest.mark.slow
def test_v1_sync_kill_at_every_instant_resumes_exactly(files, tmp_path):
    """Epoch mode, local store, dataloader_num_workers=2, two epochs (the second one pins the
    round of the step before it), the stateful "hardest first" example generator. One driver
    is killed at each of the four instants in turn, each one resuming the previous; the run
    ends like the uninterrupted one, batch for batch and row for row, with the same outcome
    records, statistics and generator states (issue 21: also the outcome checks of
    tests/test_verl_outcomes.py, run on this one chain)."""
    steps = 8  # 26 rows imported, 4 per step: epoch 2 starts at step 7
    common = {
        "steps": steps,
        "save_freq": 2,
        "test_freq": 3,
        "num_workers": 2,
        "dynstate": {"select": outcomes.LEARN},
        "datagen": outcomes.HARDEST,
    }
    ref_spec = _spec(files, tmp_path, str(tmp_path / "ref-store"), **common)
    ref_spec["output"] = str(tmp_path / "ref-out.txt")  # verl's console tracker lines
    assert run_driver(ref_spec) == 0
    ref = {
        "log": standins.read_log(ref_spec["log"]),
        "store": standins.store_summary(ref_spec["store"]),
    }
    assert [r[0] for r in ref["store"]["rounds"]] == list(range(1, steps + 1))
    imported = 26
    assert max(ref["log"][6]["rows"]) < imported
    assert max(ref["log"][7]["rows"] + ref["log"][8]["rows"]) >= imported, (
        "the second epoch drew no generated row"
    )
    # outcomes, statistics, the generator's choices and state, the tracker's figures
    outcomes.check_outcomes_of_run(ref_spec["store"], ref["log"], imported)
    outcomes.check_figures(ref_spec["store"], outcomes.tracked(ref_spec), steps)
    ref_state = outcomes.outcome_state(ref_spec["store"])
    assert all(ref_state["states"][s] is not None for s in range(1, steps + 1))

    spec = _spec(files, tmp_path, str(tmp_path / "store"), **common)
    kills = [
        (3, "rollout"),  # prompts of step 3 in flight; checkpoint 2 is the latest
        (3, "validation"),  # round 3 committed, no checkpoint 3: rolled back on resume
        (6, "saved"),  # checkpoint 6 just written, at the end of the first epoch
        (7, "committed"),  # round 7 durable, its step's checkpoint (8) not written
    ]
    for kill in kills:
        assert run_driver(spec, kill) == -signal.SIGKILL
    assert run_driver(spec) == 0
    _assert_same_run(ref, spec, steps)
    # the abandoned rounds' outcomes and generator states do not leak
    assert outcomes.outcome_state(spec["store"]) == ref_state
    outcomes.check_policy_at_work(spec["ckpt"], 8, outcomes.tracked(ref_spec))


@pytest.mark.slow
@pytest.mark.s3
def test_v1_mix_mode_on_s3_resumes_exactly(files, tmp_path, s3_endpoint):
    """Mix mode (fresh rows drawn lag steps after their round), a store on the loopback S3
    server, two loader workers (lag 5 covers their prefetch), the stateful generator, a
    checkpoint mirror next to the store: killed right after a checkpoint, then right after the
    commit of a round whose checkpoint is not written yet, and resumed on a "fresh machine" (an
    empty checkpoint folder) from the mirror; batches, rows, rounds, outcomes and generator
    states equal the uninterrupted run's. (The old generator interface on V1 runs in
    test_v1_selection_follows_the_policy_and_resumes_exactly.)"""
    from conftest import s3_url

    steps = 7
    common = {
        "steps": steps,
        "save_freq": 2,
        "test_freq": 0,
        "num_workers": 2,
        "dynstate": {"mode": "mix", "fresh_share": 0.5, "lag": 5, "select": outcomes.LEARN},
        "datagen": outcomes.HARDEST,
    }
    ref = _reference(files, tmp_path, s3_url(), **common)
    ref_url = ref["spec"]["store"]
    imported = dynstate.Store.open(ref_url).snapshot(1).num_rows
    assert any(r >= imported for b in ref["log"].values() for r in b["rows"]), (
        "no generated row was drawn in mix mode"
    )
    outcomes.check_outcomes_of_run(ref_url, ref["log"], imported)
    ref_state = outcomes.outcome_state(ref_url)

    mirror = s3_url()
    spec = _spec(files, tmp_path, s3_url(), **common)
    spec["dynstate"] = {**common["dynstate"], "checkpoint_mirror": mirror}
    assert run_driver(spec, (4, "saved")) == -signal.SIGKILL
    assert run_driver(spec, (6, "committed")) == -signal.SIGKILL
    spec["ckpt"] = str(tmp_path / "fresh-machine-ckpt")
    assert run_driver(spec) == 0
    assert os.path.exists(os.path.join(spec["ckpt"], "global_step_4", "data.pt"))  # pulled
    _assert_same_run(ref, spec, steps)
    assert outcomes.outcome_state(spec["store"]) == ref_state
    outcomes.check_policy_at_work(spec["ckpt"], 6, None)


@pytest.mark.slow
def test_v1_selection_follows_the_policy_and_resumes_exactly(files, tmp_path):
    """The band policy of tests/test_verl_select.py (its checks) through V1's fit(), in mix
    mode with verl's old generator interface (its rows drawn as fresh ones), killed right after
    a commit and resumed exactly."""
    steps = 6
    common = {
        "steps": steps,
        "save_freq": 2,
        "test_freq": 0,
        "num_workers": 0,
        "dynstate": select.SELECT,
        "datagen": {"path": os.path.join(HERE, "verl_v1_standins.py"), "name": "OldInterface"},
    }

    def spec_for(name: str) -> dict:
        return {
            **files,
            "store": str(tmp_path / f"{name}-store"),
            "ckpt": str(tmp_path / f"{name}-ckpt"),
            "log": str(tmp_path / f"{name}.jsonl"),
            "pids": str(tmp_path / f"{name}-pids.json"),
            "output": str(tmp_path / f"{name}-out.txt"),
            **common,
        }

    ref = spec_for("ref")
    assert run_driver(ref) == 0
    ref_log = standins.read_log(ref["log"])
    assert sorted(ref_log) == list(range(1, steps + 1))
    imported = dynstate.Store.open(ref["store"]).snapshot(1).num_rows
    select.check_selection(ref["store"], ref_log, imported, outcomes.tracked(ref))
    prompts = [p for b in ref_log.values() for p in b["prompts"]]
    assert any(p.endswith("+ 7 ?") for p in prompts), "no generated row was drawn in mix mode"

    spec = spec_for("chain")
    assert run_driver(spec, (4, "committed")) == -signal.SIGKILL
    assert run_driver(spec) == 0
    got = standins.read_log(spec["log"])
    for step in range(1, steps + 1):
        assert got[step] == ref_log[step], f"step {step} trained another batch"
    assert standins.store_summary(spec["store"]) == standins.store_summary(ref["store"])
    assert outcomes.outcome_state(spec["store"]) == outcomes.outcome_state(ref["store"])


# -- colocate_async: exactly once (issue 42.4) --------------------------------------------------

ASYNC = {
    "async": "colocate",
    "trainer_mode": standins.STANDIN_MODE,
    "steps": 6,
    "save_freq": 2,
    "test_freq": 3,
    "policy": "dapo",  # some groups' responses agree (filtered), others differ (trained)
    "overrides": [
        # one step old is stale: the warm-up window's leftovers are dropped every step
        "trainer.v1.sampler.max_off_policy_threshold=1",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "workers", "kills"),
    [
        # failing sessions too: groups evicted as failed
        ("colocate", 2, [(3, "rollout"), (3, "validation"), (4, "committed"), (4, "saved")]),
        ("separate", 0, [(3, "committed"), (4, "saved")]),
    ],
)
def test_v1_async_is_exactly_once_across_kills(files, tmp_path, mode, workers, kills):
    """verl's colocate_async / separate_async fit() with dynstate (stale drops every step, DAPO
    filtering), SIGKILLed in rollout, in validation, right after a round commit whose
    checkpoint was not yet written, and right after a checkpoint, each resuming the previous:
    the final lineage accounts for every row drawn exactly once, across the resumes."""
    failing = mode == "colocate"
    policy = "dapo_fail" if failing else "dapo"
    spec = _spec(files, tmp_path, str(tmp_path / "store"), **{**ASYNC, "async": mode})
    spec.update(num_workers=workers, policy=policy)
    for kill in kills:
        assert run_driver(spec, kill) == -signal.SIGKILL
    assert run_driver(spec) == 0
    log = standins.read_log(spec["log"])
    records = standins.audit_exactly_once(spec["store"], log, 6)
    reasons = {reason for r in records for _, reason in r["dropped"]}
    assert reasons == ({"stale", "failed"} if failing else {"stale"})
    # step 5 ran after a resume from global_step_4, with that checkpoint's rows in flight
    assert records[4]["carried_in"] == records[3]["in_flight"] != []


def test_v1_colocate_async_refused_resumes_and_another_worker_count(files, tmp_path):
    """An uninterrupted colocate_async run holds the audit. Resumes refused with the store
    unchanged: another staleness bound (naming the key), another checkpoint's data.pt, a
    checkpoint without its transfer_queue/. A resume with two loader workers instead of none
    holds the audit over the whole run."""
    spec = _spec(files, tmp_path, str(tmp_path / "store"), num_workers=0, **{**ASYNC, "steps": 4})
    assert run_driver(spec) == 0
    standins.audit_exactly_once(spec["store"], standins.read_log(spec["log"]), 4)

    def refused(run: dict, *says: str) -> None:
        before = _versions(spec["store"]), _store_files(spec["store"])
        out = standins.run_failing_driver(run, timeout=DRIVER_TIMEOUT)
        for said in says:
            assert said in out
        assert (_versions(spec["store"]), _store_files(spec["store"])) == before
        assert standins.read_log(run["log"]) == {}

    other = {**spec, "steps": 6, "log": str(tmp_path / "other.jsonl")}
    other["overrides"] = [o.replace("threshold=1", "threshold=2") for o in ASYNC["overrides"]]
    refused(other, "trainer.v1.sampler.max_off_policy_threshold: 1 -> 2", "nothing was changed")

    step4 = os.path.join(spec["ckpt"], "global_step_4")
    shutil.copy(os.path.join(step4, "data.pt"), tmp_path / "data.pt")
    shutil.copy(os.path.join(spec["ckpt"], "global_step_2", "data.pt"), step4)
    copied = {**spec, "steps": 6, "log": str(tmp_path / "copied.jsonl")}
    refused(copied, "global_step_4/data.pt does not hold the train loader's position")
    shutil.copy(tmp_path / "data.pt", step4)

    workers = {**spec, "steps": 6, "num_workers": 2}
    assert run_driver(workers) == 0
    records = standins.audit_exactly_once(spec["store"], standins.read_log(spec["log"]), 6)
    assert records[4]["carried_in"] == records[3]["in_flight"] != []

    shutil.rmtree(os.path.join(spec["ckpt"], "global_step_6", "transfer_queue"))
    more = {**spec, "steps": 8, "log": str(tmp_path / "more.jsonl")}
    refused(more, "global_step_6/transfer_queue/metadata.json is missing", "rows in flight")


# -- every resume check before anything is committed -------------------------------------------


def _store_files(url: str) -> dict[str, int]:
    out = {}
    for folder, _, names in os.walk(url):
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, url)] = os.path.getsize(path)
    return out


def _versions(url: str) -> list[tuple]:
    from dynstate.store import Store

    store = Store.open(url)
    return [(c.version, c.op, json.dumps(c.meta, sort_keys=True)) for c in store.versions()]


def _copy_at(source: dict, tmp_path, name: str, step: int, **extra) -> dict:
    """A run over a copy of ``source``'s store and checkpoints whose tracker names
    ``global_step_<step>``: verl's resume_mode=auto resumes there, the later rounds in the
    store."""
    spec = _spec({k: source[k] for k in ("model", "train", "val")}, tmp_path, "", **extra)
    spec["store"] = str(tmp_path / f"{name}-store")
    spec["ckpt"] = str(tmp_path / f"{name}-ckpt")
    shutil.copytree(source["store"], spec["store"])
    shutil.copytree(source["ckpt"], spec["ckpt"])
    with open(os.path.join(spec["ckpt"], "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(step))
    return spec


@pytest.mark.slow
def test_v1_resume_checks_come_before_the_rollback(files, tmp_path):
    """verl's V1 fit() resuming from checkpoint 2 or 4 of a 5-step run (its store holding the
    rounds up to 5): a changed data.seed, and step 2's data.pt copied into global_step_4/, are
    refused in _load_checkpoint before any step, the store exactly as it was; another
    data.dataloader_num_workers resumes exactly; a finished run resumed trains no step (the
    V1 loop checks the end before the first step, unlike the legacy one)."""
    steps = 5
    common = {"steps": steps, "save_freq": 2, "test_freq": 0, "num_workers": 0}
    ref_spec = _spec(files, tmp_path, str(tmp_path / "ref-store"), **common)
    assert run_driver(ref_spec) == 0
    ref_log = standins.read_log(ref_spec["log"])
    ref_store = standins.store_summary(ref_spec["store"])

    seed = _copy_at(ref_spec, tmp_path, "seed", 2, **common, overrides=["data.seed=8"])
    copied = _copy_at(ref_spec, tmp_path, "copied", 4, **common)
    shutil.copy(
        os.path.join(copied["ckpt"], "global_step_2", "data.pt"),
        os.path.join(copied["ckpt"], "global_step_4", "data.pt"),
    )
    for spec, needles in (
        (seed, ["StateMismatchError", "seed=7", "data.seed"]),
        (copied, ["StateMismatchError", "position after step 2, not after step 4"]),
    ):
        files_before, before = _store_files(spec["store"]), _versions(spec["store"])
        out = standins.run_failing_driver(spec, timeout=DRIVER_TIMEOUT)
        for needle in needles:
            assert needle in out, out[-4000:]
        assert _versions(spec["store"]) == before
        assert _store_files(spec["store"]) == files_before
        assert standins.read_log(spec["log"]) == {}

    workers = _copy_at(ref_spec, tmp_path, "workers", 2, **{**common, "num_workers": 2})
    assert run_driver(workers) == 0
    got = standins.read_log(workers["log"])
    assert sorted(got) == [3, 4, 5]
    for step in (3, 4, 5):
        assert got[step] == ref_log[step], f"step {step} trained another batch"
    summary = standins.store_summary(workers["store"])
    assert summary["rows"] == ref_store["rows"]
    assert summary["rounds"] == ref_store["rounds"]

    finished = _copy_at(ref_spec, tmp_path, "finished", steps, **common)
    before = _versions(finished["store"])
    assert run_driver(finished) == 0
    assert standins.read_log(finished["log"]) == {}  # no step trained
    assert _versions(finished["store"]) == before


# -- what V1 refuses, before anything starts ----------------------------------------------------


def _config(files: dict, tmp_path, overrides: list[str], mode: str = "sync"):
    spec = _spec(files, tmp_path, str(tmp_path / "store"), trainer_mode=mode, overrides=overrides)
    return standins.compose_config(spec)


@pytest.mark.parametrize(
    ("mode", "overrides", "names"),
    [
        (
            "my_async",
            [],
            [
                "my_async",
                "supported: sync, colocate_async, separate_async",
                "dynstate.verl.main_ppo",
            ],
        ),
        ("sync", ["trainer.v1.sampler.sync_refill_failed_groups=true"], ["sync_refill"]),
        ("sync", ["data.gen_batch_size=2"], ["gen_batch_size=2", "train_batch_size=4"]),
        (
            "colocate_async",
            ["trainer.v1.sampler.sync_refill_failed_groups=true"],
            ["sync_refill_failed_groups", "colocate_async"],
        ),
        ("colocate_async", ["skip.rollout_tq.enable=true"], ["skip.rollout_tq.enable"]),
    ],
)
def test_v1_refuses_modes_without_exact_resume(files, tmp_path, mode, overrides, names):
    from dynstate.verl.main_ppo import select_v1_trainer

    config = _config(files, tmp_path, overrides, mode)
    with pytest.raises(InvalidDataError) as err:
        select_v1_trainer(config)
    for name in names:
        assert name in str(err.value)
    assert not os.path.exists(tmp_path / "store")  # refused before the store was touched


@pytest.mark.parametrize("use_v1", [True, False])
def test_main_ppo_refuses_verl_05_curriculum_sampler_keys(files, tmp_path, use_v1):
    """``data.sampler.class_path``/``class_name`` (verl <= 0.5's curriculum sampler, not read
    by verl 0.9.1) would be silently ignored: refused before Ray starts, for both trainers."""
    from dynstate.verl.main_ppo import run

    overrides = [
        f"trainer.use_v1={str(use_v1).lower()}",
        "+data.sampler.class_path=pkg://my_curriculum",
        "+data.sampler.class_name=MyCurriculum",
    ]
    config = _config(files, tmp_path, overrides)
    with pytest.raises(InvalidDataError) as err:
        run(config)
    message = str(err.value)
    assert "data.sampler.class_path=pkg://my_curriculum" in message
    assert "not supported" in message and "remove the data.sampler keys" in message
    assert "data.dynstate.select" in message and "+data.dynstate.select.policy=" in message
    for policy in ("band (lo, hi, untried)", "learnability (floor, neutral)", "pools (bounds"):
        assert policy in message
    assert not os.path.exists(tmp_path / "store")


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_v1_async_refuses_mix_mode(files, tmp_path, mode):
    from dynstate.verl.main_ppo import select_v1_trainer

    spec = _spec(
        files,
        tmp_path,
        str(tmp_path / "store"),
        trainer_mode=mode,
        dynstate={"mode": "mix"},
    )
    config = standins.compose_config(spec)
    with pytest.raises(InvalidDataError) as err:
        select_v1_trainer(config)
    assert "data.dynstate.mode=mix" in str(err.value) and "mode=epoch" in str(err.value)
    assert not os.path.exists(tmp_path / "store")


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_v1_async_modes_are_run_as_dynstates(files, tmp_path, mode):
    from verl.trainer.ppo.v1 import get_trainer_cls

    from dynstate.verl import v1_async
    from dynstate.verl.main_ppo import select_v1_trainer

    config = _config(files, tmp_path, [], mode)
    select_v1_trainer(config)
    assert config.trainer.v1.trainer_mode == f"dynstate_{mode}"
    cls = get_trainer_cls(f"dynstate_{mode}")
    assert issubclass(cls, v1_async.AsyncRounds) and mode == cls.VERL_MODE
    assert issubclass(cls, get_trainer_cls(mode))  # verl's own class under it


def test_v1_sync_is_run_as_dynstate(files, tmp_path):
    from dynstate.verl import v1
    from dynstate.verl.main_ppo import select_v1_trainer

    config = _config(files, tmp_path, [])
    select_v1_trainer(config)
    assert config.trainer.v1.trainer_mode == v1.TRAINER_MODE == "dynstate"
    from verl.trainer.ppo.v1 import get_trainer_cls

    assert get_trainer_cls("dynstate") is v1.DynstatePPOTrainer


# -- the entry point ------------------------------------------------------------------------------


def _entry_point(files: dict, tmp_path, use_v1: bool) -> tuple[str, str]:
    store = str(tmp_path / "store")
    args = [
        f"trainer.use_v1={str(use_v1).lower()}",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.logger=[console]",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "trainer.total_training_steps=3",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.model.path={files['model']}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"data.train_files={files['train']}",
        f"data.val_files={files['val']}",
        "data.train_batch_size=4",
        "data.max_prompt_length=24",
        "data.max_response_length=8",
        "data.filter_overlong_prompts=true",
        "data.filter_overlong_prompts_workers=1",
        "data.dataloader_num_workers=0",
        "data.custom_cls.path=pkg://dynstate.verl",
        "data.custom_cls.name=DynstateRLDataset",
        f"+data.dynstate.url={store}",
        f"+data.datagen.path={os.path.join(HERE, 'verl_v1_standins.py')}",
        "+data.datagen.name=FailedVariations",
        "+ray_kwargs.ray_init.num_cpus=2",
        "+ray_kwargs.ray_init.include_dashboard=false",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynstate.verl.main_ppo", *args],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=DRIVER_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        time.sleep(0.5)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray processes the run left in its session
        except (ProcessLookupError, PermissionError):
            pass
    assert proc.returncode != 0, "verl started GPU workers on a machine without GPUs?"
    return out.decode(errors="replace"), store


@pytest.mark.slow
def test_main_ppo_v1_runs_dynstate_trainer_up_to_gpu_workers(files, tmp_path):
    """``use_v1=true``: the dynstate trainer is registered inside verl's TaskRunnerV1 actor and
    selected; it builds the dataset (importing the train files) and stops where verl asks Ray
    for GPUs. (The actor's last log lines may not reach the driver before it exits, so the
    sampler's installation is checked by the kill tests, on the same class.)"""
    out, store = _entry_point(files, tmp_path, use_v1=True)
    assert "DynstateTaskRunnerV1" in out
    assert "'trainer_mode': 'dynstate'" in out
    assert "Unknown trainer" not in out  # verl found the mode: registered inside the actor
    assert NO_GPU in out  # verl's resource pool: the first thing that needs a GPU
    summary = standins.store_summary(store)
    assert summary["rows"] and summary["rounds"] == []  # imported, no step trained


@pytest.mark.slow
def test_main_ppo_legacy_runs_mixin_trainer_up_to_gpu_workers(files, tmp_path):
    """``use_v1=false``: verl's legacy TaskRunner with the dynstate mixin trainer."""
    out, store = _entry_point(files, tmp_path, use_v1=False)
    assert "DynstateTaskRunner " in out or "DynstateTaskRunner object" in out
    assert "TaskRunnerV1" not in out
    assert NO_GPU in out
    summary = standins.store_summary(store)
    assert summary["rows"] and summary["rounds"] == []
