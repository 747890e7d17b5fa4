"""A policy that learns on CPU: TRL's GRPOTrainer on a dynstate store of ``a+b=`` tasks.

A 2-layer Llama (~85k parameters) and a character-level tokenizer are built in code (nothing is
downloaded). Each step the policy answers 4 prompts 8 times; a shaped reward scores each answer;
a generator writes variations of the tasks the policy finds hardest; the sampler picks prompts
by learnability (``p * (1 - p)`` of each row's pass rate). Every step commits its round, the
outcomes and the generator's state as one version of the store.

    python examples/trl/train.py --store /tmp/trl/store --out /tmp/trl/out --steps 150 \
        --trace /tmp/trl/trace.jsonl

``--filter-groups`` adds DAPO's dynamic sampling (groups whose rewards all agree are dropped,
more prompts drawn until the step is full, the surplus carried to the next step), each step's
consumption committed with its round.

Run the same command again after a kill: it resumes from the latest checkpoint in ``--out``
(rounds committed after it are rolled back) and trains the same steps again, exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

PROMPTS_PER_STEP = 4
GENERATIONS = 8
GEN_PROMPTS = 6  # --filter-groups: prompts drawn per generation batch
DIGITS = "0123456789"
OPERAND = 4  # operands 0..4: every sum is one digit
VOCAB = ["<pad>", "<s>", "</s>", *DIGITS, "+", "="]


def build_tokenizer() -> Any:
    """A character-level tokenizer: one token per character, no merges, built in code."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(VOCAB)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_model(tokenizer: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def task(a: int, b: int, source: int | None = None) -> dict[str, Any]:
    return {
        "prompt": f"{a}+{b}=",
        "a": a,
        "b": b,
        "answer": str(a + b),
        "_dynstate_source": None if source is None else [source],
    }


