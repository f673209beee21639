"""The package layout's rules, read from the source with ``ast`` (nothing is
imported): a dialect never reaches into an engine, an engine never knows
which dialect or route asked, the cache never touches llama.cpp (and its
planner neither the residency nor the saved tiers), the task manager
never depends on the HTTP routes, and the llama engine's scheduler and
generations never reach back into the engine that made them.

Every import counts: module level, inside functions, under
``TYPE_CHECKING``, relative ones resolved. A rule is broken by a direct
import and by one through other lmspd modules (``cache`` importing a module
that imports ``llama_cpp`` breaks "cache never imports llama_cpp").
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

import lmspd

PACKAGE_ROOT = Path(lmspd.__file__).resolve().parent

# (importer prefix, forbidden prefix, why)
RULES = [
    ("lmspd.dialects", "lmspd.engines", "a dialect speaks only the neutral Conversation and events"),
    ("lmspd.engines", "lmspd.dialects", "an engine never knows which dialect asked"),
    ("lmspd.engines", "lmspd.routes", "an engine never knows which route asked"),
    ("lmspd.engines", "lmspd.http", "an engine never knows which route asked"),
    ("lmspd.engines", "lmspd.store", "an engine never reads or writes durable state"),
    ("lmspd.cache", "llama_cpp", "the cache keeps KV bytes; only the llama engine talks to llama.cpp"),
    ("lmspd.cache.planner", "lmspd.cache.residency", "the planner decides on plain data; the residency carries it out"),
    ("lmspd.cache.planner", "lmspd.cache.tiers", "the planner decides on plain data; the tiers keep the states"),
    ("lmspd.cache.planner", "lmspd.cache.disk", "the planner reads the disk tier through what it is handed"),
    ("lmspd.tasks", "lmspd.routes", "tasks/ keeps the manager and recovery; HTTP handlers live in routes/"),
    ("lmspd.engines.llama.scheduler", "lmspd.engines.llama.engine",
     "the scheduler runs on the LlamaRuntime the engine hands it, never on the engine"),
    ("lmspd.engines.llama.generation", "lmspd.engines.llama.engine",
     "a generation runs on the LlamaRuntime the engine hands it, never on the engine"),
]


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path, path: Path) -> set[str]:
    """Every module ``path`` imports, absolute, as written or resolved."""
    name = module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            # ``from lmspd.engines import llama`` imports the submodule too.
            found.update(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    return {module_name(root, p): imports_of(root, p) for p in sorted(root.rglob("*.py"))}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(graph: dict[str, set[str]], importer: str, forbidden: str) -> list[str]:
    """``importer_module -> ... -> forbidden_module`` for each module under
    ``importer`` that reaches ``forbidden``, directly or through other
    modules of the package (the shortest chain)."""
    out = []
    for start in sorted(m for m in graph if within(m, importer)):
        seen = {start}
        frontier: list[list[str]] = [[start]]
        while frontier:
            chain = frontier.pop(0)
            hit = next((i for i in sorted(graph.get(chain[-1], ())) if within(i, forbidden)), None)
            if hit is not None:
                out.append(" -> ".join(chain + [hit]))
                break
            for nxt in sorted(graph.get(chain[-1], ())):
                if nxt in graph and nxt not in seen:
                    seen.add(nxt)
                    frontier.append(chain + [nxt])
    return out


GRAPH = import_graph(PACKAGE_ROOT)


def rule_params() -> Iterable:
    for importer, forbidden, why in RULES:
        yield pytest.param(importer, forbidden, why, id=f"{importer}-not-{forbidden}")


@pytest.mark.parametrize("importer,forbidden,why", list(rule_params()))
def test_package_boundary(importer: str, forbidden: str, why: str) -> None:
    assert any(within(m, importer) for m in GRAPH), f"no modules under {importer}: the rule checks nothing"
    broken = violations(GRAPH, importer, forbidden)
    assert not broken, f"{importer} must not import {forbidden} ({why}):\n" + "\n".join(broken)


def test_the_checker_finds_a_direct_a_relative_a_lazy_and_an_indirect_import(tmp_path: Path) -> None:
    """The rules above are only as good as the parser: a small package with
    each kind of forbidden import must be caught."""
    root = tmp_path / "lmspd"
    files = {
        "__init__.py": "",
        "dialects/__init__.py": "",
        "dialects/direct.py": "from lmspd.engines.llama import engine\n",
        "dialects/relative.py": "from ..engines import base\n",
        "dialects/lazy.py": "def f():\n    import lmspd.engines.upstream\n",
        "dialects/indirect.py": "from lmspd.core import helper\n",
        "dialects/clean.py": "from lmspd.core import other\n",
        "core/__init__.py": "",
        "core/helper.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmspd.engines import base\n",
        "core/other.py": "import json\n",
        "engines/__init__.py": "",
        "engines/base.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    broken = violations(import_graph(root), "lmspd.dialects", "lmspd.engines")
    assert broken == [
        "lmspd.dialects.direct -> lmspd.engines.llama",
        "lmspd.dialects.indirect -> lmspd.core.helper -> lmspd.engines",
        "lmspd.dialects.lazy -> lmspd.engines.upstream",
        "lmspd.dialects.relative -> lmspd.engines",
    ]
