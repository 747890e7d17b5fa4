"""The verl commands of examples/verl/README.md and docs/verl.md, run as written (issue 44.2),
and ``data.dynstate`` checked before Ray starts (issue 44.7).

This machine has no GPU: a command that trains runs up to verl's GPU check, the
``ValueError`` verl's resource pool raises when Ray has fewer GPUs than the config asks for,
and the test asserts that it stops exactly there, after verl's config checks and after the
train set was built (the store holds the imported rows). The commands run through ``bash`` in
a folder holding a copy of ``examples/``, as a user runs them from the repository root; the
only stand-in is the model: ``Qwen/Qwen2.5-0.5B-Instruct`` is a word-level tokenizer and config
in a local Hugging Face cache under that name (no download). The ``dynstate`` commands that
read a trained run read one written by the same ``arith.yaml`` through verl's real
``RayPPOTrainer.fit()`` on CPU (tests/verl_cpu.py).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from dynstate import InvalidDataError, Store

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from test_examples import documented_commands  # noqa: E402

README = ROOT / "examples" / "verl" / "README.md"
DOCS = ROOT / "docs" / "verl.md"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# verl's resource pool (single_controller/ray/base.py, _check_resource_available): the first
# thing in either trainer that needs a GPU
NO_GPU = re.compile(r"^ValueError: Total available GPUs 0 is less than total desired GPUs (\d+)$")
RAY_STARTED = ("Started a local Ray instance", "ray init kwargs")
TIMEOUT = 600

# verl's optional training engines (megatron, torchtitan, ...) warn when absent on import
pytestmark = pytest.mark.filterwarnings("ignore:.* engine is not available:UserWarning")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder like the repository root for the commands (``examples/`` copied) and a Hugging
    Face cache holding the stand-in model under MODEL's name."""
    import verl_cpu

    root = tmp_path_factory.mktemp("verl_commands")
    shutil.copytree(ROOT / "examples", root / "examples")
    repo = root / "hf" / "hub" / ("models--" + MODEL.replace("/", "--"))
    revision = "0" * 40
    verl_cpu.make_model_dir(str(repo / "snapshots" / revision))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return root


def _env(root: Path) -> dict[str, str]:
    return {
        **os.environ,
        # the environment's python, python3 and dynstate first, as an activated venv has them
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HOME": str(root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_DEDUP_LOGS": "0",
        "COLUMNS": "200",
        "PYTHONUNBUFFERED": "1",
    }


def sh(command: str, root: Path) -> tuple[int, str]:
    """``command`` through bash in ``root``; returns (exit status, stdout and stderr). Runs in
    its own session: whatever Ray processes a driver leaves behind are killed with it."""
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=root,
        env=_env(root),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            # Ray's workers run in sessions of their own: kill the whole tree this run made
            tree = psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
            proc.wait()
            for child in tree:
                with contextlib.suppress(psutil.Error):
                    child.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # a local Ray cluster's processes, if any
    return proc.returncode, out.decode(errors="replace")


