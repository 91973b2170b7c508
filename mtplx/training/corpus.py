"""The training corpus: the running interpreter's own standard library, which every machine that runs MTPLX
has, so the default model can be rebuilt anywhere. Named modules are held out for evaluation and `jobs/data/`.
"""

from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

# Modules present in every CPython 3.10-3.13, kept out of training. They are
# plain, well documented Python: good prompts (signature + docstring -> body).
HELD_OUT_MODULES: Tuple[str, ...] = (
    "bisect",
    "calendar",
    "colorsys",
    "difflib",
    "fnmatch",
    "fractions",
    "glob",
    "graphlib",
    "heapq",
    "shlex",
    "statistics",
    "textwrap",
)

# Tests, vendored tools, generated tables or data rather than library code (encodings/: charmap tables).
_SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "ensurepip",
    "encodings",
    "pydoc_data",
    "__pycache__",
    "__phello__",
}
_SKIP_FILES = ("_sysconfigdata",)
_MAX_FILE_BYTES = 400_000


@dataclass(frozen=True)
class SourceFile:
    module: str  # dotted name relative to the stdlib root, e.g. "json.decoder"
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def stdlib_sources(root: Optional[Path] = None) -> List[SourceFile]:
    """All library .py files under `root`, sorted by path (deterministic)."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in _SKIP_DIRS or p.startswith("config-") for p in rel.parts[:-1]):
            continue
        if rel.name.startswith(_SKIP_FILES) or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(SourceFile(module_name(rel), text))
    return files


def is_held_out(module: str, held_out=HELD_OUT_MODULES) -> bool:
    return module.split(".")[0] in held_out


def split_corpus(files: List[SourceFile], held_out=HELD_OUT_MODULES):
    """-> (train files, held-out files); the held-out list must all be present."""
    train = [f for f in files if not is_held_out(f.module, held_out)]
    test = [f for f in files if is_held_out(f.module, held_out)]
    missing = sorted(set(held_out) - {f.module.split(".")[0] for f in test})
    if missing:
        raise FileNotFoundError(f"held-out stdlib modules not found: {', '.join(missing)}")
    return train, test


@dataclass(frozen=True)
class FunctionExample:
    id: str  # "module.Class.function"
    module: str
    name: str
    signature: str  # the def line(s), dedented
    summary: str  # the docstring's first line
    prompt: str  # decorators + signature + docstring, dedented, ending in "\n"
    reference: str  # the body after the docstring, dedented the same way


def function_examples(module: str, text: str) -> List[FunctionExample]:
    """Every function or method of a module with a docstring and a body after it, in source order."""
    lines = text.splitlines(keepends=True)
    found: List[FunctionExample] = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, scope + [child.name])
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                example = _example(module, scope + [child.name], child, lines)
                if example is not None:
                    found.append(example)
                visit(child, scope + [child.name])

    visit(ast.parse(text), [])
    return found


def _example(module, qualname, node, lines) -> Optional[FunctionExample]:
    body = node.body
    if len(body) < 2 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Constant):
        return None
    doc = body[0].value.value
    if not isinstance(doc, str):
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    first = lines[start - 1]
    indent = first[: len(first) - len(first.lstrip())]

    def dedent(chunk):
        return "".join(l[len(indent) :] if l.startswith(indent) else l.lstrip(" \t") for l in chunk)

    prompt = dedent(lines[start - 1 : body[0].end_lineno])
    reference = dedent(lines[body[0].end_lineno : node.end_lineno])
    signature = dedent(lines[node.lineno - 1 : body[0].lineno - 1])
    if not reference.strip():
        return None
    summary = doc.strip().splitlines()[0].strip() if doc.strip() else ""
    return FunctionExample(".".join([module] + qualname), module, qualname[-1], signature, summary, prompt, reference)


def held_out_examples(
    files: List[SourceFile], max_prompt_chars: int = 1200, max_body_lines: int = 40
) -> List[FunctionExample]:
    """Prompt/reference pairs from the held-out files, sorted by id."""
    out = []
    for f in files:
        for ex in function_examples(f.module, f.text):
            if len(ex.prompt) <= max_prompt_chars and 2 <= ex.reference.count("\n") <= max_body_lines:
                out.append(ex)
    return sorted(out, key=lambda e: e.id)
