"""verl integration: DynstateRLDataset through verl's real dataset factory, collate_fn,
DataProto and StatefulDataLoader, in a harness that replays RayPPOTrainer.fit's data path
(tests/verl_harness.py), SIGKILLed at random steps and phases and resumed in a new process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import s3_url

import dynstate

pytest.importorskip("verl")

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "verl_harness.py")
STEPS, SAVE_FREQ = 9, 2
CLI = "import sys; from dynstate.cli import main; sys.exit(main())"


class Zygote:
    """One process that has imported verl; every run is a fresh child forked from it."""

    def __init__(self, workdir: str):
        env = dict(os.environ, HF_DATASETS_CACHE=os.path.join(workdir, "hf"), PYTHONUNBUFFERED="1")
        self.err = os.path.join(workdir, "zygote.err")
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, HARNESS, "serve"],
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
        return json.loads(self.proc.stdout.readline())["status"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def world(tmp_path_factory, s3_endpoint):
    root = tmp_path_factory.mktemp("verl")
    zygote = Zygote(str(root))
    files = root / "data"
    files.mkdir()
    spec = {"cmd": "data", "folder": str(files), "output": str(root / "data.out")}
    assert zygote.call(spec) == 0, (root / "data.out").read_text()[-3000:]
    yield zygote, root, {"train": str(files / "train.parquet"), "val": str(files / "val.parquet")}
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
        **extra,
    }


def call(world, spec: dict) -> int:
    return world[0].call(spec)


def output(spec: dict) -> str:
    with open(spec["output"]) as f:
        return f.read()[-4000:]


def events(spec: dict) -> list[list[dict]]:
    """The log split per process: [[start, batch, ...], [start, ...]]."""
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


def content(url: str) -> list[dict]:
    return dynstate.Store.open(url).snapshot().to_arrow().to_pylist()


def rounds(url: str) -> dict[int, dict]:
    """Step -> meta of the rounds in the head's lineage; each step at most once."""
    store = dynstate.Store.open(url)
    out: dict[int, dict] = {}
    for v in dynstate.lineage(store):
        meta = store.commit_record(v).meta
        if "step" in meta:
            assert meta["step"] not in out, f"step {meta['step']} committed twice"
            out[meta["step"]] = {**meta, "version": v}
    return out


@pytest.fixture(scope="module")
def reference(world):
    spec = new_run(world, "reference")
    assert call(world, spec) == 0, output(spec)
    (run,) = events(spec)
    assert run[-1] == {"event": "done"}
    return spec, batches(run), content(spec["store"])


def test_reference_run_grows_and_records_lineage(reference):
    spec, ref_batches, final = reference
    assert sorted(ref_batches) == list(range(1, STEPS + 1))
    got = rounds(spec["store"])
    assert sorted(got) == list(range(1, STEPS))  # no on_batch_end after the last step
    assert all(m["generator"] == "arith-variations" for m in got.values())
    store = dynstate.Store.open(spec["store"])
    imported = store.snapshot(1)
    assert store.commit_record(1).meta["verl_import"] is True
    assert imported.num_rows == 14  # 16 tasks, the 2 overlong ones filtered by verl's filter
    generated = final[imported.num_rows :]
    assert generated, "the generator never produced a row"
    for row in generated:
        (source,) = row["_dynstate_source"]  # lineage: the failed task it varies
        assert int(final[source]["reward_model"]["ground_truth"]) % 3 == 0
    # Generated rows reach training after their epoch starts (epoch mode).
    assert any(r >= imported.num_rows for b in ref_batches.values() for r in b["rows"])
    # Items carry verl's keys; the index column comes from extra_info.index.
    first = ref_batches[1]
    assert [final[r]["extra_info"]["index"] for r in first["rows"]] == first["index"]


def test_items_are_rlhfdataset_items(world, tmp_path):
    spec = new_run(world, "items", cmd="items", result=str(tmp_path / "items.json"))
    assert call(world, spec) == 0, output(spec)
    result = json.loads((tmp_path / "items.json").read_text())
    assert result["problems"] == []
    assert result["ours"] == result["theirs"] == result["compared"] == 14


def trials() -> list[tuple[int, str, int, str]]:
    rng = random.Random(4)
    out = [
        (4, "saved", 2, "local"),  # between checkpoint 4 and round 4: the lost-round window
        (2, "fetched", 0, "local"),  # before the first checkpoint: resume from scratch
        # Resumes from step 4 with 18 rows: 4 % (18 // 4) == 0, so verl's _load_checkpoint
        # skips the loader state as "at an epoch boundary"; resume() must restore it anyway.
        (4, "committed", 0, "local"),
    ]
    for i, backend in enumerate(("local", "s3")):
        out.append((rng.randint(2, STEPS), rng.choice(("fetched", "committed")), 2 * i, backend))
    return out