def assert_stopped_at_gpu_check(out: str, gpus: int) -> None:
    """The driver's own error is verl's GPU check, raised from the resource pool that
    ``init_workers`` creates (nothing before it failed: config checks and datasets passed)."""
    errors = [line for line in out.splitlines() if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    assert errors, out[-4000:]
    match = NO_GPU.match(errors[-1])
    assert match, f"stopped elsewhere: {errors[-1]}\n{out[-4000:]}"
    assert int(match.group(1)) == gpus
    tail = out[out.rindex("Traceback (most recent call last)") :]
    assert "create_resource_pool" in tail and "_check_resource_available" in tail, tail
    assert "AssertionError" not in out and "InvalidDataError" not in out


def assert_imported(root: Path, url: str, rows: int) -> None:
    store = Store.open(str(root / url))
    assert store.refresh() == 1  # the import, and nothing trained
    record = store.commit_record(1)
    assert record.meta.get("verl_import") is True
    assert store.snapshot(1).num_rows == rows


@pytest.fixture(scope="module")
def arith_data(workdir) -> Path:
    """The README's data command, as written."""
    (command,) = [c for c in documented_commands(README) if "make_data.py" in c]
    assert command == "python examples/verl/make_data.py data/arith"
    code, out = sh(command, workdir)
    assert code == 0, out
    return workdir / "data" / "arith"


def _kind(command: str) -> str:
    for prefix, kind in (
        ("pip install ", "pip"),
        ("python examples/verl/make_data.py ", "data"),
        ("python -m dynstate.verl.main_ppo ", "train"),
        ("dynstate ", "cli"),
    ):
        if command.startswith(prefix):
            return kind
    raise AssertionError(f"a command of examples/verl/README.md no test runs: {command}")


def test_readme_pip_line_names_what_the_environment_has() -> None:
    """``pip install 'dynstate[verl]' vllm``: not run (no network; vllm is the GPU rollout
    engine); the ``verl`` extra it names exists and is installed here."""
    from packaging.requirements import Requirement

    (command,) = [c for c in documented_commands(README) if _kind(c) == "pip"]
    assert command == "pip install 'dynstate[verl]' vllm"
    wanted = [Requirement(r) for r in importlib.metadata.requires("dynstate") or []]
    extra = [r for r in wanted if r.marker is not None and r.marker.evaluate({"extra": "verl"})]
    assert {r.name for r in extra} >= {"verl", "transferqueue"}
    for req in extra:
        assert req.specifier.contains(importlib.metadata.version(req.name)), req


@pytest.mark.slow
def test_readme_commands_run_as_written(workdir, arith_data) -> None:
    """make_data, both training commands up to verl's GPU check, then the ``dynstate``
    commands on a run of the same config (CPU stand-ins for the GPU workers and the LLM)."""
    commands = documented_commands(README)
    kinds = [_kind(c) for c in commands]
    assert kinds == ["pip", "data", "train", "train", "cli", "cli", "cli", "cli", "cli"], commands
    assert pq.read_metadata(arith_data / "train.parquet").num_rows == 2000
    assert pq.read_metadata(arith_data / "test.parquet").num_rows == 200

    first, hardest = (c for c in commands if _kind(c) == "train")
    code, out = sh(first, workdir)
    assert code != 0, "verl started GPU workers on a machine without GPUs?"
    assert_stopped_at_gpu_check(out, gpus=1)
    assert_imported(workdir, "runs/arith/store", 2000)  # the train set was built

    code, out = sh(hardest, workdir)  # same store: read, not imported again
    assert code != 0
    assert_stopped_at_gpu_check(out, gpus=1)
    assert_imported(workdir, "runs/arith/store", 2000)

    # 20 steps of the same config and generator on CPU (checkpoints at 10 and 20), into the
    # store and checkpoint folder the commands name
    import json

    model = next((workdir / "hf" / "hub").glob("models--*/snapshots/*"))
    spec = {
        "cmd": "run",
        "model": str(model),
        "train": str(arith_data / "train.parquet"),
        "val": str(arith_data / "test.parquet"),
        "store": "./runs/arith/store",
        "ckpt": "./runs/arith/checkpoints",
        "steps": 20,
        "save_freq": 10,
        "test_freq": 10,
        "log": str(workdir / "cpu.log"),
        "output": str(workdir / "cpu.out"),
        "datagen": {
            "path": "examples/verl/hardest_first.py",
            "name": "HardestFirst",
            "max_new": 4,
        },
    }
    code, out = sh(f"python {HERE / 'verl_cpu.py'} '{json.dumps(spec)}'", workdir)
    assert code == 0, (workdir / "cpu.out").read_text()[-4000:]

    outputs = {}
    for command in commands:
        if _kind(command) == "cli":
            code, out = sh(command, workdir)
            assert code == 0, f"{command}\n{out}"
            outputs[command.split()[1]] = out
    assert "outcomes:" in outputs["stats"] and "pass rate" in outputs["stats"]
    assert "hardest-first" in outputs["ls"] and "version 21" in outputs["ls"]
    assert "version: 12" in outputs["show"] and '"step": 11' in outputs["show"]
    assert "training step:    20 (folder global_step_20)" in outputs["inspect"]
    rates = [int(m) for m in re.findall(r"^\s*\d+\s+\d+\s+(\d+)%", outputs["head"], re.M)]
    assert rates and rates == sorted(rates), outputs["head"]


# -- docs/verl.md ----------------------------------------------------------------------------

# A run_*.sh as verl's examples write them (verl.trainer.main_ppo becomes dynstate's), with the
# dataset lines of docs/verl.md's Setup; everything else is verl's default, the loader's 8
# workers included.
RUN_SH = (
    "python3 -m dynstate.verl.main_ppo algorithm.adv_estimator=grpo "
    "data.train_files=data/arith/train.parquet data.val_files=data/arith/test.parquet "
    "data.train_batch_size=256 data.max_prompt_length=256 data.max_response_length=512 "
    f"actor_rollout_ref.model.path={MODEL} actor_rollout_ref.actor.ppo_mini_batch_size=64 "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 "
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 "
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.rollout.n=4 "
    "reward.custom_reward_function.path=examples/verl/arith_reward.py "
    "reward.custom_reward_function.name=compute_score "
    "trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.default_local_dir=./runs/ckpt "
    # TransferQueue's 8 storage units (V1) are Ray actors that wait forever for CPUs on a
    # 2-core test machine, before verl gets to its GPU check; a GPU node has the cores
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1 "
)


def docs_blocks() -> tuple[list[str], list[str]]:
    """docs/verl.md's bash blocks: the lines to add to a run_*.sh, and the other policies'
    lines (each replacing the block's ``select`` lines). A line indented deeper than the
    block's first continues the one before it."""
    setup = DOCS.read_text().split("## Dynamic sampling (DAPO)")[0]
    blocks = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    assert len(blocks) == 2, blocks
    out: list[list[str]] = []
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        indent = len(lines[0]) - len(lines[0].lstrip())
        entries: list[str] = []
        for line in lines:
            text = line.strip().removesuffix("\\").strip()
            if len(line) - len(line.lstrip()) > indent:
                entries[-1] += " " + text
            else:
                entries.append(text)
        out.append(entries)
    add, others = out
    return add, others


def _local(line: str) -> str:
    return line.replace("s3://bucket/", "./")  # as tests/test_examples.py: the local store


def _block_command(add: list[str], replace: dict[str, str] | None = None) -> str:
    """RUN_SH with the block's lines, those of ``replace``'s keys replaced."""
    replace = replace or {}
    return RUN_SH + " ".join(_local(replace.get(line.split("=", 1)[0], line)) for line in add)


@pytest.mark.slow
def test_docs_run_sh_block_runs_with_verls_default_workers(workdir, arith_data) -> None:
    """The block as pasted into a run_*.sh with verl's default dataloader_num_workers (8), on
    verl's default (V1) trainer: up to verl's GPU check, the store imported."""
    add, _ = docs_blocks()
    assert "+data.dynstate.mode=mix" in add and "+data.dynstate.select.policy=learnability" in add
    code, out = sh(_block_command(add), workdir)
    assert code != 0
    assert "DynstateTaskRunnerV1" in out and "'trainer_mode': 'dynstate'" in out
    assert_stopped_at_gpu_check(out, gpus=1)
    assert_imported(workdir, "runs/gsm8k", 2000)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"+data.dynstate.select.policy": "+data.dynstate.select.policy=learnabilty"},
            "error: data.dynstate.select.policy=learnabilty names no policy; did you mean "
            "learnability? pick band, learnability, pools",
        ),
        (
            {"+data.dynstate.lag": "+data.dynstate.lag=1"},
            "error: data.dynstate.lag=1 is too small for data.dataloader_num_workers=8: verl's "
            "train loader prepares 16 batches ahead (num_workers * prefetch_factor 2)",
        ),
    ],
)
def test_entry_point_refuses_bad_settings_before_ray_starts(
    workdir, tmp_path, change, message
) -> None:
    """Through the real entry point: one line with the trainer's message, no Ray, nothing
    written (the data files need not exist: the check comes before any of them is read)."""
    add, _ = docs_blocks()
    code, out = sh(_block_command(add, dict(change)), tmp_path)
    assert code == 1, out
    assert message in out, out
    assert not any(s in out for s in RAY_STARTED), out
    assert "Traceback" not in out, out
    assert not (tmp_path / "runs").exists()


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from dynstate.verl.main_ppo import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _overrides(command: str) -> list[str]:
    import shlex

    return shlex.split(command)[3:]


