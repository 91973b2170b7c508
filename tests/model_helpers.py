"""Test-only edits of loaded tiny models.

A random MTP head never agrees with its trunk, so every cycle rejects at d_1
and partial acceptance is never exercised. `make_predictable` edits a loaded
model in memory so that the trunk is mostly a bigram model and the head is
that bigram model applied to the next token: acceptance then lands between 0
and 1, and rollback of 0 < a < k entries is exercised. The trunk's layers keep
a scaled-down contribution, so its output still depends on the whole context
(and on every cache being right).
"""

import glob

import mlx.core as mx
from mlx.utils import tree_flatten

from mtplx.testing import tiny_checkpoint

_OUT_PROJ = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "shared_expert.down_proj.weight")


def make_predictable(model, layer_scale: float = 0.3, seed: int = 0):
    mx.random.seed(seed)
    trunk_updates = []
    for name, p in tree_flatten(model.trunk.parameters()):
        if name.endswith(_OUT_PROJ) or name.endswith("switch_mlp.down_proj.weight"):
            trunk_updates.append((name, p * layer_scale))
        elif name.endswith("norm.weight") and p.ndim == 1 and ".layers." not in name:
            trunk_updates.append((name, mx.ones_like(p)))
    model.trunk.load_weights(trunk_updates, strict=False)
    if model.head is None:
        return model
    head_updates = []
    for name, p in tree_flatten(model.head.parameters()):
        if name.endswith(_OUT_PROJ) or name.endswith("switch_mlp.down_proj.weight"):
            head_updates.append((name, p * 0.05))
        elif name.endswith("norm.weight") and p.ndim == 1 and ".layers." not in name:
            head_updates.append((name, mx.ones_like(p)))
        elif name.endswith(("fc.weight", "eh_proj.weight", "input_proj.weight")):
            H = p.shape[0]
            eye = mx.eye(H, dtype=p.dtype)
            zero = mx.zeros((H, H), dtype=p.dtype)
            # Pass the token embedding through, whichever side of the concat it is on.
            first_is_embedding = not name.endswith("input_proj.weight")
            head_updates.append((name, mx.concatenate([eye, zero] if first_is_embedding else [zero, eye], axis=1)))
        elif name.endswith("norm.weight") and p.ndim == 1 and "mtp_block" not in name:
            head_updates.append((name, mx.ones_like(p)))
        elif name == "embed_tokens.weight":  # DeepSeek/GLM heads own an embedding
            head_updates.append((name, model.text_model.embed_tokens.weight))
        elif name.endswith("shared_head.head.weight"):  # ... and an output head
            head_updates.append((name, _trunk_lm_head_weight(model)))
    model.head.load_weights(head_updates, strict=False)
    mx.eval(model.trunk.parameters(), model.head.parameters())
    return model


def _trunk_lm_head_weight(model):
    trunk = getattr(model.trunk, "language_model", model.trunk)
    if "lm_head" in trunk:
        return trunk.lm_head.weight
    return model.text_model.embed_tokens.weight


def mlx_lm_greedy(model, prompt, max_tokens):
    """mlx-lm's own greedy decoding of the trunk (its sampler sees the
    log-probabilities), stopping at EOS (not output)."""
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(
        mx.array(prompt), model.trunk, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, -1)
    ):
        if int(tok) in model.eos_token_ids:
            break
        out.append(int(tok))
    return out


def bf16_checkpoint(family, path):
    """A tiny checkpoint of `family` (vocabulary 48) with its float tensors
    stored in bf16, as the releases ship them."""
    path = tiny_checkpoint(family, path, vocab_size=48, max_position_embeddings=300)
    for f in glob.glob(str(path / "*.safetensors")):
        tensors = mx.load(f)
        mx.save_safetensors(
            f,
            {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in tensors.items()},
            metadata={"format": "pt"},
        )
    return path


def prefilled_slot_caches(model, B: int = 3, L: int = 20, one_lengths: bool = False) -> list:
    """Slot caches of `model`'s trunk after a prompt of L tokens per row;
    `one_lengths`: every KV cache holding one lengths array, as a commit
    leaves the runtime's trunk (`SlotBatch.commit_trunk`)."""
    from mtplx.decode.cache import SlotKVCache, make_slot_caches

    caches = make_slot_caches(model.layer_kinds, B)
    prompts = mx.array([[(7 * b + 3 * i) % 60 + 1 for i in range(L)] for b in range(B)])  # [B, L]
    model.forward(prompts, caches)
    if one_lengths:
        one = next(c.lengths for c in caches if isinstance(c, SlotKVCache))
        for c in caches:
            if isinstance(c, SlotKVCache):
                c.lengths = one
    mx.eval([a for c in caches for a in c.arrays])
    return caches


def slot_cache_state(caches) -> list:
    """Every array the caches hold, a gated-delta layer's pending states included."""
    from mtplx.decode.cache import SlotGDNCache

    out = []
    for c in caches:
        out += list(c.arrays)
        if isinstance(c, SlotGDNCache) and c.pending is not None:
            out += [c.pending[0], *c.pending[1]]
    return out
