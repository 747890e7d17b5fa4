"""Every ```python block of docs/*.md runs as written (README.md's first block is
tests/test_readme.py's; no other test runs a docs/*.md python block).

Each block is parsed from its page when the test runs, never copied here. A test supplies only
what the fragment leaves free: the names it assumes (``url``, ``store``, ``step``, ``reward``,
``train``, a tiny model, ...) on a real store in ``tmp_path``, or on the suite's loopback S3
server for an ``s3://`` URL (the bucket ``bucket`` that tests/test_docs_output.py uses, so
``s3://bucket/...`` runs as written; another bucket or endpoint in a block is rewritten to it,
host and bucket only). A ``...`` token of a block (a placeholder: a loader elided, ``rows =
[...]``, ``"model": ...``) is read as the name ``_placeholder_``, which each test binds to
what the placeholder stands for.

Every block is also checked statically (``test_every_block_names_real_api``): it compiles,
every ``dynstate.X`` name it (or a call in its comments) uses exists, and every keyword and
positional argument it passes to a dynstate function, class or method binds to the real
signature, so a renamed argument fails here even for a block a test runs only in part.
After a block runs, its test checks what the page claims about the result (a version, one row
per store row, the batches of a resumed run, the error a comment quotes).
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import inspect
import io
import re
import shutil
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import dynstate

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_BUCKET = "bucket"  # the bucket the docs' S3 URLs name (tests/test_docs_output.py's)

# The python blocks of docs/*.md, per page: a new block fails test_every_block_is_run until a
# test here runs it.
COUNTS = {
    "ddp.md": 4,
    "dynamic-sampling.md": 1,
    "index.md": 2,
    "object-stores.md": 1,
    "outcomes.md": 3,
    "ray.md": 2,
    "resume.md": 3,
    "trl.md": 2,
    "verl.md": 1,
}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the block's first code line in the page (1-based)
    code: str

    @property
    def where(self) -> str:
        return f"docs/{self.doc}:{self.line}"


def python_blocks(doc: str) -> list[Block]:
    text = (DOCS / doc).read_text()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        out.append(Block(doc, text.count("\n", 0, m.start(1)) + 1, m.group(1)))
    return out


def block(doc: str, index: int) -> Block:
    blocks = python_blocks(doc)
    assert len(blocks) == COUNTS[doc], f"docs/{doc} has {len(blocks)} python blocks"
    return blocks[index]


def _placeholders(code: str) -> str:
    """``code`` with each ``...`` token (not one inside a string or comment) read as the name
    ``_placeholder_``."""
    lines = code.splitlines(keepends=True)
    spots = [
        tok.start
        for tok in tokenize.generate_tokens(io.StringIO(code).readline)
        if tok.type == tokenize.OP and tok.string == "..."
    ]
    for row, col in reversed(spots):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + "_placeholder_" + line[col + 3 :]
    return "".join(lines)


def compiled(b: Block, code: str | None = None, first_line: int | None = None) -> Any:
    """``code`` (default: the block) compiled with the page's line numbers in tracebacks."""
    code = b.code if code is None else code
    line = b.line if first_line is None else first_line
    return compile("\n" * (line - 1) + _placeholders(code), b.where, "exec")


def run(b: Block, scope: dict[str, Any], code: str | None = None, line: int | None = None):
    scope.setdefault("__name__", "docs_block")  # not importable: Ray pickles its classes by value
    exec(compiled(b, code, line), scope)
    return scope


def split(b: Block, marker: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """The block in two at the line starting with ``marker`` (both parts with their lines)."""
    lines = b.code.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.startswith(marker)]
    assert len(at) == 1, f"{b.where}: no single line starting with {marker!r}"
    i = at[0]
    return ("".join(lines[:i]), b.line), ("".join(lines[i:]), b.line + i)


# -- the static check: names and arguments against the real signatures -----------------------

# Free names a block assumes, by what they are (for the methods it calls on them).
FREE_TYPES: dict[str, Any] = {
    "store": dynstate.Store,
    "self.store": dynstate.Store,
    "sampler": dynstate.VersionedSampler,
    "snap": dynstate.Snapshot,
    "ds": dynstate.VersionedDataset,
    "Store": dynstate.Store,
}
# Per block, where a free name is something else than the default above.
BLOCK_TYPES: dict[tuple[str, int], dict[str, Any]] = {
    ("verl.md", 0): {"dataset": "dynstate.verl.DynstateRLDataset"},
}


def _forwards(fn: Any) -> Any:
    """Where a ``**kwargs`` of a dynstate callable goes (checked there), else None."""
    from dynstate.trl import DynstateGRPOTrainer

    if fn is DynstateGRPOTrainer:
        from trl import GRPOTrainer

        return GRPOTrainer
    if getattr(fn, "__qualname__", "") == "DynstateRLDataset.outcome_stats":
        return dynstate.Store.outcome_stats
    return None


