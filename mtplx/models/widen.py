"""A checkpoint widened to a larger shape that computes the source's function:
the cost of a bigger model with the trained model's outputs and acceptance.

Qwen3.5 (dense) checkpoints in the release (HF) layout. The residual stream
gets extra dimensions that stay zero: every weight that writes into it (the
attention and gated-delta output projections, the MLP's down projection, the
head's fc) has zero rows for them, and the embedding zero columns. Each RMSNorm
over the hidden size is rescaled so that the widened vector's norm gives the
source's (the zero-centred `1 + w` of the release layout; eps keeps its
absolute value, so its share of the mean square shifts by hidden'/hidden).
Extra attention and gated-delta heads and MLP units are random, with zero
output columns; extra layers are random with all output projections zero.
Head sizes stay the source's (RoPE's frequencies and the readout scale
depend on them), so wider projections come from more heads, in the source's
ratios of query to key heads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from mtplx.models.adapter import CheckpointError
from mtplx.models.checkpoint import load_tensors, read_config, shard_files, write_shards

TRUNK = "model.language_model."

# Named target shapes: hidden size, layers, MLP width and vocabulary of the releases (docs/scale.md cites the
# sources). Their attention has 8/2 (0.8B) and 16/4 (4B) query/KV heads of 256 with an output gate; the source's
# 24-wide heads in its 2:1 ratio reach the same attention weight bytes per layer within 1% (`attention_rows`).
# The gated-delta heads are scaled from the source's: the sources found do not give the releases' counts.
SHAPES = {
    "qwen3.5-0.8b": dict(hidden=1024, layers=24, intermediate=3584, num_attention_heads=74, vocab_size=248320),
    "qwen3.5-4b": dict(hidden=2560, layers=32, intermediate=9216, num_attention_heads=150, vocab_size=248320),
}


def attention_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Rows of hidden-sized weights in one gated attention layer: q and its gate, k, v, and o's columns."""
    return (3 * num_heads + 2 * num_kv_heads) * head_dim


_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight")
_HEAD_NORMS = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


def widen(
    src,
    dst,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    num_attention_heads: Optional[int] = None,
    linear_num_value_heads: Optional[int] = None,
    vocab_size: Optional[int] = None,
    seed: int = 0,
    num_shards: int = 4,
    dtype: Optional[mx.Dtype] = None,
) -> Path:
    """Write to `dst` a widened copy of the Qwen3.5 checkpoint `src` (module docstring).
    Head counts default to the source's scaled by hidden / source hidden; key heads follow
    from the source's ratios. `vocab_size`: pad the embedding and output layer to this many rows;
    the config records the tokenizer's vocabulary (`tokenizer_vocab_size`) and the decoder cuts the
    padded logits off before sampling. `dtype`: the written weights' type (e.g. mx.bfloat16, as releases
    ship); default the source's. Each layer is cast as it is made, so float32 copies never pile up."""
    src, dst = Path(src), Path(dst)
    config, shape = _plan(src, hidden, layers, intermediate, num_attention_heads, linear_num_value_heads, vocab_size)
    tensors = load_tensors(shard_files(src), lambda name: True)
    if any("conv1d.weight" in k and v.shape[-1] == 1 for k, v in tensors.items()):
        raise CheckpointError(f"{src} is in the MLX layout; widen takes the release (HF) layout")
    out = _Widener(shape, mx.random.key(seed), dtype).checkpoint(tensors)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation config, the acceptance record
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(f, dst / f.name)
    write_shards(dst, out, num_shards)
    (dst / "config.json").write_text(json.dumps(shape.config(config), indent=2) + "\n")
    return dst