@pytest.mark.parametrize("step,phase,workers,backend", trials())
def test_sigkill_and_resume_is_exact(world, reference, step, phase, workers, backend):
    _, ref_batches, ref_final = reference
    if phase == "committed" and step == STEPS:
        phase = "fetched"  # nothing is committed after the last step
    spec = new_run(world, f"kill-{step}-{phase}-{workers}-{backend}", num_workers=workers)
    if backend == "s3":
        spec["store"] = s3_url()
    assert call(world, {**spec, "kill": [step, phase]}) == -9, output(spec)
    store = dynstate.Store.open(spec["store"])
    head_at_crash = store.refresh()
    assert call(world, spec) == 0, output(spec)
    first, second = events(spec)
    # The crashed run saw the reference's batches, and so does the resumed one.
    for s, b in batches(first).items():
        assert b["rows"] == ref_batches[s]["rows"] and b["prompts"] == ref_batches[s]["prompts"]
    resumed = second[0]["resumed_from"]
    if (step, phase) == (4, "committed"):
        assert second[0]["verl_skipped_restore"] is True
    assert resumed == (step // SAVE_FREQ) * SAVE_FREQ - (
        SAVE_FREQ if phase == "fetched" and step % SAVE_FREQ == 0 else 0
    )
    assert second[-1] == {"event": "done"}
    got = rounds(spec["store"])
    assert sorted(got) == list(range(1, STEPS))  # every step once, none twice
    lost = phase == "saved" and step < STEPS
    if lost:
        assert got[step]["lost"] is True and got[step]["generator"] == "lost:arith-variations"
        # Until the next epoch starts, the data is the reference's.
        for s, b in sorted(batches(second).items()):
            if b["new_pass"]:
                break
            assert b["rows"] == ref_batches[s]["rows"]
    else:
        assert not any(m.get("lost") for m in got.values())
        assert {s: b["rows"] for s, b in batches(second).items()} == {
            s: ref_batches[s]["rows"] for s in range(resumed + 1, STEPS + 1)
        }
        assert content(spec["store"]) == ref_final
    # Rounds the crashed run committed after the checkpoint are abandoned, and listed.
    listed = json.loads(
        subprocess.run(
            [sys.executable, "-c", CLI, "ls", spec["store"], "--all", "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    abandoned = {r["version"] for r in listed if r["status"] == "abandoned"}
    line = set(dynstate.lineage(store))
    assert abandoned == set(range(1, store.refresh() + 1)) - line
    later = [
        v
        for v in range(1, head_at_crash + 1)
        if (store.commit_record(v).meta.get("step") or 0) > resumed
    ]
    assert set(later) - ({got[resumed]["version"]} if resumed in got else set()) <= abandoned
    # data.pt is plain data: it loads with weights_only=True and names the store.
    if resumed:
        state = torch.load(
            os.path.join(spec["ckpt"], f"global_step_{resumed}", "data.pt"), weights_only=True
        )
        sampler = dynstate.find_sampler_state(state)
        assert sampler["store_id"] == store.store_id and sampler["position"] > 0


def test_data_pt_of_another_store_is_refused(world, reference, tmp_path):
    ref_spec = reference[0]
    spec = new_run(
        world,
        "mismatch",
        cmd="mismatch",
        foreign=os.path.join(ref_spec["ckpt"], "global_step_4"),
        result=str(tmp_path / "r.json"),
    )
    assert call(world, spec) == 0, output(spec)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["error"] == "StateMismatchError"
    assert ref_spec["store"] in result["message"] and "resume with the store" in result["message"]
    assert result["head_before"] == result["head_after"]  # the store was left as it was


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


def test_old_interface_generator_runs_unchanged(world, old_generators):
    spec = new_run(
        world, "old", steps=4, datagen={"path": old_generators, "name": "MockDataGenerator"}
    )
    assert call(world, spec) == 0, output(spec)
    assert "MockDataGenerator: No operation performed" in output(spec)
    rows = content(spec["store"])
    got = rounds(spec["store"])
    assert sorted(got) == [1, 2, 3] and {m["generator"] for m in got.values()} == {
        "MockDataGenerator"
    }
    assert [r["prompt"] for r in rows[14:]] == [rows[0]["prompt"]] * 3
    assert all(r["_dynstate_source"] is None for r in rows)  # the old interface knows no lineage


def test_generated_rounds_get_verls_overlong_filter(world, old_generators):
    spec = new_run(
        world, "filter", steps=3, datagen={"path": old_generators, "name": "LongAndShort"}
    )
    assert call(world, spec) == 0, output(spec)
    rows = content(spec["store"])
    assert len(rows) == 14 + 2  # one short row per round; the overlong ones were dropped
    assert all(m["rows"] == 1 for m in rounds(spec["store"]).values())


def test_failing_generator_raises_or_skips_when_configured(world, old_generators):
    datagen = {"path": old_generators, "name": "Broken"}
    spec = new_run(world, "broken", steps=3, datagen=datagen)
    assert call(world, spec) == 1
    assert "generator exploded" in output(spec)
    assert rounds(spec["store"]) == {}  # nothing committed for the failed step
    spec = new_run(
        world, "skipped", steps=3, datagen=datagen, dynstate={"on_generator_error": "skip"}
    )
    assert call(world, spec) == 0, output(spec)
    got = rounds(spec["store"])
    assert sorted(got) == [1, 2] and all("generator exploded" in m["error"] for m in got.values())
    assert all(m["rows"] == 0 for m in got.values())