def test_docs_other_policy_lines_pass_the_start_up_check(tmp_path, monkeypatch) -> None:
    """Each "other policies" line, in place of the block's select lines, composes with verl's
    config and builds its policy as the train set will (``check_settings``)."""
    from dynstate.verl.settings import check_settings

    (tmp_path / "my_curriculum.py").write_text(
        "def weights(stats, step):\n    return [1.0] * stats.num_rows\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    add, others = docs_blocks()
    base = [line for line in add if not line.startswith("+data.dynstate.select.")]
    names = []
    for line in others:
        config = _compose(_overrides(_block_command(base) + " " + line))
        settings = check_settings(config)
        assert settings is not None and settings.select is not None, line
        assert settings.mode == "mix" and settings.lag == 17
        names.append(settings.select.name)
    assert len(names) == 3 and names[:2] == ["band", "pools"], names


def test_docs_block_composes_and_passes_with_its_lag(tmp_path) -> None:
    from dynstate.verl.settings import check_settings

    add, _ = docs_blocks()
    settings = check_settings(_compose(_overrides(_block_command(add))))
    assert settings is not None and settings.select is not None
    assert settings.select.name == "learnability" and settings.lag == 17


def dapo_block() -> list[str]:
    """docs/verl.md's group-filtering block: its settings, without the command and the ``...``
    that stands for the user's run_*.sh."""
    section = DOCS.read_text().split("## Dynamic sampling (DAPO)")[1].split("\n## ")[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    words = block.replace("\\\n", " ").split()
    assert words[:3] == ["python", "-m", "dynstate.verl.main_ppo"] and words[3] == "...", words
    return words[4:]


def test_docs_dapo_block_composes_and_passes_the_start_up_check() -> None:
    """The group-filtering block on a run_*.sh with the Setup block's dataset lines (its
    ``...``) composes with verl's config and passes both start-up checks, as written."""
    from dynstate.verl.settings import check_settings
    from dynstate.verl.v1 import filter_settings

    add, _ = docs_blocks()
    dataset = [line for line in add if line.startswith("data.custom_cls.")]
    assert len(dataset) == 2, add
    command = RUN_SH + " ".join(dataset + [_local(w) for w in dapo_block()])
    config = _compose(_overrides(command))
    settings = check_settings(config)
    assert settings is not None and settings.mode == "epoch" and settings.surplus == "carry"
    dapo = filter_settings(config)
    assert dapo is not None
    assert (dapo.metric, dapo.gen_batch_size, dapo.train_groups, dapo.max_gen_batches) == (
        "reward",
        96,
        64,
        10,
    )


def _data(section: dict | None, workers: int = 0, **extra) -> object:
    data = {
        "custom_cls": {"path": "pkg://dynstate.verl", "name": "DynstateRLDataset"},
        "dataloader_num_workers": workers,
        **extra,
    }
    if section is not None:
        data["dynstate"] = section
    return OmegaConf.create({"data": data})


@pytest.mark.parametrize(
    ("section", "workers", "message"),
    [
        ({"url": "/s", "mode": "mix", "lag": 4}, 2, "data.dynstate.lag=5 or more"),
        ({"url": "/s", "mode": "mix", "lag": "5"}, 0, "data.dynstate.lag must be an int"),
        ({"url": "/s", "mode": "mix", "fresh_share": 0}, 0, "data.dynstate.fresh_share"),
        ({"url": "/s", "mode": "Epoch"}, 0, "data.dynstate.mode must be one of epoch, mix"),
        ({"url": "/s", "select": {"policy": "band", "low": 0.2}}, 0, "select.low is not"),
        ({"url": "/s", "select": {"policy": "band", "lo": 0.9, "hi": 0.1}}, 0, "band"),
        (None, 0, "data.dynstate.url is not set"),
        ({"ulr": "/s"}, 0, "data.dynstate.ulr is not a dynstate setting"),
        ({"url": "/s", "mode": "mix", "lag": 5}, 3, "set data.dynstate.lag=7 or more"),
    ],
)
def test_check_settings_refuses_what_the_trainer_would(section, workers, message) -> None:
    from dynstate.verl.settings import check_settings

    with pytest.raises(InvalidDataError) as err:
        check_settings(_data(section, workers))
    assert message in str(err.value)


def test_check_settings_passes_what_the_trainer_takes() -> None:
    from dynstate.verl.settings import check_settings

    # epoch mode: lag does not meet the loader
    assert check_settings(_data({"url": "/s"}, workers=8)) is not None
    settings = check_settings(_data({"url": "/s", "mode": "mix", "lag": 5}, workers=2))
    assert settings is not None and settings.lag == 5
    # a config without a dynstate train set is verl's business
    plain = OmegaConf.create({"data": {"custom_cls": {"path": None, "name": None}}})
    assert check_settings(plain) is None
