"""--max-memory: derive the runtime's slot count and prefill chunk from a cap.

This is an estimate from the checkpoint's config and file sizes, not a
measurement: weights + per-slot caches (attention KV for up to
PROMPT_ALLOWANCE prompt tokens plus max_tokens, gated-delta state, draft and
verify activations) + one prefill chunk's activations + the cache of shared
prefix states (a tenth of what the weights leave; without a cap the runtime's
own bound, 1 GiB: mtplx.decode.prefix.DEFAULT_PREFIX_CACHE_BYTES). Prompts
longer than the allowance still run, and may then exceed the cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import JobError
from .spec import JobSpec

PROMPT_ALLOWANCE = 4096  # prompt tokens a slot is sized for
DEFAULT_PREFILL_CHUNK = 512
MIN_PREFILL_CHUNK = 16
PREFIX_CACHE_SHARE = 10  # the shared prefix cache gets 1/this of what the weights leave
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Sizing:
    max_batch: int
    prefill_chunk: int
    estimated_bytes: int
    prefix_cache_bytes: Optional[int] = None  # None: the runtime's default bound


@dataclass(frozen=True)
class Footprint:
    weights: int  # bytes of the weight files
    per_slot: int  # bytes one decode slot holds at the sized length
    per_prefill_token: int  # activation bytes per prompt token of a prefill chunk
    prefill_fixed: int  # the batch-1 prefill cache of one sized prompt

    def total(self, slots: int, chunk: int) -> int:
        return self.weights + slots * self.per_slot + chunk * self.per_prefill_token + self.prefill_fixed


def footprint(model, spec: JobSpec) -> Footprint:
    cfg = model.config.get("text_config", model.config)
    item = _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), 4)
    hidden = int(cfg.get("hidden_size", 0))
    vocab = int(cfg.get("vocab_size", 0))
    heads = int(cfg.get("num_attention_heads", 1) or 1)
    kv_heads = int(cfg.get("num_key_value_heads", heads) or heads)
    head_dim = int(cfg.get("head_dim") or (hidden // heads))
    kinds = list(model.layer_kinds)
    n_attn = kinds.count("attn") + int(model.num_head_layers)
    kv_per_token = n_attn * 2 * kv_heads * head_dim * item
    n_lin = kinds.count("linear")
    hv, hk = int(cfg.get("linear_num_value_heads", 0)), int(cfg.get("linear_num_key_heads", 0))
    dk, dv = int(cfg.get("linear_key_head_dim", 0)), int(cfg.get("linear_value_head_dim", 0))
    conv_dim = 2 * hk * dk + hv * dv
    linear_state = n_lin * (hv * dk * dv + conv_dim * (int(cfg.get("linear_conv_kernel_dim", 4)) - 1)) * 4
    depth = spec.model.depth if isinstance(spec.model.depth, int) else 3
    length = PROMPT_ALLOWANCE + spec.generation.max_tokens + depth + 1
    if model.max_context:
        length = min(length, int(model.max_context))
    # verify logits, probabilities and drafts: a few [k+1, V] float32 arrays a slot
    activations = (depth + 1) * (3 * vocab + 8 * hidden) * 4
    weights = sum(f.stat().st_size for f in model.path.glob("*.safetensors"))
    return Footprint(
        weights=weights,
        per_slot=kv_per_token * length + linear_state + activations,
        per_prefill_token=(2 * vocab + 8 * hidden) * 4,
        prefill_fixed=kv_per_token * length + linear_state,
    )


def size_runtime(model, spec: JobSpec, max_memory: Optional[int]) -> Sizing:
    chunk = spec.batch.token_budget or DEFAULT_PREFILL_CHUNK
    fp = footprint(model, spec)
    if max_memory is None:
        slots = spec.batch.max_batch
        return Sizing(slots, chunk, fp.total(slots, chunk))
    free = max_memory - fp.weights - fp.prefill_fixed
    prefixes = max(free, 0) // PREFIX_CACHE_SHARE
    free -= prefixes
    # Prefill gets at most a fifth of what the weights leave.
    chunk = max(MIN_PREFILL_CHUNK, min(chunk, (max(free, 0) // 5) // max(fp.per_prefill_token, 1)))
    # Whole multiples of 16 where the cap cut it: shared prefixes stay bit-exact (docs/design.md).
    chunk = chunk if chunk == spec.batch.token_budget else chunk // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK
    slots = min(spec.batch.max_batch, (free - chunk * fp.per_prefill_token) // max(fp.per_slot, 1))
    if slots < 1:
        need = fp.total(1, MIN_PREFILL_CHUNK)
        raise JobError(
            f"--max-memory {_gb(max_memory)} is too small for this model: its weights ({_gb(fp.weights)}) and one "
            f"decode slot need about {_gb(need)}"
        )
    return Sizing(int(slots), int(chunk), fp.total(int(slots), int(chunk)) + prefixes, int(prefixes))


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
