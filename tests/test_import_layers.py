"""The import graph of megashard: storage has no import cycle, lower layers never import higher ones.

Every import counts, also those inside functions (imported late): a cycle through a late import is
still a cycle, it only fails later and depending on which module is imported first.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

PKG = Path(__file__).resolve().parents[1] / "megashard"


def _modules() -> Dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> Set[str]:
    """The megashard modules ``name`` imports (a package's name means its ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import sub" imports the submodule sub; "from mod import name" imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle(nodes: Set[str]) -> List[str]:
    """One import cycle among ``nodes`` (edges inside ``nodes`` only), or []."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(n: str) -> List[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(GRAPH[n] & nodes):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(nodes):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def _under(prefixes: List[str]) -> Set[str]:
    return {m for m in MODULES if any(m == p or m.startswith(p + ".") for p in prefixes)}


def test_the_graph_sees_the_imports_it_must() -> None:
    """The walker itself: it finds a plain, a relative and a late (in-function) import."""
    assert "megashard.storage.posix" in GRAPH["megashard.storage"]  # from . import posix
    assert "megashard.storage.base" in GRAPH["megashard.storage.s3.checkpoint"]  # from ..base import
    assert "megashard.manifest" in GRAPH["megashard.storage.posix"]  # imported late, inside functions
    assert "megashard.storage" in GRAPH["megashard.loading"]


def test_megashard_has_no_import_cycle() -> None:
    """No module of megashard imports itself through others: before storage became a package,
    index -> storage -> objstore.checkpoint -> storage was such a cycle (through late imports)."""
    assert _cycle(set(MODULES)) == []


@pytest.mark.parametrize("low", ["megashard.format", "megashard.manifest", "megashard.index", "megashard.plan",
                                 "megashard.saveroot"])
def test_lower_layers_never_import_storage_saving_or_loading(low: str) -> None:
    high = _under(["megashard.storage", "megashard.saving", "megashard.loading"])
    bad = {m: sorted(GRAPH[m] & high) for m in _under([low]) if GRAPH[m] & high}
    assert bad == {}


def test_storage_modules_import_alone_without_torch() -> None:
    """Each storage module imports first in a fresh interpreter (a cycle broken only by import order
    fails here), and storage stays free of torch (``megashard inspect``/``recover`` start fast)."""
    names = sorted(_under(["megashard.storage", "megashard.saveroot"]))
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    for m in [m for m in sys.modules if m == 'megashard' or m.startswith('megashard.')]:\n"
            "        del sys.modules[m]\n"
            "    importlib.import_module(name)\n"
            "    assert 'torch' not in sys.modules, name + ' imported torch'\n"
            "print('ok', len(sys.argv) - 1)\n")
    env = dict(os.environ, PYTHONPATH=str(PKG.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", str(len(names))]


#: Modules outside megashard.storage that may import a store's module directly, with the reason.
#: Empty: saving, loading, readers, scatter, copy, convert, ... go through megashard.storage, so a new
#: store (GCS, Azure Blob, a local tier) is one module behind the same interface.
STORE_MODULE_IMPORTS_ALLOWED: Dict[str, str] = {}


def test_only_storage_names_a_store() -> None:
    """No module outside megashard.storage imports megashard.storage.posix or megashard.storage.s3
    (late imports count): what one store does beyond the interface would leak into the layers above."""
    stores = _under(["megashard.storage.posix", "megashard.storage.s3"])
    assert stores, "the walker lost the stores' modules"
    outside = set(MODULES) - _under(["megashard.storage"])
    bad = {m: sorted(GRAPH[m] & stores) for m in sorted(outside)
           if GRAPH[m] & stores and m not in STORE_MODULE_IMPORTS_ALLOWED}
    assert bad == {}


def test_the_store_check_sees_a_late_store_import(tmp_path) -> None:
    """The check above catches the shape the leaks had (``from .storage.s3.client import X`` inside a function)."""
    p = tmp_path / "leaky.py"
    p.write_text("def f():\n    from .storage.s3.client import ObjectStore\n    from .storage import posix\n")
    found = _imports("megashard.leaky", p)
    assert {"megashard.storage.s3.client", "megashard.storage.posix"} <= found
