"""`make bench-scale`'s model: the built-in model widened to a named real size
(`mtplx.testing.SHAPES`), written once into a cache folder and reused while the
source and the shape are the same.

    python -m mtplx.bench.scale qwen3.5-0.8b --cache .cache   # prints the checkpoint's path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

from mtplx.assets import default_model_path
from mtplx.models.widen import SHAPES, widen

STAMP = "widened.json"  # what the cached checkpoint was widened from, and to


def widened_checkpoint(shape: str, cache, source=None) -> Path:
    """The checkpoint of `source` (default: the built-in model) widened to SHAPES[shape] under `cache`:
    written on first use (into a temporary folder, renamed when complete), reused after."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    source = Path(source) if source is not None else default_model_path()
    # The source by its files, not its path, so that a checkout moved elsewhere keeps its cache.
    stamp = {"shape": shape, "arguments": SHAPES[shape], "source": _fingerprint(source)}
    dst = Path(cache) / f"widened-{shape}"
    if (dst / STAMP).is_file() and json.loads((dst / STAMP).read_text()) == stamp:
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    widen(source, tmp, **SHAPES[shape])
    (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def _fingerprint(source: Path) -> str:
    """The source's files by name, size and the config's bytes: a retrained or replaced model is widened anew."""
    h = hashlib.sha256()
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    h.update((source / "config.json").read_bytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtplx.bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES), help="the named shape to widen the built-in model to")
    p.add_argument("--cache", default=".cache", help="folder of the widened checkpoints [default: .cache]")
    args = p.parse_args(argv)
    print(widened_checkpoint(args.shape, args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
