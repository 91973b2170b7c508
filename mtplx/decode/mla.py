"""Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash) in one form for
every decode pass.

mlx-lm stays in the latent space for one position and decompresses the
cached latents for several; the forms agree in exact arithmetic only, so a
verify would round apart from the steps it stands for (docs/performance.md).
Every pass over slot caches takes the one-position form at any width,
reading the compressed cache; prompt passes keep mlx-lm's forms.
"""

from __future__ import annotations

from typing import Dict

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from mtplx.decode.cache import SlotKVCache

_one_form_classes: Dict[type, type] = {}


def use_one_mla_form(model) -> int:
    """Swap, in place, the trunk's and head's MLA modules for one-form subclasses; returns the count."""
    count = 0
    for part in (model.trunk, model.head):
        if part is None:
            continue
        for _, m in part.named_modules():
            cls = type(m)
            if cls in _one_form_classes.values() or not _is_mla(m):
                continue
            if cls not in _one_form_classes:
                _one_form_classes[cls] = type(f"OneForm{cls.__name__}", (cls,), {"__call__": _latent_attention})
            m.__class__ = _one_form_classes[cls]
            count += 1
    return count


def _is_mla(module) -> bool:
    return all(hasattr(module, a) for a in ("embed_q", "unembed_out", "kv_a_proj_with_mqa", "kv_lora_rank"))


def _latent_attention(self, x: mx.array, mask=None, cache=None) -> mx.array:
    if not isinstance(cache, SlotKVCache):  # a prompt pass: mlx-lm's forms
        return type(self).__mro__[1].__call__(self, x, mask, cache)
    B, L, _ = x.shape
    if self.q_lora_rank is None:
        q = self.q_proj(x)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)  # [B, H, L, Dq]
    q_nope, q_rope = mx.split(q, [self.qk_nope_head_dim], axis=-1)
    latent, k_rope = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
    latent = mx.expand_dims(self.kv_a_layernorm(latent), 1)  # [B, 1, L, C]
    k_rope = k_rope.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)  # [B, 1, L, Dr]
    q_rope = self.rope(q_rope, cache.offset)
    k_rope = self.rope(k_rope, cache.offset)
    latent, k_rope = cache.update_and_fetch(latent, k_rope)  # [B, 1, S, C], [B, 1, S, Dr]
    # The rotary part's scores enter as the additive mask of the latent-space attention.
    rope_scores = (q_rope * self.scale) @ k_rope.swapaxes(-1, -2)  # [B, H, L, S]
    if mask is not None:
        rope_scores = mx.where(mask, rope_scores, mx.array(mx.finfo(rope_scores.dtype).min, rope_scores.dtype))
    out = scaled_dot_product_attention(
        self.embed_q(q_nope), latent, latent, cache=cache, scale=self.scale, mask=rope_scores
    )  # [B, H, L, C]
    out = self.unembed_out(out)  # [B, H, L, Dv]
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
