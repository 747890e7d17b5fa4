"""The public API is an allow-list: ``dynstate.__all__`` is exactly what docs/api.md lists,
sorted, every name resolves, and nothing private leaks into it."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import dynstate

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def documented() -> list[str]:
    """The names in the first column of docs/api.md's tables."""
    return re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", API_DOC.read_text(), re.M)


def test_all_is_what_the_docs_list() -> None:
    names = documented()
    assert len(names) == len(set(names)), "a name is listed twice in docs/api.md"
    assert set(dynstate.__all__) == set(names)


def test_all_is_sorted_and_resolves() -> None:
    assert dynstate.__all__ == sorted(dynstate.__all__)
    for name in dynstate.__all__:
        assert getattr(dynstate, name) is not None, name


def test_no_internals_in_all() -> None:
    assert not [n for n in dynstate.__all__ if n.startswith("_") and n != "__version__"]
    for internal in ("Log", "Storage", "Leases", "manifest", "open_storage", "walk_lineage"):
        assert internal not in dynstate.__all__


def test_maintenance_functions_are_the_functions_whatever_was_imported_first() -> None:
    # The import system binds each submodule on its package as it loads it; the modules behind
    # `compact` and `export` have other names, so the functions are never shadowed.
    code = (
        "import dynstate.maintenance.compact, dynstate.maintenance.export\n"
        "import dynstate.maintenance.gc, dynstate.maintenance.verify\n"
        "import dynstate\n"
        "assert callable(dynstate.compact) and callable(dynstate.export), "
        "(dynstate.compact, dynstate.export)\n"
        "assert dynstate.compact.__module__ == 'dynstate.maintenance.compact'\n"
        "assert dynstate.export.__module__ == 'dynstate.maintenance.export'\n"
        "assert dynstate.collect_garbage.__module__ == 'dynstate.maintenance.gc'\n"
        "assert dynstate.verify_store.__module__ == 'dynstate.maintenance.verify'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    store = dynstate.Store.open("memory://public-api/maintenance", create=True)
    for step in range(3):
        store.append([{"step": step}])
    assert dynstate.compact(store) == 4
    assert dynstate.verify_store(store).ok
    assert dynstate.collect_garbage(store, keep=1, grace_s=0, dry_run=False).floor_after == 4


def test_modules_behind_compact_and_export_import_as_modules() -> None:
    # A fresh interpreter: `import ... as` must give the module, and the package attribute of the
    # same public name the function, in either import order.
    code = (
        "import types\n"
        "import dynstate.maintenance.compact as m\n"
        "import dynstate.maintenance.export as e\n"
        "import dynstate\n"
        "assert isinstance(m, types.ModuleType), m\n"
        "assert m.__name__ == 'dynstate.maintenance.compact', m\n"
        "assert isinstance(e, types.ModuleType), e\n"
        "assert e.__name__ == 'dynstate.maintenance.export', e\n"
        "assert dynstate.maintenance.compact is m and dynstate.maintenance.export is e\n"
        "assert dynstate.compact is m.compact and dynstate.export is e.export\n"
        "assert not isinstance(dynstate.compact, types.ModuleType)\n"
        "assert not isinstance(dynstate.export, types.ModuleType)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    import dynstate.maintenance.compact as m

    assert isinstance(m, types.ModuleType)
    assert dynstate.compact is m.compact
    assert callable(dynstate.compact) and not isinstance(dynstate.compact, types.ModuleType)