def first_tasks(
    seed: int, count: int = 48, hold_out: frozenset[tuple[int, int]] = frozenset()
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    if not hold_out:
        return [task(int(a), int(b)) for a, b in rng.integers(0, OPERAND + 1, size=(count, 2))]
    # --hold-out: drawn from the other pairs only, still `count` rows
    pairs = [(a, b) for a in range(OPERAND + 1) for b in range(OPERAND + 1)]
    pairs = [p for p in pairs if p not in hold_out]
    return [task(*pairs[i]) for i in rng.integers(0, len(pairs), size=count).tolist()]


def parse_pairs(text: str) -> frozenset[tuple[int, int]]:
    """``"0+1,3+2"`` -> {(0, 1), (3, 2)}; operands 0..OPERAND."""
    pairs = set()
    for item in filter(None, text.split(",")):
        a, plus, b = item.strip().partition("+")
        if not (plus and a.isdigit() and b.isdigit()) or max(int(a), int(b)) > OPERAND:
            raise ValueError(f"{item!r} is not a+b with operands 0..{OPERAND}")
        pairs.add((int(a), int(b)))
    return frozenset(pairs)


def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """Shaped: up to 0.6 for a first character close to the sum (0 at a distance of 5 or
    more, or for a character that is not a digit), and 0.4 more for exactly the sum."""
    out = []
    for text, want in zip(completions, answer, strict=True):
        got = text.strip()
        close = 0.0
        if got[:1].isdigit():
            close = max(0.0, 1.0 - abs(int(got[0]) - int(want)) / 5)
        out.append(0.6 * close + 0.4 * (got == want))
    return out


def exact(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1 for exactly the sum, else 0 (DAPO's accuracy reward: a group all wrong or all right
    has no signal, which --filter-groups drops)."""
    return [float(text.strip() == want) for text, want in zip(completions, answer, strict=True)]


class HardestVariations:
    """Writes ``per_step`` variations (an operand moved by 1) of the tasks with the lowest
    mean score so far, each recording its source row. Its randomness is its own state. A
    variation that lands on a ``hold_out`` pair is not written."""

    name = "hardest-variations"

    def __init__(
        self,
        seed: int,
        per_step: int = 2,
        max_rows: int = 400,
        hold_out: frozenset[tuple[int, int]] = frozenset(),
    ):
        self.seed, self.count, self.per_step, self.max_rows = seed, 0, per_step, max_rows
        self.hold_out = hold_out

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.count = int(state["seed"]), int(state["count"])

    def generate(self, dataset: Any) -> list[dict[str, Any]]:
        if len(dataset) >= self.max_rows:
            return []
        stats = dataset.outcome_stats(pending=True)
        tried = np.asarray(stats.column("attempts").to_numpy(zero_copy_only=False)) > 0
        mean = np.asarray(stats.column("mean_score").to_numpy(zero_copy_only=False), dtype=float)
        rows = np.flatnonzero(tried)
        hardest = rows[np.argsort(mean[rows], kind="stable")][: self.per_step]
        frame = dataset.dataframe
        rng = np.random.default_rng([self.seed, self.count])
        self.count += 1
        out = []
        for row in hardest.tolist():
            a, b = int(frame[row]["a"]), int(frame[row]["b"])
            if rng.random() < 0.5:
                a = min(OPERAND, max(0, a + int(rng.choice([-1, 1]))))
            else:
                b = min(OPERAND, max(0, b + int(rng.choice([-1, 1]))))
            if (a, b) not in self.hold_out:
                out.append(task(a, b, source=row))
        return out


def append_line(path: str, record: dict[str, Any]) -> None:
    """One whole line per write (O_APPEND): a kill never leaves half a record behind."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="store URL or folder (made if missing)")
    parser.add_argument("--out", required=True, help="checkpoints; a rerun resumes from here")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--trace", help="append one JSON line per trained step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument(
        "--filter-groups",
        action="store_true",
        help="DAPO's dynamic sampling: drop groups whose rewards all agree, draw more prompts "
        f"({GEN_PROMPTS} per generation batch) until the step is full, carry the surplus",
    )
    parser.add_argument(
        "--reward",
        choices=["shaped", "exact"],
        default="shaped",
        help="shaped (default): partial credit for a close digit; exact: 1 for the sum, else 0",
    )
    # the switches of tools/trl_curriculum.py's arms and its held-out evaluation
    parser.add_argument(
        "--generator",
        choices=["hardest", "none"],
        default="hardest",
        help="hardest (default): variations of the hardest tasks each step; none: the store "
        "keeps its first tasks",
    )
    parser.add_argument(
        "--select",
        choices=["learnability", "uniform"],
        default="learnability",
        help="learnability (default): prompts drawn by p * (1 - p); uniform: shuffled",
    )
    parser.add_argument(
        "--hold-out",
        default="",
        metavar="PAIRS",
        help="tasks never written to the store, e.g. 0+1,3+2 (for a held-out evaluation)",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=int,
        default=2,
        metavar="N",
        help="checkpoints kept in --out (default 2; 0 keeps all)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.save_steps <= 10:
        parser.error("--save-steps must be between 1 and 10")
    if args.keep_checkpoints < 0:
        parser.error("--keep-checkpoints must be 0 (all) or more")
    try:
        hold_out = parse_pairs(args.hold_out)
    except ValueError as e:
        parser.error(f"--hold-out: {e}")
    if len(hold_out) >= (OPERAND + 1) ** 2:
        parser.error("--hold-out leaves no task to train on")

    import torch

    torch.set_num_threads(1)  # the same arithmetic in every run, killed or not
    from accelerate import PartialState
    from transformers import TrainerCallback, set_seed
    from trl import GRPOConfig

    import dynstate
    from dynstate.trl import DynstateGRPOTrainer, FilterGroups, last_checkpoint

    # one process, or one per rank under `accelerate launch` / `torchrun` (gloo on the CPU)
    ranks = PartialState(cpu=True)
    # the newest checkpoint saved whole: a kill while one was saved leaves it without dynstate's
    # state, and the one before it resumes
    checkpoint = last_checkpoint(args.out)
    if ranks.is_main_process:  # one writer: rank 0 sets the store up, the others wait
        store = dynstate.Store.open(args.store, create=True)
        if store.snapshot().num_rows == 0:
            store.append(first_tasks(args.seed, hold_out=hold_out), meta={"import": "examples/trl"})
        if checkpoint is None:
            # a run killed before its first checkpoint starts again from the first tasks
            dynstate.rollback(store, step=0)
    ranks.wait_for_everyone()
    store = dynstate.Store.open(args.store)

    set_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=2,
        temperature=1.0,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        beta=0.0,
        logging_steps=10,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.keep_checkpoints or None,
        report_to="none",
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class Trace(TrainerCallback):
        def on_step_end(self, _args: Any, state: Any, control: Any, **_: Any) -> Any:
            done = trainer.dynstate_round
            if args.trace and done is not None and state.is_world_process_zero:
                append_line(args.trace, {"step": done.step, "rows": done.rows,
                                         "rewards": done.rewards})  # fmt: skip
            if state.global_step >= args.steps:
                control.should_save = True  # the last step is a checkpoint too
            return control

    filtering: dict[str, Any] = {"mode": "mix"}
    if args.filter_groups:
        # epoch mode: a filtering step draws a varying number of generation batches
        filtering = {"mode": "epoch", "filter_groups": FilterGroups(gen_prompts=GEN_PROMPTS)}
    trainer = DynstateGRPOTrainer(
        model=model,
        reward_funcs=[reward if args.reward == "shaped" else exact],
        args=config,
        processing_class=tokenizer,
        train_dataset=dynstate.VersionedDataset(store),
        generator=None
        if args.generator == "none"
        else HardestVariations(seed=args.seed, hold_out=hold_out),
        select=dynstate.Learnability() if args.select == "learnability" else None,
        callbacks=[],
        **filtering,
    )
    trainer.add_callback(Trace())
    trainer.train(resume_from_checkpoint=checkpoint)
    print(f"trained {trainer.state.global_step} steps; store head {store.refresh()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
