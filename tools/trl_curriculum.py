"""Does the curriculum help? examples/trl/train.py in three arms under one compute budget.

Every run trains the same steps with the same prompts per step and the same generations per
prompt (the example's 4 x 8); the arms differ only in where the prompts come from:

* ``static``: the store keeps its 48 first tasks, prompts shuffled
  (``--generator none --select uniform``);
* ``generator``: variations of the hardest tasks are written every step, prompts shuffled
  (``--select uniform``);
* ``generator+select``: the same generator, prompts drawn by learnability (the example's
  default).

Each arm runs with seeds 0..S-1 (a seed fixes the model's initial weights and the first tasks,
so the arms start from the same point). Runs go one at a time: one training subprocess of the
example as written, never two. A fixed held-out set of ``a+b`` tasks (``HOLD_OUT``) is kept out
of every store (``--hold-out``); after each run, every checkpoint (one each ``--eval-every``
steps, all kept with ``--keep-checkpoints 0``) and the initial weights are evaluated by greedy
decoding on the held-out tasks and on the other 20 ("train pairs"), scored exactly.

The per-step mean reward is the mean of the step's rewards in the run's ``--trace`` (the last
line of a step counts). Writes a JSON of every curve and a PNG: mean over seeds, band mean ±
one standard deviation, for the reward and both accuracies::

    python tools/trl_curriculum.py --steps 200 --seeds 5 \\
        --json docs/trl-curriculum.json --png docs/trl-curriculum.png

(docs/trl.md, "Does the curriculum help?", has the result of that command.)
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "trl" / "train.py"

# one pair for each value of a and of b, so every operand is still trained in both places
HOLD_OUT = "0+1,1+3,2+0,3+2,4+4"
ARMS: dict[str, list[str]] = {
    "static": ["--generator", "none", "--select", "uniform"],
    "generator": ["--generator", "hardest", "--select", "uniform"],
    "generator+select": ["--generator", "hardest", "--select", "learnability"],
}
SMOOTH = 10  # steps in the plot's running mean of the reward


def example() -> Any:
    """examples/trl/train.py as a module: its model, tokenizer, task and exact reward."""
    spec = importlib.util.spec_from_file_location("trl_example_train", TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_trace(path: Path) -> dict[int, list[float]]:
    """step -> its rewards; a step traced twice (a resumed run) counts by its last line."""
    steps: dict[int, list[float]] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            steps[int(record["step"])] = [float(r) for r in record["rewards"]]
    return steps


def reward_curve(path: Path, steps: int) -> list[float]:
    traced = read_trace(path)
    missing = sorted(set(range(1, steps + 1)) - set(traced))
    if missing:
        raise RuntimeError(f"{path}: no trace line for steps {missing[:10]}")
    return [float(np.mean(traced[s])) for s in range(1, steps + 1)]


def pairs(ex: Any) -> list[tuple[int, int]]:
    return [(a, b) for a in range(ex.OPERAND + 1) for b in range(ex.OPERAND + 1)]


def greedy_answers(ex: Any, model: Any, tokenizer: Any, tasks: list[tuple[int, int]]) -> list[str]:
    """Greedy completions of ``a+b=``, tokenized as GRPOTrainer tokenizes a prompt and decoded
    as it decodes a completion (special tokens skipped), at most 2 tokens like the training."""
    import torch

    prompts = [f"{a}+{b}=" for a, b in tasks]
    ids = torch.tensor(tokenizer(text=prompts)["input_ids"])  # all the same length: no padding
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return [
        str(t) for t in tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    ]


def evaluate(ex: Any, model: Any, tokenizer: Any, hold_out: frozenset[tuple[int, int]]) -> dict:
    model.eval()
    tasks = pairs(ex)
    answers = greedy_answers(ex, model, tokenizer, tasks)
    right = ex.exact(answers, [str(a + b) for a, b in tasks])
    held = [r for t, r in zip(tasks, right, strict=True) if t in hold_out]
    train = [r for t, r in zip(tasks, right, strict=True) if t not in hold_out]
    return {
        "answers": dict(zip([f"{a}+{b}" for a, b in tasks], answers, strict=True)),
        "held_out": float(np.mean(held)),
        "train_pairs": float(np.mean(train)),
    }


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    found = []
    for path in out.iterdir():
        m = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def eval_run(ex: Any, out: Path, seed: int, hold_out: frozenset[tuple[int, int]]) -> list[dict]:
    """Step 0 (the initial weights, rebuilt as train.py builds them) and every checkpoint."""
    import torch
    from transformers import LlamaForCausalLM, set_seed

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per checkpoint otherwise
    tokenizer = ex.build_tokenizer()
    set_seed(seed)
    points = [{"step": 0, **evaluate(ex, ex.build_model(tokenizer), tokenizer, hold_out)}]
    for step, path in checkpoints(out):
        model = LlamaForCausalLM.from_pretrained(path)
        points.append({"step": step, **evaluate(ex, model, tokenizer, hold_out)})
    return points


def train_command(arm: str, seed: int, steps: int, every: int, run: Path) -> list[str]:
    return [
        sys.executable, str(TRAIN),
        "--store", str(run / "store"), "--out", str(run / "out"),
        "--steps", str(steps), "--trace", str(run / "trace.jsonl"),
        "--seed", str(seed), "--save-steps", str(every), "--keep-checkpoints", "0",
        "--hold-out", HOLD_OUT, *ARMS[arm],
    ]  # fmt: skip


def spread(values: list[float]) -> dict[str, float]:
    v = np.asarray(values, dtype=float)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
    }


def summarize(runs: list[dict], steps: int) -> dict[str, dict[str, float]]:
    fifth = max(1, steps // 5)
    return {
        "reward_first_fifth": spread([float(np.mean(r["reward"][:fifth])) for r in runs]),
        "reward_last_fifth": spread([float(np.mean(r["reward"][-fifth:])) for r in runs]),
        "held_out_final": spread([r["eval"][-1]["held_out"] for r in runs]),
        "train_pairs_final": spread([r["eval"][-1]["train_pairs"] for r in runs]),
    }


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {"static": "tab:gray", "generator": "tab:blue", "generator+select": "tab:red"}
    for arm, data in result["arms"].items():
        runs = data["runs"]
        color = colors.get(arm)
        rewards = np.asarray([r["reward"] for r in runs])
        window = min(SMOOTH, rewards.shape[1])
        kernel = np.ones(window) / window
        smooth = np.asarray([np.convolve(r, kernel, mode="valid") for r in rewards])
        x = np.arange(window, rewards.shape[1] + 1)
        band(axes[0], x, smooth, color, f"{arm} ({len(runs)} seeds)")
        steps = [p["step"] for p in runs[0]["eval"]]
        for ax, key in ((axes[1], "held_out"), (axes[2], "train_pairs")):
            values = np.asarray([[p[key] for p in r["eval"]] for r in runs])
            band(ax, np.asarray(steps), values, color, arm)
    s = result["settings"]
    axes[0].set_title(f"training reward (shaped; {SMOOTH}-step running mean)")
    axes[1].set_title(f"held-out accuracy ({len(s['hold_out'].split(','))} tasks, greedy)")
    axes[2].set_title("train-pair accuracy (the other 20 tasks, greedy)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1].set_ylim(-0.05, 1.05)
    axes[2].set_ylim(-0.05, 1.05)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(
        f"examples/trl: {s['steps']} steps x {s['prompts_per_step']} prompts x "
        f"{s['generations']} generations per arm; mean over seeds, band = ±1 std",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def band(ax: Any, x: np.ndarray, values: np.ndarray, color: Any, label: str) -> None:
    mean = values.mean(axis=0)
    std = values.std(axis=0, ddof=1) if len(values) > 1 else np.zeros_like(mean)
    ax.plot(x, mean, color=color, label=label)
    ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per arm")
    parser.add_argument("--eval-every", type=int, default=10, help="steps; 1 to 10")
    parser.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS)
    )
    parser.add_argument("--json", type=Path, default=Path("trl-curriculum.json"))
    parser.add_argument("--png", type=Path, help="the plot (needs matplotlib: dynstate[plot])")
    parser.add_argument(
        "--work", type=Path, help="keep every run's store, checkpoints and trace here"
    )
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        parser.error(f"--arms: each of {', '.join(ARMS)}")
    if args.steps < 1 or args.seeds < 1 or not 1 <= args.eval_every <= 10:
        parser.error("--steps and --seeds must be 1 or more, --eval-every between 1 and 10")

    ex = example()
    hold_out = ex.parse_pairs(HOLD_OUT)
    work = args.work or Path(tempfile.mkdtemp(prefix="trl-curriculum-"))
    started = time.time()
    result: dict[str, Any] = {
        "command": shlex.join(["python", "tools/trl_curriculum.py", *(argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_at_start": list(os.getloadavg()),
            "versions": versions(),
        },
        "settings": {
            "steps": args.steps,
            "seeds": list(range(args.seeds)),
            "eval_every": args.eval_every,
            "prompts_per_step": ex.PROMPTS_PER_STEP,
            "generations": ex.GENERATIONS,
            "hold_out": HOLD_OUT,
            "arms": {a: ARMS[a] for a in arms},
        },
        "arms": {},
    }
    try:
        for arm in arms:
            runs = []
            for seed in range(args.seeds):
                run = work / f"{arm.replace('+', '-')}-seed{seed}"
                if run.exists():
                    shutil.rmtree(run)
                run.mkdir(parents=True)
                command = train_command(arm, seed, args.steps, args.eval_every, run)
                t0 = time.time()
                with open(run / "train.log", "w") as log:
                    rc = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
                if rc != 0:
                    tail = (run / "train.log").read_text()[-3000:]
                    raise RuntimeError(f"{shlex.join(command)} exited {rc}:\n{tail}")
                wall = time.time() - t0
                points = eval_run(ex, run / "out", seed, hold_out)
                runs.append({
                    "seed": seed,
                    "trace": str(run / "trace.jsonl"),
                    "wall_s": round(wall, 1),
                    "reward": reward_curve(run / "trace.jsonl", args.steps),
                    "eval": points,
                })  # fmt: skip
                last = points[-1]
                print(
                    f"{arm:17s} seed {seed}: {wall:5.1f} s, reward last fifth "
                    f"{np.mean(runs[-1]['reward'][-max(1, args.steps // 5) :]):.3f}, held-out "
                    f"{last['held_out']:.2f}, train pairs {last['train_pairs']:.2f}",
                    flush=True,
                )
                if args.work is None:
                    shutil.rmtree(run / "out")  # checkpoints: ~1 MB each
            result["arms"][arm] = {"runs": runs, "summary": summarize(runs, args.steps)}
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["machine"]["load_at_end"] = list(os.getloadavg())
    result["wall_s"] = round(time.time() - started, 1)
    if args.work is None:
        for data in result["arms"].values():
            for r in data["runs"]:
                r["trace"] = None  # removed with the work folder
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    if args.png:
        plot(result, args.png)
    print(f"wrote {args.json}" + (f" and {args.png}" if args.png else ""))
    return 0


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "trl")}


def table(result: dict) -> str:
    """The final figures per arm as a Markdown table: mean ± std over seeds [min, max]."""

    def cell(s: dict[str, float]) -> str:
        return f"{s['mean']:.3f} ± {s['std']:.3f} [{s['min']:.2f}, {s['max']:.2f}]"

    lines = [
        "| arm | reward, first fifth | reward, last fifth | held-out acc. (final) "
        "| train-pair acc. (final) |",
        "|---|---|---|---|---|",
    ]
    for arm, data in result["arms"].items():
        s = data["summary"]
        lines.append(
            f"| {arm} | {cell(s['reward_first_fifth'])} | {cell(s['reward_last_fifth'])} "
            f"| {cell(s['held_out_final'])} | {cell(s['train_pairs_final'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
