"""verl integration on verl 0.9.1's real legacy trainer (``RayPPOTrainer.fit()`` through
``dynstate_trainer_class()``, ``trainer.use_v1=false``), on verl's default reward path
(rule-based ``custom_reward_function``, no reward model), with CPU stand-ins only for the GPU
workers, the LLM server and Ray's actor transport (tests/verl_cpu.py). Drivers are SIGKILLed
at the instants that matter and resumed in new processes; every resumed run must train on
exactly the uninterrupted run's batches and leave exactly its store.

verl missing is a failure here, never a skip. One file because every test here shares the
module's zygote (one process that has imported verl) and its reference runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import verl  # noqa: F401 - no importorskip: a broken install must fail these tests
from conftest import s3_url

import dynstate

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "verl_cpu.py")
IMPORTED = 21  # 24 tasks, 3 overlong ones dropped by verl's filter on import
STEPS, SAVE_FREQ, TEST_FREQ = 7, 2, 3
CLI = "import sys; from dynstate.cli import main; sys.exit(main())"


class Zygote:
    """One process that has imported verl; every driver is a fresh child forked from it."""

    def __init__(self, workdir: str):
        self.workdir = os.path.realpath(workdir)
        env = dict(os.environ, HF_DATASETS_CACHE=os.path.join(workdir, "hf"), PYTHONUNBUFFERED="1")
        self.err = os.path.join(workdir, "zygote.err")
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, DRIVER, "serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=workdir,
                env=env,
            )
        line = self.proc.stdout.readline()
        if not line:
            with open(self.err) as f:
                raise RuntimeError(f.read()[-3000:])
        assert json.loads(line) == {"ready": True}

    def call(self, spec: dict) -> int:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if reply["status"] == -9:
            assert_no_leftovers(self.proc, self.workdir)
        return reply["status"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def assert_no_leftovers(zygote: subprocess.Popen, workdir: str) -> None:
    """A killed driver leaves no process behind: its DataLoader workers (forked, so they run
    ``verl_cpu.py serve`` in the zygote's folder, reparented once the driver dies) exit on their
    own, and it starts no Ray cluster (the driver asserts that at the end of every run)."""
    deadline = time.monotonic() + 60
    while True:
        left = []
        for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
            try:
                if (
                    p.info["pid"] != zygote.pid
                    and DRIVER in (p.info["cmdline"] or [])
                    and p.info["cwd"] == workdir
                ):
                    left.append(p.info)
            except psutil.Error:
                continue
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"a killed driver left {left}"


@pytest.fixture(scope="module")
def world(tmp_path_factory, s3_endpoint):
    # s3_endpoint first: the zygote (and every driver) inherits its AWS environment.
    root = tmp_path_factory.mktemp("verl")
    zygote = Zygote(str(root))
    files = root / "data"
    files.mkdir()
    model = str(root / "model")
    spec = {"cmd": "data", "folder": str(files), "model": model, "output": str(root / "d.out")}
    assert zygote.call(spec) == 0, (root / "d.out").read_text()[-3000:]
    yield (
        zygote,
        root,
        {
            "train": str(files / "train.parquet"),
            "val": str(files / "val.parquet"),
            "model": model,
        },
    )
    zygote.close()


def new_run(world, name: str, **extra) -> dict:
    _, root, files = world
    d = root / name
    d.mkdir()
    return {
        "cmd": "run",
        **files,
        "store": str(d / "store"),
        "ckpt": str(d / "ckpt"),
        "log": str(d / "log.jsonl"),
        "output": str(d / "out.txt"),
        "steps": STEPS,
        "save_freq": SAVE_FREQ,
        "test_freq": TEST_FREQ,
        **extra,
    }


def call(world, spec: dict) -> int:
    return world[0].call(spec)


def output(spec: dict, tail: int = 4000) -> str:
    with open(spec["output"]) as f:
        return f.read()[-tail:]


def events(spec: dict) -> list[list[dict]]:
    """The log split per process that got past _load_checkpoint."""
    runs: list[list[dict]] = []
    with open(spec["log"]) as f:
        for line in f:
            e = json.loads(line)
            if e["event"] == "start":
                runs.append([])
            runs[-1].append(e)
    return runs


def batches(run: list[dict]) -> dict[int, dict]:
    return {e["step"]: e for e in run if e["event"] == "batch"}


def content(spec: dict) -> list[dict]:
    store = dynstate.Store.open(spec["store"], storage_options=spec.get("storage_options"))
    return store.snapshot().to_arrow().to_pylist()


def rounds(spec: dict) -> dict[int, dict]:
    """Step -> meta of the rounds in the head's lineage; each step at most once."""
    store = dynstate.Store.open(spec["store"], storage_options=spec.get("storage_options"))
    out: dict[int, dict] = {}
    for v in dynstate.lineage(store):
        meta = store.commit_record(v).meta
        if "step" in meta:
            assert meta["step"] not in out, f"step {meta['step']} committed twice"
            out[meta["step"]] = {**meta, "version": v}
    return out


def run_reference(world, name: str, **extra) -> tuple[dict, dict[int, dict], list[dict]]:
    spec = new_run(world, name, **extra)
    assert call(world, spec) == 0, output(spec)
    (run,) = events(spec)
    assert run[0]["resumed_from"] == 0 and run[-1]["event"] == "done"
    return spec, batches(run), content(spec)


def kill_chain(world, name: str, kills: list[tuple[int, str]], reference, **extra) -> dict:
    """Run, SIGKILLed at each (step, instant) in turn, each time resumed in a new process, until
    a run finishes; every batch any process trained on and the final store must be the
    reference's."""
    ref_spec, ref_batches, ref_final = reference
    spec = new_run(world, name, **extra)
    for step, instant in kills:
        status = call(world, {**spec, "kill": [step, instant]})
        assert status == -9, f"not killed at {step}/{instant}: {status}\n{output(spec)}"
    assert call(world, spec) == 0, output(spec)
    runs = events(spec)
    assert runs[-1][-1]["event"] == "done"
    trained: set[int] = set()
    for run in runs:
        for step, b in batches(run).items():
            ref = ref_batches[step]
            assert (b["rows"], b["prompts"], b["scores"]) == (
                ref["rows"],
                ref["prompts"],
                ref["scores"],
            ), f"step {step} differs from the uninterrupted run"
            trained.add(step)
    assert trained == set(range(1, STEPS + 1))
    assert content(spec) == ref_final
    assert {s: m["rows"] for s, m in rounds(spec).items()} == {
        s: m["rows"] for s, m in rounds(ref_spec).items()
    }
    return spec


# -- epoch mode, local store, no loader workers ---------------------------------------------


# 6 rows a step: resuming from checkpoint 6 finds 37 rows (6 steps a "loader epoch"), where
# verl's _load_checkpoint skips the loader state as "at an epoch boundary".
EPOCH = {"batch_size": 6}


@pytest.fixture(scope="module")
def reference(world):
    return run_reference(world, "reference", **EPOCH)


def test_reference_run_feeds_the_generator_on_verls_default_reward_path(reference):
    spec, ref_batches, final = reference
    assert sorted(ref_batches) == list(range(1, STEPS + 1))
    # The scored batch the generator receives carries the dataset's columns after
    # verl's _get_gen_batch, the agent loop's streamed reward and union.
    for b in ref_batches.values():
        assert {"raw_prompt", "dynstate_row", "reward_model", "extra_info", "index"} <= set(
            b["keys"]
        )
        assert set(b["scores"]) <= {0.0, 1.0}
    got = rounds(spec)
    assert sorted(got) == list(range(1, STEPS + 1))  # the final step's round included
    assert all(m["generator"] == "arith-variations" for m in got.values())
    assert sum(m["rows"] for m in got.values()) == len(final) - IMPORTED > 0
    store = dynstate.Store.open(spec["store"])
    assert store.commit_record(1).meta["verl_import"] is True
    assert store.snapshot(1).num_rows == IMPORTED
    for row in final[IMPORTED:]:
        (source,) = row["_dynstate_source"]  # lineage: the failed task it varies
        assert int(final[source]["reward_model"]["ground_truth"]) % 3 == 0
    # Round N is made from step N's scored batch: its rows vary tasks of that batch that
    # scored 0 (also on checkpoint steps, where on_batch_end must not commit again).
    for step, meta in got.items():
        before = store.snapshot(meta["version"] - 1).num_rows
        added = final[before : before + meta["rows"]]
        b = ref_batches[step]
        failed = {r for r, score in zip(b["rows"], b["scores"], strict=True) if score == 0.0}
        assert added and all(row["_dynstate_source"][0] in failed for row in added), step
    # Generated rows reach training once a new epoch starts (epoch mode).
    assert any(r >= IMPORTED for b in ref_batches.values() for r in b["rows"])
    # Every checkpoint's round is in the store before the checkpoint names it.
    for step in range(SAVE_FREQ, STEPS + 1, SAVE_FREQ):
        assert os.path.exists(os.path.join(spec["ckpt"], f"global_step_{step}", "data.pt"))
        assert step in got


@pytest.mark.slow
def test_killed_at_every_instant_resumes_to_the_uninterrupted_run(world, reference):
    kills = [
        (2, "committed"),  # round 2 committed after the actor update, checkpoint 2 not written
        (3, "committed"),  # round 3 committed (no checkpoint step); resume from checkpoint 2
        (4, "saved"),  # right after checkpoint 4: the old lost-round window
        (5, "rollout"),  # inside the agent loop of step 5
        (6, "validation"),  # in validation, after checkpoint 6
    ]
    spec = kill_chain(world, "chain", kills, reference, **EPOCH)
    starts = [run[0]["resumed_from"] for run in events(spec)]
    assert starts == [0, 0, 2, 4, 4, 6]
    # verl skipped data.pt there; dynstate's resume loaded it all the same.
    assert events(spec)[-1][0]["verl_skipped_restore"] is True
    # Rounds the killed runs committed after their checkpoint are abandoned, and listed.
    listed = json.loads(
        subprocess.run(
            [sys.executable, "-c", CLI, "ls", spec["store"], "--all", "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    store = dynstate.Store.open(spec["store"])
    abandoned = {r["version"] for r in listed if r["status"] == "abandoned"}
    assert abandoned and abandoned == set(range(1, store.refresh() + 1)) - set(
        dynstate.lineage(store)
    )
    # data.pt is plain data: it loads with weights_only=True and names the store.
    import torch

    state = torch.load(os.path.join(spec["ckpt"], "global_step_6", "data.pt"), weights_only=True)
    sampler = dynstate.find_sampler_state(state)
    assert sampler["store_id"] == store.store_id and sampler["position"] > 0


# -- mix mode with fresh rows, loopback S3, two loader workers ------------------------------


MIX = {"mode": "mix", "fresh_share": 0.5, "lag": 5}


@pytest.mark.slow
def test_mix_mode_on_s3_with_workers_resumes_exactly(world, s3_endpoint):
    extra = {"num_workers": 2, "dynstate": MIX, "steps": STEPS}
    reference = run_reference(world, "mix-ref", store=s3_url(), **extra)
    _, ref_batches, _ = reference
    # Fresh rows (generated by earlier steps) are actually drawn.
    assert any(r >= IMPORTED for b in ref_batches.values() for r in b["rows"])
    spec = kill_chain(
        world,
        "mix-chain",
        [(4, "saved"), (6, "committed")],
        reference,
        store=s3_url(),
        **extra,
    )
    assert [run[0]["resumed_from"] for run in events(spec)] == [0, 4, 4]


def test_mix_lag_below_the_loaders_prefetch_is_refused_at_start(world):
    """lag=1 with 2 workers (prefetch 2 each) would wait at step 1 for a round that cannot
    exist yet: the trainer refuses it when verl builds the loader, naming both settings."""
    spec = new_run(world, "lag", num_workers=2, dynstate={"mode": "mix", "lag": 1})
    assert call(world, spec) == 1
    out = output(spec, tail=10**8)
    assert "InvalidDataError" in out
    assert "data.dynstate.lag=1 is too small for data.dataloader_num_workers=2" in out
    assert "set data.dynstate.lag=5 or more" in out
    assert os.path.getsize(spec["log"]) == 0  # refused before any step or checkpoint
    assert not os.path.exists(spec["ckpt"])


# -- smaller points ----------------------------------------------------------------------------


def test_items_are_rlhfdataset_items(world, tmp_path):
    spec = new_run(world, "items", cmd="items", result=str(tmp_path / "items.json"))
    assert call(world, spec) == 0, output(spec)
    result = json.loads((tmp_path / "items.json").read_text())
    assert result["problems"] == []
    assert result["ours"] == result["theirs"] == IMPORTED


def test_resume_refuses_a_foreign_or_roundless_checkpoint(world, reference, tmp_path):
    ref_spec = reference[0]
    foreign = os.path.join(ref_spec["ckpt"], "global_step_4")
    other = new_run(world, "mismatch", cmd="refuse", checkpoint=foreign, step=4)
    other["result"] = str(tmp_path / "a.json")
    assert call(world, other) == 0, output(other)
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["error"] == "StateMismatchError"
    assert ref_spec["store"] in result["message"]
    assert result["head_before"] == result["head_after"]  # the store was left as it was
    # A copy of the reference store rolled back before round 4: same store id, but checkpoint
    # 4's round is not in it.
    copy = str(tmp_path / "copy")
    shutil.copytree(ref_spec["store"], copy)
    store = dynstate.Store.open(copy)
    dynstate.rollback(store, step=3)
    head = store.refresh()
    same = dict(ref_spec, cmd="refuse", store=copy, checkpoint=foreign, step=4)
    same.update(result=str(tmp_path / "b.json"), output=str(tmp_path / "b.out"))
    assert call(world, same) == 0, output(same)
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["error"] == "StateMismatchError" and "no round of step 4" in result["message"]
    assert result["head_before"] == result["head_after"] == head


# -- every resume check before anything is committed ---------------------------------------


def store_files(url: str) -> dict[str, int]:
    """Every file of a local store with its size: what "left exactly as it was" compares."""
    out = {}
    for folder, _, names in os.walk(url):
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, url)] = os.path.getsize(path)
    return out


def versions(spec: dict) -> list[tuple]:
    store = dynstate.Store.open(spec["store"], storage_options=spec.get("storage_options"))
    return [(c.version, c.op, json.dumps(c.meta, sort_keys=True)) for c in store.versions()]


def resumed_copy(world, name: str, source: dict, step: int, **extra) -> dict:
    """A new run over a copy of ``source``'s store and checkpoints whose tracker names
    ``global_step_<step>``, so verl's ``resume_mode=auto`` resumes there, with ``source``'s
    later rounds in the store: a resume that goes ahead rolls them back by a new commit."""
    spec = new_run(world, name, **extra)
    shutil.copytree(source["store"], spec["store"])
    shutil.copytree(source["ckpt"], spec["ckpt"])
    with open(os.path.join(spec["ckpt"], "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(step))
    return spec


def assert_refused_unchanged(world, spec: dict, step: int, *needles: str) -> str:
    """verl's fit() resuming from ``global_step_<step>`` stops in _load_checkpoint with every
    needle in its error, before any step, and the store is exactly as it was: same versions,
    same files (it holds later rounds, so a resume that went ahead would commit a reset)."""
    files, before = store_files(spec["store"]), versions(spec)
    assert max(rounds(spec)) > step
    assert call(world, spec) == 1, output(spec)
    out = output(spec, tail=10**8)
    for needle in needles:
        assert needle in out, out[-3000:]
    assert versions(spec) == before
    assert store_files(spec["store"]) == files
    assert events(spec) == []  # no "start": refused inside verl's _load_checkpoint
    return out


@pytest.mark.parametrize(
    ("name", "change", "needle"),
    [
        ("seed", {"seed": 8}, "seed=7"),
        ("shuffle", {"shuffle": False}, "shuffle=True"),
        ("batch", {"batch_size": 4}, "batch_size=6"),
        ("mode", {"dynstate": {"mode": "mix", "lag": 1}}, "mode='epoch'"),
    ],
)
def test_resume_with_changed_settings_is_refused_before_the_rollback(
    world, reference, name, change, needle
):
    """Checkpoint 4 of the reference run, its store holding rounds up to 7: with data.seed,
    data.shuffle, the batch size or data.dynstate.mode changed, verl's fit() is refused in
    _load_checkpoint with the setting named, and no reset is committed."""
    spec = resumed_copy(world, f"changed-{name}", reference[0], 4, **{**EPOCH, **change})
    assert_refused_unchanged(world, spec, 4, "StateMismatchError", needle, "global_step_4")


@pytest.fixture(scope="module")
def mix_reference(world):
    return run_reference(world, "mix-local", steps=3, dynstate={"mode": "mix", "fresh_share": 0.5})


@pytest.mark.parametrize(
    ("name", "change", "needle"),
    [("lag", {"lag": 2}, "lag=1"), ("share", {"fresh_share": 0.25}, "fresh_share=0.5")],
)
def test_mix_resume_with_changed_lag_or_share_is_refused_before_the_rollback(
    world, mix_reference, name, change, needle
):
    mix = {"mode": "mix", "fresh_share": 0.5, **change}
    spec = resumed_copy(world, f"mix-{name}", mix_reference[0], 2, dynstate=mix)
    assert_refused_unchanged(world, spec, 2, "StateMismatchError", needle)


def test_resume_from_another_steps_data_pt_is_refused(world, reference):
    """Step 2's data.pt copied into global_step_4/ would train step 5 from step 3's place."""
    spec = resumed_copy(world, "copied-data-pt", reference[0], 4, **EPOCH)
    shutil.copy(
        os.path.join(spec["ckpt"], "global_step_2", "data.pt"),
        os.path.join(spec["ckpt"], "global_step_4", "data.pt"),
    )
    assert_refused_unchanged(
        world, spec, 4, "StateMismatchError", "position after step 2, not after step 4"
    )


def test_resume_with_another_worker_count_is_exact(world, reference):
    """Checkpoint 4 written without loader workers, resumed with 2; that run's checkpoint 6
    (written with 2) resumed without: both continue with the uninterrupted run's batches and
    end with its store."""
    ref_spec, ref_batches, ref_final = reference
    spec = resumed_copy(world, "workers-0-to-2", ref_spec, 4, num_workers=2, **EPOCH)
    assert call(world, spec) == 0, output(spec)
    back = resumed_copy(world, "workers-2-to-0", spec, 6, num_workers=0, **EPOCH)
    assert call(world, back) == 0, output(back)
    for run_spec, first in ((spec, 4), (back, 6)):
        (run,) = events(run_spec)
        assert run[0]["resumed_from"] == first
        got = batches(run)
        assert sorted(got) == list(range(first + 1, STEPS + 1))
        for step, b in got.items():
            ref = ref_batches[step]
            assert (b["rows"], b["prompts"], b["scores"]) == (
                ref["rows"],
                ref["prompts"],
                ref["scores"],
            ), f"step {step} differs from the uninterrupted run"
        assert content(run_spec) == ref_final
        assert {s: m["rows"] for s, m in rounds(run_spec).items()} == {
            s: m["rows"] for s, m in rounds(ref_spec).items()
        }
    # The rounds of steps 5-7 the copy held were rolled back by a reset, then made again.
    store = dynstate.Store.open(spec["store"])
    resets = [c for c in store.versions() if c.meta.get("verl_resume_step") == 4]
    assert len(resets) == 1


def test_resuming_a_finished_run_trains_one_more_step_in_the_legacy_loop(world, reference):
    """verl's legacy fit() increments global_steps after loading checkpoint N and runs that
    step before it checks the end (docs/verl.md); the V1 loop runs none (test_verl_v1.py)."""
    spec = resumed_copy(world, "finished", reference[0], STEPS, **EPOCH)
    assert call(world, spec) == 0, output(spec)
    (run,) = events(spec)
    assert run[0]["resumed_from"] == STEPS
    assert sorted(batches(run)) == [STEPS + 1]
    assert sorted(rounds(spec)) == list(range(1, STEPS + 2))


def test_verl_05_curriculum_sampler_keys_are_refused_at_start(world):
    """data.sampler.class_path/class_name (verl <= 0.5's curriculum sampler) are not read by
    verl 0.9.1; a run with them would train without the curriculum, so verl's fit() is refused
    when verl builds the train set, naming the data.dynstate.select keys."""
    spec = new_run(
        world,
        "curriculum",
        overrides=[
            "+data.sampler.class_path=pkg://my_curriculum",
            "+data.sampler.class_name=MyCurriculum",
        ],
    )
    assert call(world, spec) == 1
    out = output(spec, tail=10**8)
    assert "InvalidDataError" in out
    assert "data.sampler.class_path=pkg://my_curriculum" in out
    assert "data.sampler.class_name=MyCurriculum" in out
    assert "remove the data.sampler keys" in out
    # ... and names the data.dynstate.select keys that replace the curriculum
    assert "data.dynstate.select" in out and "policy band (lo, hi, untried)" in out
    assert "learnability (floor, neutral)" in out and "pools (bounds, names, shares" in out
    assert not os.path.exists(spec["store"]) and events(spec) == []


def _loader(store, workers: int, **options):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = dynstate.VersionedDataset(store)
    sampler = dynstate.VersionedSampler(ds, seed=3, batch_size=4, drop_last=True, first_step=1)
    return StatefulDataLoader(
        ds,
        batch_size=4,
        drop_last=True,
        sampler=sampler,
        num_workers=workers,
        collate_fn=lambda rows: [r["x"] for r in rows],
        **options,
    )


def _take(loader, n: int, state_after: int | None = None) -> tuple[list, dict | None]:
    out, state = [], None
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == state_after:
                state = loader.state_dict()
            if len(out) == n:
                break
    return out, state


@pytest.mark.parametrize("after", [3, 10])  # mid-epoch; the epoch's last batch (40 rows / 4)
@pytest.mark.parametrize("saved", [0, 2])
def test_loader_state_is_carried_to_another_worker_count_exactly(tmp_path, saved, after):
    """torchdata's own StatefulDataLoader: a state written with ``saved`` workers, rewritten by
    dynstate.verl.loader_state for 0, 1 and 2, continues with the batches the old loader
    gave next (across the epoch end)."""
    from dynstate.verl import loader_state

    store = dynstate.Store.open(str(tmp_path / "s"), create=True)
    store.append([{"x": i} for i in range(40)])
    batches_seen, state = _take(_loader(store, saved), after + 12, state_after=after)
    assert loader_state.saved_workers(state) == saved
    for workers in (0, 1, 2):
        loader = _loader(store, workers)
        loader.load_state_dict(loader_state.for_workers(state, workers, "data.pt", "store"))
        assert _take(loader, 12)[0] == batches_seen[after:], (saved, workers)


def test_loader_state_that_cannot_be_carried_over_is_refused_naming_both_counts(tmp_path):
    from dynstate.verl import loader_state

    store = dynstate.Store.open(str(tmp_path / "s"), create=True)
    store.append([{"x": i} for i in range(40)])
    # a snapshot two batches old (snapshot_every_n_steps=3): only the same workers replay it
    _, state = _take(_loader(store, 2, snapshot_every_n_steps=3), 5, state_after=5)
    assert state["_steps_since_snapshot"] == 2
    with pytest.raises(dynstate.StateMismatchError) as err:
        loader_state.for_workers(state, 0, "ckpt/data.pt", "store")
    message = str(err.value)
    assert "with 2 worker(s)" in message and "this run has 0" in message
    assert "data.dataloader_num_workers=2" in message
    assert loader_state.for_workers(state, 2, "ckpt/data.pt", "store") is state  # same count
    with pytest.raises(dynstate.StateMismatchError, match="layout"):
        loader_state.for_workers({"something": 1}, 0, "ckpt/data.pt", "store")


OLD_GENERATOR = '''
import datasets
from torch.utils.data import Dataset
from verl.experimental.dynamic_dataset.dynamicgen_dataset import AbstractDataGenerator


class MockDataGenerator(AbstractDataGenerator):
    """verl 0.5's example generator, verbatim."""

    def __init__(self, config=None):
        super().__init__(config)

    def generate(self, dataset: Dataset) -> datasets.Dataset:
        print("MockDataGenerator: No operation performed on the dataset.")
        return dataset.dataframe.select([0])


class LongAndShort(AbstractDataGenerator):
    def generate(self, dataset):
        row = dataset.dataframe[0]
        long = dict(row, prompt=[{"role": "user", "content": "What is 1 + 1 ?" + " and" * 40}])
        return datasets.Dataset.from_list([row, long])


class Broken(AbstractDataGenerator):
    def generate(self, dataset):
        raise RuntimeError("generator exploded")
'''


@pytest.fixture(scope="module")
def old_generators(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "old_generators.py"
    path.write_text(textwrap.dedent(OLD_GENERATOR))
    return str(path)


def test_old_interface_generator_runs_unchanged(world, old_generators, s3_endpoint):
    """Also: val_files == train_files builds a fixed validation set (no second growing
    dataset), and resume_mode=disable does not pull the checkpoint mirror."""
    mirror = s3_url("mirror")
    fs_spec = {"resume_mode": "disable", "num_workers": 2}
    spec = new_run(
        world,
        "old",
        steps=3,
        datagen={"path": old_generators, "name": "MockDataGenerator"},
        dynstate={"checkpoint_mirror": mirror},
        **fs_spec,
    )
    spec["val_files"] = spec["train"]
    from dynstate.verl import mirror as mirror_mod

    # A mirror holding a checkpoint the disabled resume must not fetch.
    os.makedirs(os.path.join(spec["ckpt"] + "-old", "global_step_9"))
    open(os.path.join(spec["ckpt"] + "-old", "global_step_9", "data.pt"), "w").close()
    mirror_mod.push(spec["ckpt"] + "-old", 9, mirror)
    assert call(world, spec) == 0, output(spec)
    assert "MockDataGenerator: No operation performed" in output(spec, tail=10**8)
    assert not os.path.exists(os.path.join(spec["ckpt"], "global_step_9"))
    assert events(spec)[0][0]["resumed_from"] == 0
    rows = content(spec)
    got = rounds(spec)
    assert sorted(got) == [1, 2, 3]
    assert {m["generator"] for m in got.values()} == {"MockDataGenerator"}
    assert [r["prompt"] for r in rows[IMPORTED:]] == [rows[0]["prompt"]] * 3
    assert all(r["_dynstate_source"] is None for r in rows)  # the old interface knows no lineage
    assert mirror_mod.latest_step(mirror) == 3  # this run's own checkpoints were mirrored


def test_generated_rounds_get_verls_overlong_filter(world, old_generators):
    """Also: without checkpoints (save_freq -1) the last step's round is committed too."""
    datagen = {"path": old_generators, "name": "LongAndShort"}
    spec = new_run(world, "filter", steps=2, save_freq=-1, datagen=datagen)
    assert call(world, spec) == 0, output(spec)
    assert len(content(spec)) == IMPORTED + 2  # one short row per round; long ones dropped
    got = rounds(spec)
    assert sorted(got) == [1, 2] and all(m["rows"] == 1 for m in got.values())
    assert not os.path.exists(spec["ckpt"])


def test_failing_generator_raises_or_skips_when_configured(world, old_generators):
    datagen = {"path": old_generators, "name": "Broken"}
    spec = new_run(world, "broken", steps=2, datagen=datagen)
    assert call(world, spec) == 1
    assert "generator exploded" in output(spec, tail=10**8)
    assert rounds(spec) == {}  # nothing committed for the failed step, no checkpoint written
    assert not os.path.exists(os.path.join(spec["ckpt"], "global_step_2"))
    spec = new_run(
        world, "skipped", steps=2, datagen=datagen, dynstate={"on_generator_error": "skip"}
    )
    assert call(world, spec) == 0, output(spec)
    got = rounds(spec)
    assert sorted(got) == [1, 2] and all("generator exploded" in m["error"] for m in got.values())
    assert all(m["rows"] == 0 for m in got.values())


def test_a_store_filled_without_lineage_takes_generated_rounds(world, old_generators):
    """A store filled by ``store.append(dataset)`` (the train file's rows, no lineage column,
    as docs/trl.md's setup and any user's own import make it) and then trained by verl: each
    round of an old-interface generator was refused at commit ("unexpected columns:
    _dynstate_source", verl added the column with nulls whatever the store held), so ``fit()``
    died after step 1. The round is built as TRL's is (``dynstate.generators.round_table``):
    nulls only where the store has the column."""
    import pyarrow.parquet as pq

    spec = new_run(
        world, "plain", steps=2, save_freq=-1,
        datagen={"path": old_generators, "name": "MockDataGenerator"},
    )  # fmt: skip
    store = dynstate.Store.open(spec["store"], create=True)
    train = pq.read_table(spec["train"])
    store.append(train)
    assert "_dynstate_source" not in store.snapshot().schema.names
    assert call(world, spec) == 0, output(spec)
    got = rounds(spec)
    assert sorted(got) == [1, 2] and all(m["rows"] == 1 for m in got.values())
    rows = content(spec)
    assert len(rows) == train.num_rows + 2
    assert [r["prompt"] for r in rows[train.num_rows :]] == [rows[0]["prompt"]] * 2
    assert "_dynstate_source" not in rows[0]
