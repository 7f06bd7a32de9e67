"""bench/ as a suite: ``python -m bench --list`` names what runs, every listed module imports, no import cycles.

Cheap by design: nothing is measured; the modules are imported and parsed, and ``--list`` runs in this process.
"""

from __future__ import annotations

import ast
import importlib
import os

from bench import __main__ as bench_main
from bench import _catalogue

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def _modules() -> dict[str, str]:
    """Every module under bench/ by dotted name, with its path."""
    found = {}
    for folder, _, files in os.walk(BENCH):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """The bench modules ``module`` imports, at its top or inside a function (a cycle either way)."""
    out = set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # ``from package import module`` needs that module (the package's __init__ is already under way)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out |= {name for name in names if name in known and name != module}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle in ``graph`` as the modules along it, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_list_names_every_section_make_bench_runs_with_what_it_measures_and_how_long(capsys):
    assert bench_main.main(["--list"]) == 0
    text = capsys.readouterr().out
    assert bench_main.SECTIONS == tuple(b.name for b in _catalogue.BENCHMARKS)
    for bench in _catalogue.BENCHMARKS:
        assert f"{bench.name:<13} python -m {bench.module}" in text
        assert bench.measures in text and f"full: {bench.full}" in text and f"--quick: {bench.quick}" in text
    for module, what in _catalogue.experiments():
        assert what, f"{module} has no docstring saying what it measures"
        assert f"  {module}\n" in text and what in text
    # Everything under bench/experiments/ that runs is listed, and rule_eval beside it.
    listed = {module for module, _ in _catalogue.experiments()}
    assert "bench.rule_eval" in listed
    on_disk = {f"bench.experiments.{n[:-3]}" for n in os.listdir(_catalogue.EXPERIMENTS)
               if n.endswith(".py") and not n.startswith("_")}
    assert on_disk and on_disk <= listed


def test_every_listed_benchmark_imports_and_bench_holds_no_unlisted_entry_point():
    listed = {b.module for b in (*_catalogue.BENCHMARKS, _catalogue.GPU)}
    listed |= {part for b in _catalogue.BENCHMARKS for part in b.parts}
    listed |= {module for module, _ in _catalogue.experiments()}
    for module in sorted(listed):
        importlib.import_module(module)
    # A module of bench/ itself that can run (``python -m``) is a section, part of one, or listed as hand-run:
    # a new experiment goes under bench/experiments/, where --list finds it.
    for name in os.listdir(BENCH):
        if name.endswith(".py") and not name.startswith("_"):
            source = open(os.path.join(BENCH, name)).read()
            if 'if __name__ == "__main__"' in source:
                assert f"bench.{name[:-3]}" in listed, f"bench/{name} runs but python -m bench --list does not name it"


def test_bench_has_no_import_cycles():
    modules = _modules()
    graph = {module: _imports(module, path, set(modules)) for module, path in modules.items()}
    assert graph["bench.overhead"] >= {"bench._loops", "bench.ddp_origin"}  # the parser sees both kinds of import
    assert _cycle(graph) == []
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # and the search finds one
