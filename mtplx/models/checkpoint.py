"""Reading safetensors checkpoints: shard discovery, headers, MTP tensors."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable, Dict, List

import mlx.core as mx

from mtplx.models.adapter import CheckpointError

SIDECAR = "mtp.safetensors"


def shard_files(path: Path) -> List[Path]:
    """The trunk shards: from model.safetensors.index.json, else a scan."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} names a missing shard: {f.name}")
        return files
    return sorted(path.glob("model*.safetensors"))


def read_header(file: Path) -> Dict[str, dict]:
    """The safetensors header ({name: {dtype, shape, data_offsets}}), checked against the file size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 0 or 8 + n > size:
                raise ValueError("header length past end of file")
            header = _tensor_entries(json.loads(f.read(n)))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"corrupt safetensors file {file}: {e}") from None
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"truncated safetensors file {file}: {size} bytes, header needs {8 + n + end}")
    return header


def _tensor_entries(header) -> Dict[str, dict]:
    """The header's tensor entries, checked so JSON of the wrong shape raises ValueError (a corrupt file)."""
    if not isinstance(header, dict):
        raise ValueError(f"header is a JSON {type(header).__name__}, not an object")
    header = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, t in header.items():
        if not isinstance(t, dict):
            raise ValueError(f"tensor {name!r}: entry is not an object")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in t:
                raise ValueError(f"tensor {name!r}: no {field!r}")
        if not _non_negative_ints(t["shape"]):
            raise ValueError(f"tensor {name!r}: shape {t['shape']!r} is not a list of sizes")
        offsets = t["data_offsets"]
        if not (_non_negative_ints(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    return header


def _non_negative_ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def shard_shapes(files: List[Path]) -> Dict[str, tuple]:
    shapes = {}
    for f in files:
        for name, t in read_header(f).items():
            shapes[name] = tuple(t["shape"])
    return shapes


def load_tensors(files: List[Path], want: Callable[[str], bool]) -> Dict[str, mx.array]:
    """Load only the tensors whose names pass `want`, from the shards holding them."""
    out = {}
    for f in files:
        names = [k for k in read_header(f) if want(k)]
        if not names:
            continue
        try:
            arrays = mx.load(str(f))
        except Exception as e:  # mlx raises plain RuntimeError/ValueError
            raise CheckpointError(f"cannot read {f}: {e}") from None
        out.update({k: arrays[k] for k in names})
    return out


def read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not path.exists():
        raise CheckpointError(f"model path does not exist: {path}")
    if not cfg.exists():
        raise CheckpointError(f"no config.json in {path}")
    try:
        return json.loads(cfg.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg}: invalid JSON ({e})") from None


def write_shards(path: Path, tensors: Dict[str, mx.array], num_shards: int) -> None:
    names = sorted(tensors)
    num_shards = max(1, min(num_shards, len(names)))
    per = (len(names) + num_shards - 1) // num_shards
    weight_map = {}
    total = 0
    for i in range(num_shards):
        part = names[i * per : (i + 1) * per]
        if not part:
            continue
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), {k: tensors[k] for k in part}, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
        total += sum(tensors[k].nbytes for k in part)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