def _resolve_dotted(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class _Checker(ast.NodeVisitor):
    """Resolves the dynstate names of a block and binds each call to a dynstate callable."""

    def __init__(self, where: str, types: dict[str, Any]):
        self.where = where
        self.names: dict[str, Any] = {}  # name -> ("obj", value) | ("instance", class)
        for name, cls in types.items():
            cls = _resolve_dotted(cls) if isinstance(cls, str) else cls
            self.names[name] = ("instance", cls) if name != "Store" else ("obj", cls)
        self.problems: list[str] = []
        self.checked: list[str] = []

    # imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "dynstate":
                continue
            module = importlib.import_module(alias.name)
            if alias.asname:
                self.names[alias.asname] = ("obj", module)
            else:
                self.names["dynstate"] = ("obj", dynstate)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not (node.module or "").startswith("dynstate"):
            return
        module = importlib.import_module(node.module or "")
        for alias in node.names:
            if not hasattr(module, alias.name):
                self.problems.append(f"{self.where}: {node.module}.{alias.name} does not exist")
                continue
            self.names[alias.asname or alias.name] = ("obj", getattr(module, alias.name))

    def resolve(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if dotted in self.names:
                return self.names[dotted]
            base = self.resolve(node.value)
            if base is None:
                return None
            kind, value = base
            if kind == "obj" and _is_dynstate(value):
                if not hasattr(value, node.attr):
                    self.problems.append(f"{self.where}: {ast.unparse(node)} does not exist")
                    return None
                return ("obj", getattr(value, node.attr))
            if kind == "instance":
                attr = inspect.getattr_static(value, node.attr, None)
                if attr is None and callable(getattr(value, "__getattr__", None)):
                    return None
                if attr is None:
                    return None  # an instance attribute (checked by running the block)
                return ("method", getattr(value, node.attr))
        if isinstance(node, ast.Call):
            callee = self.resolve(node.func)
            if callee is None:
                return None
            fn = callee[1]
            if inspect.isclass(fn):
                return ("instance", fn)
            try:
                ret = inspect.signature(fn, eval_str=True).return_annotation
            except Exception:
                return None
            return ("instance", ret) if inspect.isclass(ret) and _is_dynstate(ret) else None
        return None

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        value = self.resolve(node.value) if isinstance(node.value, ast.Call) else None
        for target in node.targets:
            if isinstance(target, (ast.Name, ast.Attribute)) and value is not None:
                self.names[ast.unparse(target)] = value

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.resolve(node)  # a dynstate.X that does not exist is a problem
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        callee = self.resolve(node.func)
        if callee is None:
            return
        fn = callee[1]
        if not _is_dynstate(fn):
            return
        self.bind(ast.unparse(node.func), fn, node, method=callee[0] == "method")

    def bind(self, name: str, fn: Any, node: ast.Call, method: bool) -> None:
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        ):
            return
        sig = inspect.signature(fn)
        args = [None] * len(node.args)
        keywords = {k.arg: None for k in node.keywords if k.arg is not None}
        forward = _forwards(fn)
        if forward is not None:
            own = {
                p.name
                for p in sig.parameters.values()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            }
            passed = {k: v for k, v in keywords.items() if k not in own}
            try:
                inspect.signature(forward).bind_partial(**passed)
            except TypeError as e:
                self.problems.append(f"{self.where}: {name}(...) forwards to {forward}: {e}")
            keywords = {k: v for k, v in keywords.items() if k in own}
        try:
            sig.bind_partial(*args, **keywords)
        except TypeError as e:
            self.problems.append(f"{self.where}: {name}(...) does not bind to {sig}: {e}")
        else:
            self.checked.append(name)


def _is_dynstate(value: Any) -> bool:
    module = getattr(value, "__module__", None) or getattr(value, "__name__", "")
    if inspect.ismodule(value):
        module = value.__name__
    return isinstance(module, str) and module.split(".")[0] == "dynstate"


def _comment_calls(code: str) -> list[str]:
    """The calls written in the block's comments (``dynstate.StdThreshold(0.1)``,
    ``store.commit_staged(parts, meta=...)``), as code."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#")
        for m in re.finditer(r"[A-Za-z_][\w.]*\(", text):
            depth, end = 0, None
            for i in range(m.end() - 1, len(text)):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                if depth == 0:
                    end = i + 1
                    break
            if end is None:
                continue
            snippet = text[m.start() : end]
            try:
                ast.parse(snippet, mode="eval")
            except SyntaxError:
                continue
            out.append(snippet)
    return out


def check_api(b: Block, index: int) -> list[str]:
    """The problems of block ``index`` of its page (empty: every name and argument is real);
    also the names of the dynstate calls bound."""
    tree = ast.parse(_placeholders(b.code))
    types = {**FREE_TYPES, **BLOCK_TYPES.get((b.doc, index), {})}
    checker = _Checker(b.where, types)
    # names a block uses without importing (a fragment of a page whose import is above)
    checker.names.setdefault("dynstate", ("obj", dynstate))
    checker.visit(tree)
    for snippet in _comment_calls(b.code):
        call = ast.parse(_placeholders(snippet), mode="eval").body
        scope = _Checker(b.where + " (comment)", {})
        scope.names = dict(checker.names)
        for name in dir(dynstate):  # a comment's bare FilterRule(...) is dynstate's
            scope.names.setdefault(name, ("obj", getattr(dynstate, name)))
        scope.visit(call)
        checker.problems += scope.problems
        checker.checked += scope.checked
    return list(dict.fromkeys(checker.problems))


ALL_BLOCKS = [(doc, i) for doc in COUNTS for i in range(COUNTS[doc])]


@pytest.mark.parametrize(("doc", "index"), ALL_BLOCKS, ids=[f"{d}#{i}" for d, i in ALL_BLOCKS])
def test_every_block_names_real_api(doc: str, index: int) -> None:
    b = block(doc, index)
    compiled(b)
    assert check_api(b, index) == []


def test_every_block_is_run() -> None:
    """Every docs/*.md python block is counted in COUNTS (so a test below runs it)."""
    found = {p.name: len(python_blocks(p.name)) for p in sorted(DOCS.glob("*.md"))}
    assert {k: v for k, v in found.items() if v} == COUNTS


def test_the_checker_catches_a_renamed_argument() -> None:
    b = Block("x.md", 1, "import dynstate\nd = dynstate.VersionedDataset(url, row_col='r')\n")
    assert check_api(b, 0) and "row_col" in check_api(b, 0)[0]
    b = Block("x.md", 1, "store.append(rows, metadata={})\nsnap = store.snapshot()\n")
    assert check_api(b, 0)
    b = Block("x.md", 1, "x = dynstate.NoSuchThing()\n# or dynstate.StdThreshold(lo=1)\n")
    assert len(check_api(b, 0)) == 2


# -- helpers -----------------------------------------------------------------------------------


def rows(n: int, prefix: str = "p", start: int = 0, **extra: Any) -> list[dict[str, Any]]:
    return [{"prompt": f"{prefix}{i}", **extra} for i in range(start, start + n)]


def seeded(url: str, n: int = 40, **extra: Any) -> dynstate.Store:
    store = dynstate.Store.open(url, create=True)
    store.append(rows(n, **extra))
    return store


def prompts(batch: Any) -> list[str]:
    if isinstance(batch, dict):
        return list(batch["prompt"])
    return [r["prompt"] for r in batch]


def fresh_doc_bucket(s3_server: Any) -> str:
    from test_docs_output import _fresh_doc_bucket

    return _fresh_doc_bucket(s3_server)


@pytest.fixture
def world_of_one(tmp_path: Path):
    """A real gloo process group of one process (rank 0): what ``dist`` is in a one-rank run."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", world_size=1, rank=0)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


# -- ddp.md ------------------------------------------------------------------------------------


def test_ddp_loader_block(tmp_path: Path) -> None:
    """The loader on each rank: one rank (no process group), 40 rows, an epoch of 5 steps of 8
    rows, every row once."""
    url = str(tmp_path / "store")
    seeded(url)
    ns = run(block("ddp.md", 0), {"url": url})
    assert isinstance(ns["loader"], ns["StatefulDataLoader"])  # check_loader returns it
    assert len(ns["loader"]) == 5
    seen = [p for batch in ns["loader"] for p in batch["prompt"]]
    assert sorted(seen) == sorted(f"p{i}" for i in range(40))


def _ddp_steps(store, loader, first: int, last: int, log: list) -> None:
    step = first
    while step <= last:
        for batch in loader:
            log.append((step, prompts(batch)))
            store.append(rows(2, prefix=f"s{step}-"), meta={"step": step})
            step += 1
            if step > last:
                return


def _ddp_loader(url: str):
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = dynstate.VersionedDataset(url)
    sampler = dynstate.VersionedSampler(dataset, seed=0, batch_size=8, drop_last=True)
    loader = StatefulDataLoader(dataset, batch_size=8, drop_last=True, sampler=sampler)
    return dynstate.Store.open(url), sampler, loader


def test_ddp_checkpoint_and_resume_block(tmp_path: Path, world_of_one: Any) -> None:
    """Save after step 2's round, go on to step 4, crash; the resume half rolls the store back
    to the checkpoint's head and the sampler continues with exactly the uninterrupted run's
    batches (across an epoch end)."""
    import os

    import torch

    b = block("ddp.md", 1)
    (save, save_line), (resume, resume_line) = split(b, "# resume")
    reference: list = []
    seeded(str(tmp_path / "ref"))
    store, _, loader = _ddp_loader(str(tmp_path / "ref"))
    _ddp_steps(store, loader, 0, 8, reference)

    url = str(tmp_path / "store")
    seeded(url)
    store, sampler, loader = _ddp_loader(url)
    crashed: list = []
    _ddp_steps(store, loader, 0, 2, crashed)
    path, tmp = str(tmp_path / "ckpt.pt"), str(tmp_path / "ckpt.pt.tmp")
    scope = {"dynstate": dynstate, "torch": torch, "os": os, "loader": loader, "store": store}
    scope.update(step=2, tmp=tmp, path=path, _placeholder_={"weight": torch.zeros(2)})
    run(b, scope, save, save_line)
    head_at_save = store.head
    _ddp_steps(store, loader, 3, 4, crashed)  # rounds of steps 3 and 4, then a kill
    assert crashed == reference[:5]

    store, sampler, _ = _ddp_loader(url)
    before = store.head
    scope = {"dynstate": dynstate, "torch": torch, "dist": world_of_one, "rank": 0}
    scope.update(store=store, sampler=sampler, path=path)
    ns = run(b, scope, resume, resume_line)
    assert ns["step"] == 3
    assert store.refresh() == before + 1  # one reset commit
    record = store.commit_record(store.head)
    assert record.op == "reset" and store.snapshot().num_rows == (
        store.snapshot(head_at_save).num_rows
    )
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(sampler.dataset, batch_size=8, drop_last=True, sampler=sampler)
    resumed: list = []
    _ddp_steps(store, loader, 3, 8, resumed)
    assert resumed == reference[3:]


def test_ddp_commit_round_block(tmp_path: Path) -> None:
    """commit_round: a step already in the head's lineage is not committed twice (its version
    is returned); a new step is appended; after a rollback a step is committed again."""
    store = seeded(str(tmp_path / "store"))
    ns = run(block("ddp.md", 2), {"dynstate": dynstate})
    commit_round = ns["commit_round"]
    v0 = commit_round(store, 0, rows(1, "a"))
    v1 = commit_round(store, 1, rows(1, "b"))
    assert (v0, v1) == (2, 3)
    assert commit_round(store, 0, rows(1, "a")) == v0  # a retry of step 0: already there
    assert commit_round(store, 1, rows(1, "b")) == v1
    assert store.refresh() == 3
    dynstate.rollback(store, step=0)  # version 4: reset to 2
    assert commit_round(store, 1, rows(1, "b")) == 5  # step 1 was rolled back: made again


def test_ddp_stage_block(tmp_path: Path, world_of_one: Any) -> None:
    """Every rank stages its part, rank 0 commits the parts as one version after the lineage
    check (one rank in a real gloo group; tests/test_ranks_ddp.py runs several)."""
    store = seeded(str(tmp_path / "store"))

    committed = run(block("ddp.md", 2), {"dynstate": dynstate})["committed"]
    scope = {"store": store, "my_rows": rows(3, "mine"), "world": 1, "rank": 0, "step": 0}
    scope.update(dist=world_of_one, committed=committed)
    run(block("ddp.md", 3), scope)
    assert store.refresh() == 2
    assert store.commit_record(2).meta == {"step": 0}
    assert store.snapshot().to_arrow().column("prompt").to_pylist()[-3:] == [
        "mine0",
        "mine1",
        "mine2",
    ]
    run(block("ddp.md", 3), {**scope, "store": dynstate.Store.open(store.url)})
    assert store.refresh() == 2  # the same step again: found, not committed twice


# -- dynamic-sampling.md -----------------------------------------------------------------------


def _score_of(prompt: str) -> list[float]:
    i = int(prompt.removeprefix("p").split("-")[0]) if prompt[1:2].isdigit() else 1
    return [1.0] * 4 if i % 3 == 0 else [1.0, 0.0, float(i % 2), 0.0]


def _dynamic_scope(url: str, checkpoint_step: int | None, trained: list, saved: list) -> dict:
    store = dynstate.Store.open(url)

    def generate(item: dict, n: int) -> list[str]:
        return [item["prompt"]] * n

    def reward(responses: list[str]) -> list[float]:
        return _score_of(responses[0])

    def train(groups: Any) -> None:
        trained.append([g.row for g in groups])

    def save_checkpoint(model: Any, optimizer: Any, *, step: int) -> None:
        saved.append(step)

    return {
        "url": url,
        "store": store,
        "checkpoint_step": checkpoint_step,
        "generate": generate,
        "reward": reward,
        "train": train,
        "save_checkpoint": save_checkpoint,
        "total_steps": 3,
        "ckpt_every": 2,
        "new_rows": rows(1, "gen"),
        "model": None,
        "optimizer": None,
    }


def test_dynamic_sampling_loop_block(tmp_path: Path) -> None:
    """Three steps of 16 groups (a third of the rows filtered), each committed with its
    outcomes and consumption; the exactly-once equation holds per record; a resume from step
    0's checkpoint rolls the store back and trains steps 1 and 2 as before."""
    url = str(tmp_path / "store")
    seeded(url, n=60)
    b = block("dynamic-sampling.md", 0)
    trained: list = []
    saved: list = []
    ns = run(b, _dynamic_scope(url, None, trained, saved))
    assert ns["start"] == 0 and saved == [0, 2]
    assert [len(t) for t in trained] == [16, 16, 16]
    store = dynstate.Store.open(url)
    records = dynstate.consumption_records(store)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        into = collections.Counter(r["carried_in"] + r["drawn"])
        out = collections.Counter(
            r["trained"]
            + [f[0] for f in r["filtered"]]
            + [d[0] for d in r["dropped"]]
            + [c[0] for c in r["carry"]]
        )
        assert into == out
        assert r["settings"]["rule"]["name"] == "zero_variance" and r["filtered"]
    # every group scored at a step (trained, filtered, carried, dropped): each drawn row's
    assert sorted(store.outcome_records().column("step").to_pylist()) == sorted(
        r["step"] for r in records for _ in r["drawn"] for _ in range(4)
    )

    again: list = []
    ns = run(b, _dynamic_scope(url, 0, again, []))
    assert ns["start"] == 1
    assert again == trained[1:]
    lineage = dynstate.lineage(store)
    assert any(store.commit_record(v).op == "reset" for v in lineage)


# -- index.md ----------------------------------------------------------------------------------


class _LoaderOver:
    """What the block's ``...`` elides: a loader over the block's own ``ds`` (one batch of 8
    rows, a list of row dicts, as the README's loader gives)."""

    def __init__(self, scope: dict):
        self.scope = scope

    def __iter__(self):
        from torchdata.stateful_dataloader import StatefulDataLoader

        ds = self.scope["ds"]
        sampler = dynstate.VersionedSampler(ds, seed=0, batch_size=8)
        return iter(StatefulDataLoader(ds, batch_size=8, sampler=sampler, collate_fn=list))


def test_index_lineage_block(tmp_path: Path) -> None:
    """New rows name the rows they vary in ``_dynstate_source``: each new row's source is the
    row whose prompt it made harder."""
    store = seeded(str(tmp_path / "store"), n=8, _dynstate_source=None)
    scope: dict[str, Any] = {"dynstate": dynstate, "store": store, "step": 0}
    scope.update(harder=lambda p: p + " (harder)", failed=lambda r: int(r["prompt"][1:]) % 2)
    scope["loader"] = _LoaderOver(scope)
    scope["_placeholder_"] = None
    run(block("index.md", 0), scope)
    table = store.snapshot().to_arrow().to_pylist()
    assert len(table) == 12 and store.commit_record(2).meta == {"generator": "harder", "step": 0}
    for new in table[8:]:
        (source,) = new["_dynstate_source"]
        assert new["prompt"] == table[source]["prompt"] + " (harder)"


def test_index_outcomes_block(tmp_path: Path) -> None:
    """Outcomes by ``_dynstate_row``, the generator's state, and ``outcome_stats()``: one row
    per store row; ``hardest``: tried rows by mean score, lowest first."""
    url = str(tmp_path / "store")
    store = seeded(url, n=10, _dynstate_source=None)
    ds = dynstate.VersionedDataset(store, row_column="_dynstate_row")
    batch = [ds[i] for i in (7, 2, 5, 4)]

    class Generator:
        def __init__(self):
            self.count = 0

        def generate(self, batch):
            self.count += 1
            return [
                {"prompt": r["prompt"] + "!", "_dynstate_source": [r["_dynstate_row"]]}
                for r in batch[:2]
            ]

        def state_dict(self):
            return {"count": self.count}

    generator = Generator()
    scope = {"store": store, "step": 0, "batch": batch, "generator": generator}
    scope.update(reward=lambda b: [int(r["prompt"][1:]) / 10 for r in b], _placeholder_=batch)
    ns = run(block("index.md", 1), scope)
    assert ns["stats"].num_rows == store.snapshot().num_rows == 12
    assert ns["hardest"].column("row").to_pylist() == [2, 4, 5, 7]
    assert ns["hardest"].column("mean_score").to_pylist() == [0.2, 0.4, 0.5, 0.7]
    assert store.generator_state() == {"count": 1}


# -- object-stores.md --------------------------------------------------------------------------


def test_object_stores_options_block(s3_server: Any) -> None:
    """``Store.open`` with explicit storage options, on the loopback S3 server (its endpoint
    for minio.internal, ``bucket`` for my-bucket); credentials "..." as written (moto takes
    any)."""
    b = block("object-stores.md", 0)
    root = fresh_doc_bucket(s3_server)
    seeded(root + "runs/exp1", n=3)
    code = b.code.replace("https://minio.internal:9000", s3_server.endpoint)
    code = code.replace("s3://my-bucket/", f"s3://{DOC_BUCKET}/")
    assert code != b.code
    ns = run(b, {"Store": dynstate.Store}, code)
    assert ns["store"].head == 1
    assert ns["store"].snapshot().to_arrow().column("prompt").to_pylist() == ["p0", "p1", "p2"]


# -- outcomes.md -------------------------------------------------------------------------------


def _outcome(step: int, rows_: list[int], scores: list[float]) -> dict:
    return {"row": rows_, "step": [step] * len(rows_), "score": scores}


def test_outcomes_append_and_stats_block(tmp_path: Path) -> None:
    """A run reaches step 40 (tag ``step-40``), is rolled back to step 6 and commits step 7:
    the head's statistics count steps 0-7; those at the tag are what step 40 knew."""
    store = seeded(str(tmp_path / "store"), n=10)
    for step in range(41):
        store.append(
            [], meta={"step": step}, outcomes=_outcome(step, [step % 10], [float(step % 3 == 0)])
        )
    store.tag("step-40")
    at_40 = store.outcome_stats()
    dynstate.rollback(store, step=6)

    class Gen:
        def state_dict(self):
            return {"round": 7}

    scored = _outcome(7, [1, 2], [1.0, 0.0])
    ns = run(
        block("outcomes.md", 0),
        {"store": store, "new_rows": rows(2, "n"), "gen": Gen(), "scored": scored},
    )
    assert ns["stats"].equals(at_40)
    head = store.outcome_stats()
    assert head.num_rows == store.snapshot().num_rows == 12  # one row per store row
    assert sum(head.column("attempts").to_pylist()) == 9  # steps 0-6, and 7's two
    assert store.generator_state() == {"round": 7}


def test_outcomes_pending_block(tmp_path: Path) -> None:
    """``outcome_stats(pending=scored)`` equals the statistics after the commit."""
    store = seeded(str(tmp_path / "store"), n=80)
    for step in range(3):
        store.append(
            [],
            meta={"step": step},
            outcomes=_outcome(
                step, list(range(0, 80, 3)), [float((r + step) % 4 == 0) for r in range(0, 80, 3)]
            ),
        )
    scored = _outcome(3, [1, 2, 3], [0.5, 0.25, 1.0])
    ns = run(block("outcomes.md", 1), {"store": store, "scored": scored})
    hardest = ns["hardest"]
    assert hardest.num_rows == 64
    means = hardest.column("mean_score").to_pylist()
    assert means == sorted(means, key=lambda m: (m is None, m))
    store.append([], meta={"step": 3}, outcomes=scored)
    assert ns["stats"].equals(store.outcome_stats())


def _at_version_2(url: str) -> dynstate.Store:
    store = dynstate.Store.open(url, create=True)
    store.append(rows(30))  # version 1
    store.append(rows(10, start=30))  # version 2
    return store


def _quoted_error(b: Block) -> str:
    """The message the block's comment quotes, as a pattern (``...``: anything)."""
    comment = " ".join(
        line.split("#", 1)[1].strip() for line in b.code.splitlines() if line.startswith("#")
    )
    m = re.search(r'"(.*)"', comment)
    assert m is not None, f"{b.where}: no quoted message"
    return ".*".join(re.escape(p.strip()) for p in m.group(1).split("..."))


def test_outcomes_bind_to_rows_block(tmp_path: Path) -> None:
    """At version 2 the block commits its outcomes; when a reset to version 1 and an append
    (version 4) land between its snapshot and its append, it raises the CommitConflictError
    its comment quotes, and nothing is written."""
    b = block("outcomes.md", 2)
    batch_rows = [35, 36]

    def score(table: pa.Table) -> pa.Table:
        assert table.column("prompt").to_pylist() == ["p35", "p36"]
        return pa.table(_outcome(0, batch_rows, [1.0, 0.0]))

    store = _at_version_2(str(tmp_path / "a"))
    scope = {"store": store, "score": score, "batch_rows": batch_rows, "new_rows": rows(1, "n")}
    ns = run(b, dict(scope))
    assert ns["snap"].version == 2  # "# version 2"
    assert store.refresh() == 3
    assert store.outcome_records().column("row").to_pylist() == batch_rows

    url = str(tmp_path / "b")
    store = _at_version_2(url)

    def score_while_reset(table: pa.Table) -> pa.Table:
        other = dynstate.Store.open(url)
        other.reset(1)  # version 3
        other.append(rows(10, "other"))  # version 4: row 35 is another row now
        return score(table)

    with pytest.raises(dynstate.CommitConflictError, match=_quoted_error(b)) as caught:
        run(b, {**scope, "store": store, "score": score_while_reset})
    assert re.search(_quoted_error(b), str(caught.value), re.S)
    assert dynstate.Store.open(url).head == 4  # nothing was written


# -- ray.md ------------------------------------------------------------------------------------


def test_ray_blocks(s3_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Four Proposer actors stage, the driver commits one version (step 100); read back with
    ``to_ray_dataset`` at the tag ``step-100``. Ray runs locally with 4 GPUs declared (the
    actors ask for ``num_gpus=1``; they never touch one), ``my-bucket`` is the loopback
    server's ``bucket``."""
    import ray

    root = fresh_doc_bucket(s3_server)
    url = root + "runs/gsm8k-selfplay"
    seeded(url, n=2)
    one, two = block("ray.md", 0), block("ray.md", 1)
    codes = [x.code.replace("s3://my-bucket/", f"s3://{DOC_BUCKET}/") for x in (one, two)]
    assert all(c != x.code for c, x in zip(codes, (one, two), strict=True))
    # an actor asking for a GPU holds a CPU too: 4 for the actors, 2 for the read tasks
    ray.init(address="local", num_cpus=6, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        scope = {"step": 100, "chunks": [[f"q{i}"] for i in range(4)]}
        # `rows = [...]`: one generated row per actor
        scope["_placeholder_"] = {"prompt": "generated"}
        ns = run(one, scope, codes[0])
        store = dynstate.Store.open(url)
        assert ns["version"] == store.head == 2
        assert store.commit_record(2).meta == {"generator": "proposer-v1", "step": 100}
        assert store.snapshot().num_rows == 6
        for proposer in ns["proposers"]:
            ray.kill(proposer)
        store.tag("step-100", 2)
        store.append(rows(1))  # the tag, not the head, is read
        capsys.readouterr()
        ns = run(two, {}, codes[1])
        shown = capsys.readouterr().out
        assert ns["ds"].count() == 6
        assert shown.startswith("6 ") and "prompt" in shown, shown
    finally:
        ray.shutdown()


# -- resume.md ---------------------------------------------------------------------------------


def _loader(dataset: Any, sampler: Any, workers: int):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, batch_size=8, sampler=sampler, num_workers=workers)


def _steps(store, loader, first: int, last: int, log: list, save=None) -> None:
    """The save / resume sequence's steps ``first``..``last``: train (log the batch), commit
    the round, checkpoint at ``save = (step, path)``."""
    import torch

    step = first
    while step <= last:
        for batch in loader:
            log.append((step, prompts(batch)))
            store.append(rows(3, prefix=f"s{step}-"), meta={"step": step, "generator": "g"})
            if save is not None and save[0] == step:
                torch.save({"loader": loader.state_dict(), "step": step}, save[1])
            step += 1
            if step > last:
                return


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes:UserWarning")
def test_resume_blocks(tmp_path: Path) -> None:
    """A run checkpointed at step 3 and killed after step 5's round; resumed by the first
    block (rollback, 2 loader workers as saved) and by the second (sampler state into a
    4-worker loader, on a copy of the killed store): steps 4-7 are the uninterrupted run's.
    The third tags the pinned version, which then survives a gc that keeps one version."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    reference: list = []
    store = seeded(str(tmp_path / "ref"))
    dataset = dynstate.VersionedDataset(store)
    loader = _loader(dataset, dynstate.VersionedSampler(dataset, seed=0, batch_size=8), 2)
    _steps(store, loader, 0, 7, reference)

    url, path = str(tmp_path / "store"), str(tmp_path / "ckpt.pt")
    store = seeded(url)
    dataset = dynstate.VersionedDataset(store)
    loader = _loader(dataset, dynstate.VersionedSampler(dataset, seed=0, batch_size=8), 2)
    crashed: list = []
    _steps(store, loader, 0, 5, crashed, save=(3, path))
    assert crashed == reference[:6]
    shutil.copytree(url, tmp_path / "copy")
    killed_head = store.head

    ns = run(
        block("resume.md", 0),
        {
            "torch": torch,
            "dynstate": dynstate,
            "url": url,
            "path": path,
            "StatefulDataLoader": StatefulDataLoader,
        },
    )
    assert ns["step"] == 4  # the next round is step + 1
    store = ns["store"]
    assert store.head == killed_head + 1
    assert store.commit_record(store.head).meta["rollback_from"] == killed_head
    resumed: list = []
    _steps(store, ns["loader"], 4, 7, resumed)
    assert resumed == reference[4:]

    # another num_workers: the sampler state into a 4-worker loader
    copy = dynstate.Store.open(str(tmp_path / "copy"))
    ckpt = torch.load(path, weights_only=True)
    dynstate.rollback(copy, step=ckpt["step"])
    scope = {"dynstate": dynstate, "ckpt": ckpt, "dataset": dynstate.VersionedDataset(copy)}
    ns2 = run(block("resume.md", 1), {**scope, "StatefulDataLoader": StatefulDataLoader})
    assert ns2["loader"].num_workers == 4
    again: list = []
    _steps(copy, ns2["loader"], 4, 7, again)
    assert again == reference[4:]

    # tag the version the checkpoint's sampler state pins
    loader = ns["loader"]
    run(block("resume.md", 2), {"dynstate": dynstate, "store": store, "step": 7, "loader": loader})
    pinned = dynstate.find_sampler_state(loader.state_dict())["version"]
    assert store.resolve("ckpt-7") == pinned
    _steps(store, loader, 8, 12, [])  # the next epoch pins another version
    run(
        block("resume.md", 2), {"dynstate": dynstate, "store": store, "step": 7, "loader": loader}
    )  # force=True: the tag moves
    assert store.resolve("ckpt-7") == dynstate.find_sampler_state(loader.state_dict())["version"]
    assert store.resolve("ckpt-7") != pinned
    rows_at_tag = store.snapshot("ckpt-7").num_rows
    dynstate.collect_garbage(store, keep=1, dry_run=False, grace_s=0)
    assert store.snapshot("ckpt-7").to_arrow().num_rows == rows_at_tag


# -- trl.md ------------------------------------------------------------------------------------


def _trl_example() -> Any:
    path = ROOT / "examples" / "trl" / "train.py"
    spec = importlib.util.spec_from_file_location("docs_trl_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trl_scope(example: Any, out: Path) -> dict[str, Any]:
    """What a GRPOTrainer script already has (examples/trl/train.py's model, tokenizer,
    reward and config), for 2 steps."""
    import torch
    from transformers import set_seed
    from trl import GRPOConfig

    torch.set_num_threads(1)
    set_seed(0)
    tokenizer = example.build_tokenizer()
    config = GRPOConfig(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=example.PROMPTS_PER_STEP * example.GENERATIONS,
        num_generations=example.GENERATIONS,
        max_completion_length=2,
        learning_rate=3e-3,
        beta=0.0,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        seed=0,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return {
        "model": example.build_model(tokenizer),
        "tokenizer": tokenizer,
        "config": config,
        "reward": example.reward,
    }


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_trl_blocks(s3_server: Any, tmp_path: Path) -> None:
    """The changed lines, as written on ``s3://bucket/runs/arith`` (loopback S3): 2 steps,
    each committing its round (a generator's variations) with its outcomes; then the group
    filtering block on a local store: 2 steps, each with its consumption record."""
    import datasets

    example = _trl_example()
    fresh_doc_bucket(s3_server)

    class HardestVariations(example.HardestVariations):
        def __init__(self) -> None:
            super().__init__(seed=0)

    scope = _trl_scope(example, tmp_path / "out")
    scope["dataset"] = datasets.Dataset.from_list(example.first_tasks(0))
    scope["HardestVariations"] = HardestVariations
    ns = run(block("trl.md", 0), scope)
    assert ns["trainer"].state.global_step == 2
    store = dynstate.Store.open(f"s3://{DOC_BUCKET}/runs/arith")
    steps = [store.commit_record(v).meta.get("step") for v in dynstate.lineage(store)]
    assert steps[:2] == [2, 1]
    assert sorted(set(store.outcome_records().column("step").to_pylist())) == [1, 2]
    assert store.generator_state() == {"seed": 0, "count": 2}

    store = dynstate.Store.open(str(tmp_path / "filter"), create=True)
    store.append(example.first_tasks(0))
    scope = _trl_scope(example, tmp_path / "out-filter")
    ns = run(block("trl.md", 1), {**scope, "dynstate": dynstate, "store": store})
    ns["trainer"].train()  # the block builds the trainer; the script's train() call is unchanged
    assert ns["trainer"].state.global_step == 2
    records = dynstate.consumption_records(store)
    assert [r["step"] for r in records] == [1, 2]
    settings = records[0]["settings"]
    assert settings["rule"]["name"] == "zero_variance"
    assert (settings["max_gen_batches"], settings["surplus"]) == (10, "carry")


# -- verl.md -----------------------------------------------------------------------------------


def test_verl_outcome_stats_block(tmp_path: Path) -> None:
    """``dataset.outcome_stats()`` of verl's DynstateRLDataset (built from a verl data config
    over a store with outcomes): the columns the comment lists, one row per store row,
    successes counting scores above 0.5; the other parameters are Store.outcome_stats'."""
    import pandas as pd
    import verl_common
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from dynstate.verl import DynstateRLDataset

    words = ["<unk>", "<pad>", "<eos>", "What", "is", "+", "?"] + [str(i) for i in range(40)]
    model = verl_common.make_model_dir(
        str(tmp_path / "model"),
        words,
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "Whitespace",
    )
    tasks = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + {i} ?"}],
            "data_source": "arith",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i in range(6)
    ]
    files = str(tmp_path / "train.parquet")
    pd.DataFrame(tasks).to_parquet(files)
    url = str(tmp_path / "store")
    store = dynstate.Store.open(url, create=True)
    store.append(pa.Table.from_pandas(pd.DataFrame(tasks)))
    for step in (1, 2, 3):
        store.append(
            [],
            meta={"step": step},
            outcomes=_outcome(step, [0, 1, 2, 3], [0.4, 0.6, 0.95, float(step == 3)]),
        )
    config = OmegaConf.create(
        {
            "train_files": files,
            "val_files": files,
            "prompt_key": "prompt",
            "max_prompt_length": 64,
            "filter_overlong_prompts": False,
            "dynstate": {"url": url},
        }
    )
    dataset = DynstateRLDataset(files, AutoTokenizer.from_pretrained(model), config)
    version = store.head

    b = block("verl.md", 0)
    first, _ = split(b, "stats = dataset.outcome_stats(success")
    ns = run(b, {"dataset": dataset}, *first)
    stats = ns["stats"]
    listed = b.code.splitlines()[1].lstrip("# ")
    assert stats.column_names == [re.sub(r"\s*\(.*\)", "", c) for c in listed.split(", ")]
    assert stats.num_rows == store.snapshot().num_rows == 6
    assert stats.equals(store.outcome_stats(version))
    assert stats.column("successes").to_pylist() == [0, 3, 3, 1, 0, 0]  # score > 0.5
    ns = run(b, {"dataset": dataset})
    assert ns["stats"].equals(store.outcome_stats(version, success_above=0.9, half_life=20))
    assert ns["stats"].column("successes").to_pylist() == [0, 0, 3, 1, 0, 0]
