"""The pipeline's only door to the model: resolve and fingerprint a checkpoint,
load its tokenizer (dry runs) or the model and an `MTPLXRuntime` (runs).

Everything past this module talks to an `Engine`: a tokenizer, a context
length, a Request type and `stream(requests, seed)`. Tests pass a fake one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from .errors import JobError
from .spec import JobSpec

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


@dataclass(frozen=True)
class ModelRef:
    path: Path
    is_default: bool
    fingerprint: str


def resolve_model(path: Optional[str]) -> ModelRef:
    if path is None:
        from mtplx import default_model_path

        try:
            p, default = Path(default_model_path()), True
        except FileNotFoundError as e:
            raise JobError(str(e)) from None
    else:
        p, default = Path(path), False
        if not p.exists():
            raise JobError(f"model path does not exist: {p}")
        if not p.is_dir():
            raise JobError(f"model path is not a directory: {p}")
    if not (p / "config.json").is_file():
        raise JobError(f"model directory {p} has no config.json")
    return ModelRef(p, default, model_fingerprint(p))


def model_fingerprint(path: Path) -> str:
    """A hash of the config, the tokenizer files, and of every weight file's
    name, size, safetensors header (names, dtypes, shapes, offsets) and
    SAMPLES evenly spaced slices of its data: cheap on a 100 GB checkpoint,
    and it changes when the weights are swapped, converted or retrained."""
    h = hashlib.sha256()
    for name in ("config.json",) + TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        _hash_safetensors(f, h)
    return h.hexdigest()


SAMPLES, SAMPLE_BYTES = 64, 4096


def _hash_safetensors(f: Path, h) -> None:
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 100_000_000)))
            start = 8 + n
            span = max(size - start, 0)
            for i in range(SAMPLES):
                fh.seek(start + span * i // SAMPLES)
                h.update(fh.read(SAMPLE_BYTES))
    except OSError as e:
        raise JobError(f"cannot read model file {f}: {e.strerror or e}") from None


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise JobError(f"unreadable {path / 'config.json'}: {e}") from None


def max_context_of(config: dict) -> Optional[int]:
    return config.get("text_config", config).get("max_position_embeddings")


def load_tokenizer(ref: ModelRef):
    """The tokenizer alone, without the weights (dry runs)."""
    from mtplx import load_tokenizer as load_checkpoint_tokenizer

    config = read_config(ref.path)
    try:
        return load_checkpoint_tokenizer(ref.path, config)
    except Exception as e:  # transformers raises many types
        raise JobError(f"cannot load the tokenizer of {ref.path}: {e}") from None


@dataclass
class Engine:
    """What the runner needs from a model and its runtime."""

    tokenizer: Any
    max_context: Optional[int]
    request_type: type
    runtime: Any
    settings: dict = field(default_factory=dict)  # what was chosen: depth, slots, prefill chunk

    def stream(self, requests: Iterable, seed: int) -> Iterator:
        return self.runtime.stream(requests, seed=seed)

    @property
    def stats(self) -> dict:
        return dict(getattr(self.runtime, "stats", {}) or {})


OpenEngine = Callable[
    ..., Engine
]  # (ref, spec, max_memory[, sampled_depth=]) -> Engine; the last for auto resumes only


def open_engine(ref: ModelRef, spec: JobSpec, max_memory: Optional[int], sampled_depth: Optional[int] = None) -> Engine:
    """Load the model and build the runtime; every failure is one JobError line.
    `sampled_depth`: depth "auto"'s depth for sampled rows, as a resumed
    job's first run recorded it (else calibrated)."""
    import mtplx
    from mtplx import Request

    from .memory import size_runtime

    model = _load_model(ref)
    sizing = size_runtime(model, spec, max_memory)
    try:
        contract = mtplx.MTPContract(
            depth=spec.model.depth,
            acceptance=spec.model.acceptance,
            draft_vocab=spec.model.draft_vocab,
            prefill_chunk=sizing.prefill_chunk,
            share_prefix_min=spec.batch.share_prefix_min,
            prefix_cache_bytes=sizing.prefix_cache_bytes,
            sampled_depth=sampled_depth if spec.model.depth == "auto" else None,
        )
        runtime = mtplx.MTPLXRuntime(model, contract=contract, max_batch=sizing.max_batch)
    except ImportError as e:
        raise JobError(f"[model] depth {spec.model.depth!r} is not available: {e}") from None
    except ValueError as e:
        raise JobError(str(e)) from None
    # The job's passes traced and their kernels built now, while loading: on
    # the CPU backend MLX runs the system compiler for each new kernel through
    # system(), which ignores SIGINT in the whole process meanwhile, so a
    # Ctrl-C in the job's first cycles (seconds of them on a cold kernel
    # cache) would be lost.
    runtime.warm_up(sampling_params(spec), logprobs=spec.generation.logprobs)
    settings = {
        "depth": getattr(runtime, "depth", spec.model.depth),
        "max_batch": sizing.max_batch,
        "prefill_chunk": sizing.prefill_chunk,
        "share_prefix_min": spec.batch.share_prefix_min,
        "prefix_cache_bytes": sizing.prefix_cache_bytes,
        "estimated_memory_bytes": sizing.estimated_bytes,
    }
    return Engine(model.tokenizer, model.max_context, Request, runtime, settings)


def sampling_params(spec: JobSpec):
    """The job's [sampling] as the runtime's SamplingParams (the seed travels apart)."""
    from mtplx import SamplingParams

    s = spec.sampling
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)


def check_memory_cap(ref: ModelRef, spec: JobSpec) -> None:
    """A dry run's check of [batch] max_memory: the model's modules built
    without reading a weight, sized as a run would size them."""
    from .memory import size_runtime

    size_runtime(_load_model(ref, lazy=True), spec, spec.batch.max_memory)


def _load_model(ref: ModelRef, lazy: bool = False):
    import mtplx
    from mtplx import CheckpointError

    try:
        return mtplx.load(ref.path, lazy=lazy)
    except (CheckpointError, OSError, ValueError) as e:
        raise JobError(f"cannot load model {ref.path}: {e}") from None
