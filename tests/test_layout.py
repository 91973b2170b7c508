"""The package layout's import rules: imports run one way,
pipeline -> mtplx's public API -> runtime/autodepth -> decode -> models -> backends,
with no cycle, and only `mtplx.backends` reaches the CPU backend's forms.
`mtplx.install_check`, which imports nothing of the project, may be imported
from anywhere. Imports inside functions count as edges."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]

# concern -> the concerns it may import (its own included)
ALLOWED = {
    "backends": {"backends"},
    "models": {"models", "backends"},
    "decode": {"decode", "models", "backends"},
    "autodepth": {"autodepth", "decode", "models", "backends"},
    "api": {"api", "autodepth", "decode", "models", "backends"},
    "testing": {"testing", "models"},
    "bench": {"bench", "api", "autodepth", "decode", "models", "backends"},
    "training": {"training", "bench", "api", "autodepth", "decode", "models", "testing"},
    "pipeline": {"pipeline", "api"},
    "assets": set(),
    "install": set(),
}
# The commands' entry points, which the pipeline's CLI may import beside the public API.
ENTRY_POINTS = {
    "mtplx.bench.run",
    "mtplx.bench.report",
    "mtplx.models.convert",
    "mtplx.models.info",
    "mtplx.training.tiny",
}
API = {"mtplx", "mtplx.runtime", "mtplx.sampling"}


def concern(module: str) -> str:
    if module.startswith("pipeline"):
        return "pipeline"
    if module == "mtplx.assets":  # package data: the built-in model's path
        return "assets"
    if module == "mtplx.install_check":  # which MLX backend is installed, read before anything imports MLX
        return "install"
    if module in API:
        return "api"
    if module == "mtplx.testing":
        return "testing"
    return module.split(".")[1]


def modules(root: Path = ROOT) -> Dict[str, Path]:
    out = {}
    for top in ("mtplx", "pipeline"):
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The project modules `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from pkg import module` imports the module
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_graph(root: Path = ROOT) -> Dict[str, Set[str]]:
    mods = modules(root)
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def forbidden_edges(graph: Dict[str, Iterable[str]]) -> List[Tuple[str, str]]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            if dst.startswith("mtplx.backends.cpu") and not src.startswith("mtplx.backends"):
                bad.append((src, dst))
            elif concern(src) == "pipeline" and dst in ENTRY_POINTS:
                continue
            elif concern(dst) not in ALLOWED[concern(src)] | {"assets", "install"}:
                bad.append((src, dst))
    return sorted(bad)


def cycles(graph: Dict[str, Iterable[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_import_runs_one_way_from_pipeline_to_backends():
    graph = import_graph()
    assert {"mtplx.decode.runtime", "mtplx.models.loader", "mtplx.backends", "pipeline.cli"} <= set(graph)
    assert forbidden_edges(graph) == []


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_checks_catch_a_wrong_direction_a_cpu_form_outside_backends_and_a_cycle():
    graph = import_graph()
    graph["mtplx.decode.runtime"] = set(graph["mtplx.decode.runtime"]) | {"mtplx.autodepth.policy"}
    graph["mtplx.models.loader"] = set(graph["mtplx.models.loader"]) | {"mtplx.backends.cpu.experts"}
    graph["pipeline.engine"] = set(graph["pipeline.engine"]) | {"mtplx.decode.cache"}
    assert forbidden_edges(graph) == [
        ("mtplx.decode.runtime", "mtplx.autodepth.policy"),
        ("mtplx.models.loader", "mtplx.backends.cpu.experts"),
        ("pipeline.engine", "mtplx.decode.cache"),
    ]
    graph["mtplx.decode.cache"] = set(graph["mtplx.decode.cache"]) | {"mtplx.decode.runtime"}
    assert any({"mtplx.decode.cache", "mtplx.decode.runtime"} <= set(c) for c in cycles(graph))


def test_a_function_level_import_counts_as_an_edge(tmp_path):
    (tmp_path / "mtplx" / "decode").mkdir(parents=True)
    (tmp_path / "mtplx" / "autodepth").mkdir()
    (tmp_path / "pipeline").mkdir()
    for d in ("mtplx", "mtplx/decode", "mtplx/autodepth", "pipeline"):
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "mtplx" / "autodepth" / "policy.py").write_text("")
    (tmp_path / "mtplx" / "decode" / "runtime.py").write_text("def f():\n    from ..autodepth import policy\n")
    graph = import_graph(tmp_path)
    assert graph["mtplx.decode.runtime"] == {"mtplx.autodepth.policy"}
    assert forbidden_edges(graph) == [("mtplx.decode.runtime", "mtplx.autodepth.policy")]