def widened_config(
    src,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    num_attention_heads: Optional[int] = None,
    linear_num_value_heads: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> dict:
    """The config.json `widen` would write for these arguments, without reading or writing a weight."""
    config, shape = _plan(
        Path(src), hidden, layers, intermediate, num_attention_heads, linear_num_value_heads, vocab_size
    )
    return shape.config(config)


def _plan(src: Path, *args):
    config = read_config(src)
    text = config.get("text_config", config)
    if config.get("model_type") != "qwen3_5" or text.get("num_experts"):
        raise CheckpointError(f"widen takes a dense qwen3_5 checkpoint, not {config.get('model_type')!r}")
    return config, _Shape(text, *args)


class _Shape:
    def __init__(self, text: dict, hidden, layers, intermediate, heads, linear_heads, vocab_size=None):
        self.src = text
        self.V = text.get("tokenizer_vocab_size") or text["vocab_size"]  # the ids the tokenizer has
        self.Vrows, self.Vrows2 = text["vocab_size"], vocab_size or text["vocab_size"]
        self.H, self.H2 = text["hidden_size"], hidden
        self.L, self.L2 = text["num_hidden_layers"], layers
        self.I, self.I2 = text["intermediate_size"], intermediate
        self.hd = text.get("head_dim") or self.H // text["num_attention_heads"]
        self.nq, self.nkv = text["num_attention_heads"], text["num_key_value_heads"]
        self.Hk, self.Hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
        self.Dk, self.Dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
        self.interval = text["full_attention_interval"]
        rep, r = self.nq // self.nkv, self.Hv // self.Hk
        self.nq2 = heads or max(self.nq, round(self.nq * hidden / self.H / rep) * rep)
        self.Hv2 = linear_heads or max(self.Hv, round(self.Hv * hidden / self.H / r) * r)
        if hidden < self.H or layers < self.L or intermediate < self.I or self.Vrows2 < self.Vrows:
            raise ValueError(
                "widen only grows a model: hidden, layers, intermediate and vocab_size must be at least the source's"
            )
        if self.nq2 < self.nq or self.nq2 % rep or self.Hv2 < self.Hv or self.Hv2 % r:
            raise ValueError(f"head counts must be at least the source's and multiples of its ratios ({rep}, {r})")
        self.nkv2, self.Hk2 = self.nq2 // rep, self.Hv2 // r

    def is_linear(self, layer: int) -> bool:
        return (layer + 1) % self.interval != 0

    def config(self, config: dict) -> dict:
        text = dict(self.src)
        text.update(
            hidden_size=self.H2,
            num_hidden_layers=self.L2,
            intermediate_size=self.I2,
            num_attention_heads=self.nq2,
            num_key_value_heads=self.nkv2,
            linear_num_key_heads=self.Hk2,
            linear_num_value_heads=self.Hv2,
            layer_types=["linear_attention" if self.is_linear(i) else "full_attention" for i in range(self.L2)],
            vocab_size=self.Vrows2,
        )
        if self.Vrows2 != self.V:
            text["tokenizer_vocab_size"] = self.V
        return {**config, "text_config": text} if "text_config" in config else text


class _Widener:
    def __init__(self, shape: _Shape, key, dtype: Optional[mx.Dtype] = None):
        self.s, self.key, self.dtype = shape, key, dtype

    def done(self, tensors: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """`tensors` in the output dtype, computed now: a widened model's float32 intermediates are the
        model's size again, so they are freed a layer at a time."""
        if self.dtype is not None:
            tensors = {
                k: v.astype(self.dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tensors.items()
            }
        mx.eval(list(tensors.values()))
        return tensors

    def random(self, shape) -> mx.array:
        self.key, k = mx.random.split(self.key)
        return 0.02 * mx.random.normal(shape, key=k)

    def grow(self, w: mx.array, rows=None, cols=None, fill="random") -> mx.array:
        """`w` [R, C] inside a new [rows', cols'] matrix; `rows`/`cols`: (new size, where each old index
        goes) or None to keep that axis. The rest is random (fed only zeros) or zero (writes the residual)."""
        R, C = w.shape
        rows = rows or (R, np.arange(R))
        cols = cols or (C, np.arange(C))
        shape = (rows[0], cols[0])
        out = self.random(shape) if fill == "random" else mx.zeros(shape, dtype=mx.float32)
        # a scatter on the device: no host copies of matrices the size of a real model's
        out[mx.array(rows[1])[:, None], mx.array(cols[1])[None, :]] = w.astype(mx.float32)
        return out.astype(w.dtype)

    def hidden_cols(self):
        return (self.s.H2, np.arange(self.s.H))

    def norm(self, w: mx.array) -> mx.array:
        """A zero-centred RMSNorm weight over the hidden size, rescaled for the zero-padded vector."""
        scaled = (1.0 + w) * (self.s.H / self.s.H2) ** 0.5 - 1.0
        return mx.concatenate([scaled, self.random((self.s.H2 - self.s.H,))])

    def checkpoint(self, t: Dict[str, mx.array]) -> Dict[str, mx.array]:
        s, out = self.s, {}
        ids = (s.Vrows2, np.arange(s.Vrows))  # padded ids: rows after the source's, never sampled
        emb = self.grow(t[TRUNK + "embed_tokens.weight"], rows=ids, cols=self.hidden_cols())
        zeros = mx.zeros((s.Vrows2, s.H2 - s.H), dtype=emb.dtype)
        out[TRUNK + "embed_tokens.weight"] = mx.concatenate([emb[:, : s.H], zeros], axis=1)
        if "lm_head.weight" in t:
            out["lm_head.weight"] = self.grow(t["lm_head.weight"], rows=ids, cols=self.hidden_cols())
        out[TRUNK + "norm.weight"] = self.norm(t[TRUNK + "norm.weight"])
        out = self.done(out)
        for i in range(s.L2):
            prefix = f"{TRUNK}layers.{i}."
            old = {k[len(prefix) :]: v for k, v in t.items() if k.startswith(prefix)} if i < s.L else None
            out.update(self.done({prefix + k: v for k, v in self.layer(old, s.is_linear(i)).items()}))
        head = {k[len("mtp.layers.0.") :]: v for k, v in t.items() if k.startswith("mtp.layers.0.")}
        if head:
            mtp = {"mtp.layers.0." + k: v for k, v in self.layer(head, False).items()}
            for k in _HEAD_NORMS:
                mtp[k] = self.norm(t[k])
            fc = t["mtp.fc.weight"]  # [H, 2H]: the embedding's half, then the hidden state's
            where = np.concatenate([np.arange(s.H), s.H2 + np.arange(s.H)])
            grown = self.grow(fc, rows=self.hidden_cols(), cols=(2 * s.H2, where))
            mtp["mtp.fc.weight"] = mx.concatenate([grown[: s.H], mx.zeros((s.H2 - s.H, 2 * s.H2), dtype=fc.dtype)])
            out.update(self.done(mtp))
        return out

    def layer(self, old: Optional[Dict[str, mx.array]], linear: bool) -> Dict[str, mx.array]:
        """One decoder layer's tensors; `old` None: a new layer, which writes nothing."""
        old = old if old is not None else self._blank_layer(linear)
        s, out = self.s, {}
        for k in _ZERO_CENTRED:
            out[k[1:]] = self.norm(old[k[1:]])
        mlp_rows = (s.I2, np.arange(s.I))
        out["mlp.gate_proj.weight"] = self.grow(old["mlp.gate_proj.weight"], rows=mlp_rows, cols=self.hidden_cols())
        out["mlp.up_proj.weight"] = self.grow(old["mlp.up_proj.weight"], rows=mlp_rows, cols=self.hidden_cols())
        out["mlp.down_proj.weight"] = self.grow(
            old["mlp.down_proj.weight"], rows=self.hidden_cols(), cols=mlp_rows, fill="zero"
        )
        out.update(self.linear_attn(old) if linear else self.self_attn(old))
        return out

    def self_attn(self, old: Dict[str, mx.array]) -> Dict[str, mx.array]:
        s, a = self.s, "self_attn."
        heads = lambda n, n2, per: (n2 * per, np.arange(n * per))  # noqa: E731  heads appended after the old
        return {
            a + "q_proj.weight": self.grow(
                old[a + "q_proj.weight"], rows=heads(s.nq, s.nq2, 2 * s.hd), cols=self.hidden_cols()
            ),
            a + "k_proj.weight": self.grow(
                old[a + "k_proj.weight"], rows=heads(s.nkv, s.nkv2, s.hd), cols=self.hidden_cols()
            ),
            a + "v_proj.weight": self.grow(
                old[a + "v_proj.weight"], rows=heads(s.nkv, s.nkv2, s.hd), cols=self.hidden_cols()
            ),
            a + "o_proj.weight": self.grow(
                old[a + "o_proj.weight"], rows=self.hidden_cols(), cols=heads(s.nq, s.nq2, s.hd), fill="zero"
            ),
            a + "q_norm.weight": old[a + "q_norm.weight"],
            a + "k_norm.weight": old[a + "k_norm.weight"],
        }

    def linear_attn(self, old: Dict[str, mx.array]) -> Dict[str, mx.array]:
        s, g = self.s, "linear_attn."
        key, key2 = s.Hk * s.Dk, s.Hk2 * s.Dk
        # conv channels: q's heads, k's, then v's; each block keeps its old heads first
        qkv = np.concatenate([np.arange(key), key2 + np.arange(key), 2 * key2 + np.arange(s.Hv * s.Dv)])
        channels = (2 * key2 + s.Hv2 * s.Dv, qkv)
        conv = old[g + "conv1d.weight"]  # [C, 1, K]
        conv2 = self.grow(conv[:, 0, :], rows=channels)[:, None, :]
        v_heads = (s.Hv2, np.arange(s.Hv))
        v_dims = (s.Hv2 * s.Dv, np.arange(s.Hv * s.Dv))
        pad = lambda x: mx.concatenate([x, mx.abs(self.random((s.Hv2 - s.Hv,)))])  # noqa: E731
        return {
            g + "in_proj_qkv.weight": self.grow(old[g + "in_proj_qkv.weight"], rows=channels, cols=self.hidden_cols()),
            g + "conv1d.weight": conv2,
            g + "in_proj_z.weight": self.grow(old[g + "in_proj_z.weight"], rows=v_dims, cols=self.hidden_cols()),
            g + "in_proj_b.weight": self.grow(old[g + "in_proj_b.weight"], rows=v_heads, cols=self.hidden_cols()),
            g + "in_proj_a.weight": self.grow(old[g + "in_proj_a.weight"], rows=v_heads, cols=self.hidden_cols()),
            g + "A_log": pad(old[g + "A_log"]),
            g + "dt_bias": pad(old[g + "dt_bias"]),
            g + "norm.weight": old[g + "norm.weight"],
            g + "out_proj.weight": self.grow(
                old[g + "out_proj.weight"], rows=self.hidden_cols(), cols=v_dims, fill="zero"
            ),
        }

    def _blank_layer(self, linear: bool) -> Dict[str, mx.array]:
        """A source-sized layer whose output projections are zero: widened, it writes nothing."""
        s, r = self.s, self.random
        t = {
            "input_layernorm.weight": r((s.H,)),
            "post_attention_layernorm.weight": r((s.H,)),
            "mlp.gate_proj.weight": r((s.I, s.H)),
            "mlp.up_proj.weight": r((s.I, s.H)),
            "mlp.down_proj.weight": mx.zeros((s.H, s.I)),
        }
        if linear:
            C = 2 * s.Hk * s.Dk + s.Hv * s.Dv
            t.update(
                {
                    "linear_attn.in_proj_qkv.weight": r((C, s.H)),
                    "linear_attn.conv1d.weight": r((C, 1, s.src["linear_conv_kernel_dim"])),
                    "linear_attn.in_proj_z.weight": r((s.Hv * s.Dv, s.H)),
                    "linear_attn.in_proj_b.weight": r((s.Hv, s.H)),
                    "linear_attn.in_proj_a.weight": r((s.Hv, s.H)),
                    "linear_attn.A_log": mx.abs(r((s.Hv,))),
                    "linear_attn.dt_bias": mx.abs(r((s.Hv,))),
                    "linear_attn.norm.weight": 1.0 + r((s.Dv,)),
                    "linear_attn.out_proj.weight": mx.zeros((s.H, s.Hv * s.Dv)),
                }
            )
        else:
            t.update(
                {
                    "self_attn.q_proj.weight": r((2 * s.nq * s.hd, s.H)),
                    "self_attn.k_proj.weight": r((s.nkv * s.hd, s.H)),
                    "self_attn.v_proj.weight": r((s.nkv * s.hd, s.H)),
                    "self_attn.o_proj.weight": mx.zeros((s.H, s.nq * s.hd)),
                    "self_attn.q_norm.weight": r((s.hd,)),
                    "self_attn.k_norm.weight": r((s.hd,)),
                }
            )
        return t
