"""`mtplx inspect-model`: what a checkpoint holds, trunk and MTP head, from the modules MTPLX would run
(built lazily: only headers are read). A head that fails to load is reported, not raised."""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtplx.models.adapter import CheckpointError


def quantized_modules(module: nn.Module) -> Dict[str, nn.Module]:
    """{path: module} of the quantised layers (QuantizedLinear/Embedding/SwitchLinear)."""
    return {p: m for p, m in module.named_modules() if hasattr(m, "bits") and hasattr(m, "group_size")}


def quantization_groups(module: nn.Module) -> List[dict]:
    """One entry per distinct (mode, bits, group_size) among the quantised layers."""
    counts: Dict[tuple, int] = {}
    for m in quantized_modules(module).values():
        key = (getattr(m, "mode", "affine"), int(m.bits), int(m.group_size))
        counts[key] = counts.get(key, 0) + 1
    return [{"mode": k[0], "bits": k[1], "group_size": k[2], "modules": n} for k, n in sorted(counts.items())]


def parameter_count(module: nn.Module) -> int:
    """Logical parameters: a quantised weight counts as the float weight it stands for."""
    quantized = quantized_modules(module)
    total = 0
    for name, v in tree_flatten(module.parameters()):
        owner, _, leaf = name.rpartition(".")
        q = quantized.get(owner)
        if q is None:
            total += v.size
        elif leaf == "weight":
            total += v.size * 32 // q.bits
        elif leaf not in ("scales", "biases"):
            total += v.size  # e.g. a bias
    return total


def module_stats(module: nn.Module) -> dict:
    """Counts, bytes, float dtypes and quantisation of a module (shapes and dtypes only: lazy-safe)."""
    params = tree_flatten(module.parameters())
    floats = sorted({str(v.dtype).replace("mlx.core.", "") for _, v in params if mx.issubdtype(v.dtype, mx.floating)})
    float_layers = sum(1 for _, m in module.named_modules() if hasattr(m, "to_quantized") and not hasattr(m, "bits"))
    return {
        "parameters": parameter_count(module),
        "tensors": len(params),
        "bytes": sum(v.nbytes for _, v in params),
        "dtypes": floats,
        "quantization": quantization_groups(module),
        "float_layers": float_layers,  # quantisable layers left in float
    }


def describe_model(path) -> dict:
    """Family, trunk and head statistics, head depth and completeness."""
    from mtplx.models.loader import _load_head, _load_trunk, open_checkpoint

    path, config, family, files, shapes = open_checkpoint(path)
    trunk = _load_trunk(path, family, config)
    declared = family.num_mtp_layers(config)
    head, info, problem = None, {"source": None}, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            head, info = _load_head(path, config, family, trunk, files, shapes)
        except CheckpointError as e:
            problem = str(e)
    if head is None and problem is None:
        problem = "; ".join(str(w.message) for w in caught) or "the checkpoint holds no MTP tensors"
    head_layers = 0 if head is None else len(head.layers)
    if head is not None and head_layers != declared:
        problem = f"config.json declares {declared} MTP layer(s), the head has {head_layers}"
    return {
        "path": str(path),
        "model_type": config.get("model_type"),
        "family": family.name,
        "trunk": dict(module_stats(trunk), layers=len(family.text_model(trunk).layers)),
        "head": None if head is None else dict(module_stats(head), layers=head_layers),
        "head_source": info.get("source"),
        "head_declared_layers": declared,
        "head_depth": head_layers,
        "head_complete": head is not None and problem is None,
        "head_problem": problem,
        "head_reads_hidden": "after the final norm" if family.hidden_after_norm else "before the final norm",
        "converted_from": (config.get("mtplx") or {}).get("converted_from"),
    }


def _format_quantization(groups: List[dict], float_layers: int) -> str:
    if not groups:
        return "none"
    parts = [f"{g['mode']} {g['bits']}-bit, group {g['group_size']} ({g['modules']} layers)" for g in groups]
    return "; ".join(parts) + (f"; {float_layers} layers kept float" if float_layers else "")


def _format_part(name: str, stats: Optional[dict]) -> List[str]:
    if stats is None:
        return [f"{name}: none"]
    return [
        f"{name}: {stats['parameters']:,} parameters, {stats['layers']} layer(s), "
        f"{stats['tensors']} tensors, {stats['bytes'] / 2**20:.2f} MiB",
        f"  dtype: {', '.join(stats['dtypes']) or '-'}",
        f"  quantization: {_format_quantization(stats['quantization'], stats['float_layers'])}",
    ]


def format_model_description(d: dict) -> str:
    lines = [f"model: {d['path']}", f"family: {d['family']} (model_type {d['model_type']})"]
    if d.get("converted_from"):
        lines.append(f"converted from: {d['converted_from']}")
    lines += _format_part("trunk", d["trunk"])
    lines += _format_part("head", d["head"])
    lines.append(f"head depth: {d['head_depth']} MTP layer(s) (config declares {d['head_declared_layers']})")
    lines.append(f"head source: {d['head_source'] or '-'}")
    lines.append(f"head reads the trunk hidden state {d['head_reads_hidden']}")
    lines.append(f"head complete: {d['head_complete']}")
    if d["head_problem"]:
        lines.append(f"head problem: {d['head_problem']}")
    return "\n".join(lines)
