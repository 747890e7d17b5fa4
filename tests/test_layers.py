"""The import direction follows the map in docs/architecture.md, which this test reads: every
module of the package is listed there once, a module imports only from its own layer or the
layers below it, and a private name (``_x``) never crosses from one package to another.
Function-level imports count too: a lazy import is still a dependency. Third-party clients stay
behind their boundaries (object-store clients in ``storage/``, verl in ``verl/``, TRL in
``trl/``, Ray in ``ray.py`` and ``verl/``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dynstate"
MAP = ROOT / "docs" / "architecture.md"


def _read_map() -> list[tuple[str, list[str]]]:
    """(layer, module files relative to the package) per row of the map's table, bottom up."""
    rows = []
    for line in MAP.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.startswith("|") or cells[0] in ("layer", "---"):
            continue
        files = re.findall(r"`([\w/]+\.py)`", cells[1])
        if files:
            rows.append((cells[0], files))
    return rows


def _dotted(file: str) -> str:
    parts = file[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


# Bottom up; the facade (``__init__.py``, module "") re-exports everything and is not placed.
LAYERS: list[tuple[str, ...]] = [
    tuple(_dotted(f) for f in files if not f.endswith("__main__.py") and f != "__init__.py")
    for _, files in _read_map()
]


def _layer(module: str) -> int:
    """``module`` is dotted, relative to the package (``log.commits``)."""
    best, best_len = None, -1
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = index, len(name)
    if best is None:
        raise AssertionError(f"dynstate.{module} is in no layer of tests/test_layers.py: place it")
    return best


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and parts[-1] == "__main__":
            continue
        found[".".join(parts)] = path
    return found


def _eager(tree: ast.Module) -> list[ast.stmt]:
    """The statements a module runs when it is imported: not function bodies (lazy imports)
    and not ``if TYPE_CHECKING:`` blocks (imports for the type checker only)."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt))
    return out


def _imports(module: str, path: Path, *, eager: bool = False) -> list[tuple[str, list[str], int]]:
    """(imported module relative to the package, names imported, line) for dynstate imports;
    every one (lazy and ``TYPE_CHECKING`` ones too), or with ``eager`` only those that run
    when the module is imported."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if module else []
    package = here if is_package else here[:-1]
    out = []
    tree = ast.parse(path.read_text(), str(path))
    for node in _eager(tree) if eager else ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and (node.module == "dynstate" or node.module.startswith("dynstate.")):
                target = node.module.split(".")[1:]
            else:
                continue
            names = [alias.name for alias in node.names]
            if node.module is None or not target:
                # `from . import x` / `from dynstate import x`: each name is a module or a name
                for name in names:
                    out.append((".".join([*target, name]), [], node.lineno))
            else:
                out.append((".".join(target), names, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dynstate."):
                    out.append((alias.name.split(".", 1)[1], [], node.lineno))
    return out


def _resolve(target: str, modules: dict[str, Path]) -> str:
    # `from .log import survey` names the package; `from . import mirror` a module in it.
    while target and target not in modules:
        target = target.rsplit(".", 1)[0] if "." in target else ""
    return target


def test_no_module_imports_a_layer_above_its_own() -> None:
    modules = _modules()
    upward = []
    for module, path in modules.items():
        if module == "":  # the facade re-exports everything, lazily
            continue
        mine = _layer(module)
        for target, _, line in _imports(module, path):
            resolved = _resolve(target, modules)
            if resolved == "":
                continue
            if _layer(resolved) > mine:
                upward.append(f"dynstate/{path.relative_to(PACKAGE)}:{line} imports {resolved}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def _package(module: str) -> str:
    """The subpackage a module lives in; "" for the flat core (``store``, ``writes``, ...)."""
    return module.split(".")[0] if "." in module or module in _SUBPACKAGES else ""


_SUBPACKAGES = {
    "storage",
    "records",
    "log",
    "history",
    "maintenance",
    "loading",
    "verl",
    "trl",
    "cli",
    "serve",
}


def test_no_private_name_crosses_packages() -> None:
    modules = _modules()
    crossing = []
    for module, path in modules.items():
        if module == "":
            continue
        for target, names, line in _imports(module, path):
            resolved = _resolve(target, modules)
            if _package(resolved) == _package(module):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                where = f"dynstate/{path.relative_to(PACKAGE)}:{line}"
                crossing.append(f"{where} takes {private} from dynstate.{resolved}")
    assert not crossing, "private names across packages:\n" + "\n".join(crossing)


def test_every_module_is_placed() -> None:
    for module in _modules():
        if module:
            _layer(module)


def test_the_map_lists_every_module_once() -> None:
    listed = [f for _, files in _read_map() for f in files]
    on_disk = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    twice = sorted({f for f in listed if listed.count(f) > 1})
    assert not twice, f"docs/architecture.md lists these in more than one place: {twice}"
    assert sorted(listed) == on_disk, (
        "docs/architecture.md and dynstate/ disagree; "
        f"not in the map: {sorted(set(on_disk) - set(listed))}, "
        f"not on disk: {sorted(set(listed) - set(on_disk))}"
    )


# Third-party packages and the only places that may import them.
_BOUNDARIES = {
    ("fsspec", "s3fs", "botocore", "boto3", "aiobotocore", "obstore"): ("storage",),
    ("verl", "omegaconf", "hydra"): ("verl",),
    ("trl",): ("trl",),
    ("ray",): ("ray", "verl"),
}


def test_third_party_clients_stay_behind_their_boundaries() -> None:
    crossing = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                for packages, homes in _BOUNDARIES.items():
                    inside = any(module == h or module.startswith(h + ".") for h in homes)
                    if top in packages and not inside:
                        where = f"dynstate/{path.relative_to(PACKAGE)}:{node.lineno}"
                        crossing.append(f"{where} imports {name}")
    assert not crossing, "third-party imports outside their boundary:\n" + "\n".join(crossing)


_FRAME_ATTRIBUTES = {"f_locals", "f_back", "f_globals", "_getframe", "currentframe", "stack"}


def test_no_module_walks_its_callers_frames() -> None:
    """Issue 41.2: what a caller is (the loader's batch size, say) comes through an explicit
    channel, never read out of the caller's stack frames."""
    found = []
    for _module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in _FRAME_ATTRIBUTES:
                owner = node.value.id if isinstance(node.value, ast.Name) else ""
                if node.attr in {"_getframe", "currentframe", "stack"} and owner not in {
                    "sys",
                    "inspect",
                }:
                    continue  # another object's method of that name
                found.append(f"dynstate/{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
    assert not found, "stack-frame walking:\n" + "\n".join(found)


# -- no import cycle -------------------------------------------------------------------------

# The one cycle the map allows, and why: the log's commit loop opens the outcome log on first
# use (numpy and pyarrow, which reading records never needs), and the outcome log names the
# commit log's class for the type checker only. Neither side imports the other when loaded.
_ALLOWED_CYCLES = [frozenset({"log.commits", "log.outcomes"})]


def _graph(modules: dict[str, Path], *, eager: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (lazy and TYPE_CHECKING imports included
    unless ``eager``); the facade, which re-exports everything lazily, is left out."""
    graph: dict[str, set[str]] = {m: set() for m in modules if m}
    for module, path in modules.items():
        if module == "":
            continue
        for target, _, _ in _imports(module, path, eager=eager):
            resolved = _resolve(target, modules)
            if resolved and resolved != module:
                graph[module].add(resolved)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a set of
    modules every one of which imports, through the others, every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_a_layer() -> None:
    """Issue 41.5. Every import counts, ``TYPE_CHECKING`` and function-level ones too: a cycle
    hidden behind either is still two modules that cannot be read, moved or tested apart.
    (With no upward import, every cycle lies inside one layer.)"""
    cycles = [c for c in _cycles(_graph(_modules())) if c not in _ALLOWED_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_allowed_cycle_is_lazy() -> None:
    """No cycle at all among the imports that run when a module loads: the allowed one is
    closed only by a lazy import and a TYPE_CHECKING one."""
    cycles = _cycles(_graph(_modules(), eager=True))
    assert not cycles, "eager import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_cycle_check_finds_a_planted_cycle(tmp_path: Path) -> None:
    """The checks above can fail: loading/view.py given an import of loading/dataset.py (which
    imports it) closes a cycle, whether the import is under TYPE_CHECKING or in a function,
    and the eager check sees neither."""
    modules = _modules()
    assert "loading.view" in _graph(modules)["loading.dataset"]
    planted = tmp_path / "view.py"
    for source in (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .dataset import X\n",
        "def f():\n    from .dataset import X\n",
    ):
        planted.write_text(source)
        graph = _graph({**modules, "loading.view": planted})
        assert frozenset({"loading.view", "loading.dataset"}) <= set().union(*_cycles(graph))
        assert frozenset({"loading.view", "loading.dataset"}) not in [
            c for c in _cycles(_graph({**modules, "loading.view": planted}, eager=True))
        ]
    planted.write_text("from .dataset import X\n")
    eager = _cycles(_graph({**modules, "loading.view": planted}, eager=True))
    assert any({"loading.view", "loading.dataset"} <= c for c in eager)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]


# -- the facade holds ------------------------------------------------------------------------

# The only modules that reach a Store's ``.log`` or ``.storage``, and why; every other caller
# asks ``Store`` (``steps``, ``outcome_log``, ``consumption``, ``floor``, ``lineage``,
# ``commit_record``, ``reads_in_place``, ``storage_options``, ...). docs/architecture.md lists
# the same. ``writes.py`` is not here: ``Store.writer`` hands it the log, it never goes
# through a store. The list can only shrink: an exception that no longer reaches in fails too.
_FACADE_EXCEPTIONS = {
    "store": "the Store itself: it owns the log and the storage",
    "maintenance.gc": "upkeep through the log: the floor it publishes, the lease survey, the "
    "listing, ages and deletions of files by the storage's clock",
    "maintenance.references": "what gc keeps: every checkpoint, chunk and outcome file above "
    "the floor, read from the log",
    "maintenance.retention": "ages of versions: record times from the log, now by the "
    "storage's clock",
    "maintenance.verify": "checks the log's files themselves: outcome files, schemas, chunks",
    "maintenance.compact": "writes the compacted shard through the storage before committing",
    "loading.ranged": "the byte-range reader: row-group ranges of shard files in one call, "
    "and whether a shard that failed is missing",
    "ray": "hands Ray Data (Arrow) the storage's filesystem, shard paths and sizes, and asks "
    "whether Ray's workers can reach the store",
}


def _reaches_into_a_store(node: ast.AST) -> bool:
    """``x.log`` / ``x.storage`` where ``x`` is named as a store: ``store``, ``self.store``,
    ``self._store``, ``dataset.store``, ``store_or_url``, ``new_store``. A store under
    another name escapes this check; the names the code uses are these."""
    if not isinstance(node, ast.Attribute) or node.attr not in ("log", "storage"):
        return False
    owner = node.value
    name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
    name = name.lstrip("_")
    return name == "store" or name.startswith("store_") or name.endswith("_store")


def _facade_leaks(modules: dict[str, Path]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for module, path in modules.items():
        nodes = [
            n for n in ast.walk(ast.parse(path.read_text(), str(path))) if _reaches_into_a_store(n)
        ]
        for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
            where = f"dynstate/{module.replace('.', '/') or '__init__'}.py:{node.lineno}"
            found.setdefault(module, []).append(f"{where} {ast.unparse(node)}")
    return found


def test_only_the_named_exceptions_reach_into_a_store() -> None:
    """Issue 41.3/41.5: ``store.log`` and ``store.storage`` only from the named exceptions."""
    leaks = _facade_leaks(_modules())
    outside = [
        w for module, where in leaks.items() if module not in _FACADE_EXCEPTIONS for w in where
    ]
    assert not outside, "ask Store (add a property) instead of its log or storage:\n" + "\n".join(
        outside
    )
    stale = sorted(set(_FACADE_EXCEPTIONS) - set(leaks))
    assert not stale, f"no longer reach into a store; take them off _FACADE_EXCEPTIONS: {stale}"


def test_the_map_names_the_facade_exceptions() -> None:
    """docs/architecture.md's facade section lists exactly the exceptions above."""
    text = MAP.read_text()
    assert "\n## The facade\n" in text, "docs/architecture.md has no '## The facade' section"
    section = text.split("\n## The facade\n", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^- `([\w/]+)\.py`", section, re.M))
    listed = {m.replace(".", "/") for m in _FACADE_EXCEPTIONS}
    assert named == listed, (
        f"docs/architecture.md's facade section names {sorted(named - listed)} beyond the "
        f"test's exceptions and misses {sorted(listed - named)}"
    )


def test_the_facade_check_finds_a_leak(tmp_path: Path) -> None:
    planted = tmp_path / "view.py"
    planted.write_text(
        "def f(store, self):\n"
        "    store.log.head\n"
        "    self.dataset.store.storage.exists('x')\n"
        "    self._store.log\n"
        "    self.log\n"  # an object's own log: not a store's
        "    commits.storage\n"
    )
    leaks = _facade_leaks({"loading.view": planted})
    assert [w.split(" ", 1)[1] for w in leaks["loading.view"]] == [
        "store.log",
        "self.dataset.store.storage",
        "self._store.log",
    ]


def test_the_web_view_never_imports_the_cli() -> None:
    """`serve` and `cli` do not import each other (issue 41.3): the `serve` command lives in
    `cli/commands_serve.py` and imports the web view when it runs; what both show of a value
    is `text.py`'s. (`serve/__main__.py`, an entry point nothing imports, is not checked.)"""
    modules = _modules()
    found = []
    for module, path in modules.items():
        if module != "serve" and not module.startswith("serve."):
            continue
        for target, _, line in _imports(module, path):
            resolved = _resolve(target, modules)
            if resolved == "cli" or resolved.startswith("cli."):
                found.append(f"dynstate.{module} line {line} imports dynstate.{resolved}")
    assert found == []
