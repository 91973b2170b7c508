"""`mtplx convert`: a checkpoint to MLX layout, keeping its MTP head.

The trunk goes through mlx-lm's conversion pieces (exactly what `mlx_lm.convert` writes); the head, which
mlx-lm drops, through `mtplx.load`, into an `mtp.safetensors` sidecar in MLX layout. All is written into a
staging directory, verified with `mtplx.load`, then moved to DST: a failure leaves no half-written model.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
import warnings
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from mtplx.models.adapter import CheckpointError, FamilyAdapter
from mtplx.models.checkpoint import SIDECAR, read_config
from mtplx.models.families import family_for
from mtplx.models.info import module_stats, quantization_groups, quantized_modules

DTYPES = ("float16", "bfloat16", "float32")
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# Non-weight files a model directory needs (mlx-lm's download allow-list, less weights and config).
_SIDE_FILES = ("*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
_NOT_COPIED = ("config.json", "*.safetensors.index.json")
STEPS = ("load trunk", "cast", "quantize trunk", "save trunk", "load head", "save head", "tokenizer", "verify")


def convert(
    src,
    dst,
    *,
    q_bits: Optional[int] = None,
    q_group_size: int = 64,
    quantize_head: bool = True,
    dtype: Optional[str] = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Convert SRC (HF or MLX layout) into DST; returns a report. q_bits: affine bits (None: float);
    dtype: of the float weights (None: the config's, as mlx_lm.convert)."""
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    config = read_config(src)  # names a missing SRC or config.json
    family = family_for(config)  # an unknown model_type lists the supported ones
    _check_options(q_bits, q_group_size, dtype)
    _check_destination(src, dst, overwrite)
    staging = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with _progress(progress) as step:
            report = _convert_into(src, staging, family, q_bits, q_group_size, quantize_head, dtype, step)
        _move_into_place(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report.update(src=str(src), dst=str(dst), seconds=round(time.perf_counter() - t0, 3))
    return report


def _convert_into(src, out, family, q_bits, q_group_size, quantize_head, dtype, step) -> dict:
    step("load trunk")
    trunk, config = _load_trunk(src, family)
    cast_predicate = getattr(trunk, "cast_predicate", lambda _: True)
    quant_predicate = getattr(trunk, "quant_predicate", None)

    if q_bits is not None and quantized_modules(trunk):
        raise ValueError(
            f"{src} is already quantised; quantise from the float checkpoint instead "
            "(mlx-lm would silently keep the existing bits)"
        )
    _drop_dequantised_fp8_config(config)

    step("cast")
    target = _target_dtype(config, dtype)
    if target is not None:
        _cast(trunk, target, cast_predicate)

    step("quantize trunk")
    if q_bits is not None:
        trunk, config = _quantize_trunk(trunk, config, q_bits, q_group_size)
    trunk_report = _trunk_report(trunk, family)
    if q_bits is not None and not trunk_report["quantization"]:
        warnings.warn(f"no trunk layer has an input size divisible by q_group_size={q_group_size}; nothing quantised")

    step("save trunk")
    from mlx_lm.utils import save_model

    keep_vision = "vision_tower" in getattr(trunk, "model", {})
    save_model(out, trunk, donate_model=True)
    del trunk

    step("load head")
    head = _load_head(src)
    if head is not None:
        if target is not None:
            _cast(head, target, cast_predicate)
        if q_bits is not None and quantize_head:
            _quantize_head(head, q_bits, q_group_size, quant_predicate)

    step("save head")
    head_report, head_quant = _save_head(head, out)
    config["mtplx"] = {
        "head_quantization": head_quant,
        "converted_from": str(src.resolve()),
        "mtp_format": "mlx" if head is not None else None,
    }
    from mlx_lm.utils import save_config

    save_config(config, out / "config.json", keep_vision_config=keep_vision)

    step("tokenizer")
    copied = _copy_side_files(src, out)

    step("verify")
    _verify(out, expect_head=head is not None)
    return {
        "family": family.name,
        "model_type": config.get("model_type"),
        "dtype": None if target is None else str(target).replace("mlx.core.", ""),
        "trunk": trunk_report,
        "head": head_report,
        "files_copied": copied,
    }


def _check_options(q_bits, q_group_size, dtype):
    if q_bits is not None and q_bits not in AFFINE_BITS:
        raise ValueError(f"q_bits must be one of {AFFINE_BITS}, got {q_bits}")
    if q_bits is not None and q_group_size not in AFFINE_GROUP_SIZES:
        raise ValueError(f"q_group_size must be one of {AFFINE_GROUP_SIZES}, got {q_group_size}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _check_destination(src: Path, dst: Path, overwrite: bool):
    s, d = src.resolve(), dst.resolve()
    if d == s or d in s.parents:
        raise ValueError(f"destination {dst} would overwrite the source {src}")
    if s in d.parents:  # the checkpoint would gain a directory of files
        raise ValueError(f"destination {dst} is inside the source {src}; pick a directory outside it")
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"destination {dst} exists and is not a directory")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(
            f"destination {dst} exists and is not empty; pass overwrite=True (--overwrite) to replace it"
        )


def _move_into_place(staging: Path, dst: Path):
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(dst)


@contextlib.contextmanager
def _progress(enabled: bool):
    from tqdm import tqdm

    bar = tqdm(total=len(STEPS), desc="convert", unit="step", disable=not enabled)
    started = [False]

    def step(name: str):
        if started[0]:
            bar.update(1)
        started[0] = True
        bar.set_postfix_str(name)

    try:
        yield step
        bar.update(1)
    finally:
        bar.close()


def _load_trunk(src: Path, family: FamilyAdapter):
    from mlx_lm.utils import load_model

    from mtplx.models.loader import trunk_classes

    # The family's classes drop MTP layers mlx-lm's strict load would refuse, and dequantise block fp8.
    classes = trunk_classes(family, read_config(src))
    try:
        return load_model(src, lazy=True, strict=True, get_model_classes=classes)
    except Exception as e:
        raise CheckpointError(f"cannot load the trunk from {src}: {e}") from None


def _drop_dequantised_fp8_config(config: dict):
    # Block-fp8 weights come dequantised (unless kept as mxfp8, "quantization"): drop their description.
    if "quantization" in config:
        return
    for c in (config, config.get("text_config") or {}):
        if (c.get("quantization_config") or {}).get("quant_method") == "fp8":
            c.pop("quantization_config")


def _target_dtype(config: dict, dtype: Optional[str]):
    # As mlx_lm.convert: an explicit dtype, else the config's; anything else keeps the stored dtypes.
    if dtype is None:
        text = config.get("text_config") or {}
        dtype = config.get("torch_dtype") or config.get("dtype") or text.get("dtype") or text.get("torch_dtype")
    return getattr(mx, dtype) if dtype in DTYPES else None


def _cast(module: nn.Module, dtype, keep: Callable[[str], bool]):
    def cast(path, v):
        if keep(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    module.update(tree_map_with_path(cast, module.parameters()))


def _quantize_trunk(trunk, config, q_bits, q_group_size):
    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(io.StringIO()):
        return quantize_model(trunk, config, q_group_size, q_bits, mode="affine")


def _trunk_report(trunk, family) -> dict:
    from mlx_lm.utils import compute_bits_per_weight

    stats = module_stats(trunk)
    stats["layers"] = len(family.text_model(trunk).layers)
    stats["bits_per_weight"] = round(compute_bits_per_weight(trunk), 3)
    return stats


def _load_head(src: Path) -> Optional[nn.Module]:
    from mtplx.models.loader import load

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load(src, lazy=True)
    if model.head is None:
        detail = "; ".join(str(w.message) for w in caught)
        warnings.warn(
            f"{src} holds no MTP tensors: converting the trunk alone, speculation will be unavailable"
            + (f" ({detail})" if detail else "")
        )
        return None
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model.head


def _quantize_head(head: nn.Module, bits: int, group_size: int, trunk_predicate):
    def predicate(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size != 0:
            return False
        verdict = True if trunk_predicate is None else trunk_predicate(path, module)
        # Layers the trunk keeps at other bits (MoE routers) stay float: the sidecar records one quantisation.
        return verdict is True

    nn.quantize(head, group_size=group_size, bits=bits, mode="affine", class_predicate=predicate)


def _save_head(head: Optional[nn.Module], out: Path):
    """Write mtp.safetensors; returns (report, head_quantization for config.json)."""
    if head is None:
        return None, None
    groups = quantization_groups(head)
    if len(groups) > 1:
        raise CheckpointError(f"the MTP head mixes quantisations {groups}; the sidecar holds one")
    quant = {k: groups[0][k] for k in ("group_size", "bits", "mode")} if groups else None
    tensors = {"mtp." + k: v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(out / SIDECAR), tensors, metadata={"format": "mlx"})
    report = dict(module_stats(head), layers=len(head.layers), file=SIDECAR, full_precision=quant is None)
    return report, quant


def _copy_side_files(src: Path, out: Path) -> list:
    copied = []
    for f in sorted(src.iterdir()):
        if not f.is_file() or any(fnmatch(f.name, p) for p in _NOT_COPIED):
            continue
        if any(fnmatch(f.name, p) for p in _SIDE_FILES):
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return copied


def _verify(out: Path, expect_head: bool):
    """Open the result as users will: strict loads check structure and shapes, not the weights."""
    from mtplx.models.loader import load

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a missing head was reported already
        model = load(out, lazy=True)
    if expect_head and model.head is None:
        raise CheckpointError(f"{out}: the converted model lost its MTP head")


def format_convert_report(report: dict) -> str:
    """A few lines for the CLI to print after a conversion."""

    def part(name, r):
        if r is None:
            return f"{name}: none (no MTP tensors in the source)"
        quant = ", ".join(f"{g['bits']}-bit g{g['group_size']} x{g['modules']}" for g in r["quantization"]) or "float"
        return f"{name}: {r['tensors']} tensors, {r['bytes'] / 2**20:.2f} MiB, {quant}, dtypes {'/'.join(r['dtypes'])}"

    lines = [
        f"converted {report['src']} -> {report['dst']} ({report['family']}, {report['seconds']:.1f} s)",
        part("trunk", report["trunk"]),
        part("head", report["head"]),
    ]
    if report["head"] is not None:
        lines.append("head kept in full precision" if report["head"]["full_precision"] else "head quantised")
    return "\n".join(lines)
