"""Every family's MTP head against an independent reference written here.

The reference reads the checkpoint tensors with `mx.load` and wires the head
in plain mx ops (norms, Qwen's +1, concat order, which hidden, projection,
output norm, own vs shared embedding and lm_head). Only the decoder layer
inside the head is run by the trunk's own mlx-lm layer class, loaded with the
MTP layer's tensors through mlx-lm's sanitize (the whole checkpoint presented
to a fresh mlx-lm model, with the MTP layer in one trunk layer's place).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import _get_classes

import mtplx
from mtplx.decode.cache import SlotKVCache
from mtplx.testing import tiny_checkpoint

VOCAB = 32
ALL_FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


# -- plain-op helpers -----------------------------------------------------------


def read_shards(path: Path) -> dict:
    raw = {}
    for f in sorted(path.glob("model-*.safetensors")):
        raw.update(mx.load(str(f)))
    return raw


def rms(x, w, eps):
    x = x.astype(mx.float32)
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def causal(T):
    return mx.tril(mx.ones((T, T), dtype=mx.bool_))


def close(a, b, tol=1e-4):
    return mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=tol, rtol=tol).item()


def text_config(config):
    return config.get("text_config", config)


def fixed_inputs(B, T, H, seed=7):
    k1, k2 = mx.random.split(mx.random.key(seed))
    hidden = mx.random.normal((B, T, H), key=k1)
    tokens = mx.random.randint(0, VOCAB, (B, T), key=k2)
    return hidden, tokens


# -- where each family keeps things (HF names), written out independently -------


class Layout:
    def __init__(self, family, config):
        self.family = family
        self.config = config
        tc = text_config(config)
        self.eps = tc["rms_norm_eps"]
        self.n_trunk = tc["num_hidden_layers"]
        self.n_mtp = tc.get("mtp_num_hidden_layers", tc.get("num_nextn_predict_layers"))
        self.nested = "text_config" in config
        self.qwen = family.startswith("qwen")
        self.deepseek = family in ("deepseek_v3", "glm4_moe", "glm4_moe_lite")

    @property
    def trunk(self):
        return "model.language_model." if self.nested else "model."

    def ref_layer(self):
        # A trunk layer of the same kind as the MTP decoder layer.
        if self.qwen:
            return text_config(self.config)["full_attention_interval"] - 1
        return self.n_trunk - 1

    def mtp_prefix(self, j):
        if self.qwen:
            return f"mtp.layers.{j}."
        if self.deepseek:
            return f"model.layers.{self.n_trunk + j}."
        return f"model.mtp_layers.{j}."

    def is_mtp(self, key):
        if self.qwen:
            return key.startswith("mtp.")
        if self.deepseek:
            m = re.match(r"model\.layers\.(\d+)\.", key)
            return m is not None and int(m.group(1)) >= self.n_trunk
        return key.startswith("model.mtp_layers.")

    def block_suffixes(self, raw, j):
        """The MTP layer's decoder-layer tensors, by suffix."""
        p = self.mtp_prefix(j)
        own = (
            "enorm.",
            "hnorm.",
            "eh_proj.",
            "shared_head.",
            "embed_tokens.",
            "token_layernorm.",
            "hidden_layernorm.",
            "input_proj.",
            "final_layernorm.",
        )
        return {k[len(p) :]: v for k, v in raw.items() if k.startswith(p) and not k[len(p) :].startswith(own)}


def reference_block(layout: Layout, raw, j):
    """mlx-lm's own decoder layer holding MTP layer j's tensors, via mlx-lm's sanitize."""
    model_cls, args_cls = _get_classes(json.loads(json.dumps(layout.config)))
    model = model_cls(args_cls.from_dict(json.loads(json.dumps(layout.config))))
    ref = layout.ref_layer()
    slot = f"{layout.trunk}layers.{ref}."
    weights = {k: v for k, v in raw.items() if not layout.is_mtp(k) and not k.startswith(slot)}
    weights.update({slot + s: v for s, v in layout.block_suffixes(raw, j).items()})
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    inner = model.language_model.model if hasattr(model, "language_model") else model.model
    return inner.layers[ref]


def reference_head(layout: Layout, raw, hidden, tokens, depth=1):
    """(logits, fed-back hidden) of the MTP head, wired in plain ops."""
    j = (depth - 1) % layout.n_mtp
    block = reference_block(layout, raw, j)
    B, T, _ = hidden.shape
    pos0 = (mx.arange(T) != 0)[None, :, None]  # vLLM zeroes the embedding at position 0
    eps = layout.eps
    if layout.qwen:
        embed = raw[f"{layout.trunk}embed_tokens.weight"][tokens]
        e = rms(embed, 1.0 + raw["mtp.pre_fc_norm_embedding.weight"], eps)  # zero-centred norms
        h = rms(hidden, 1.0 + raw["mtp.pre_fc_norm_hidden.weight"], eps)
        x = mx.concatenate([e, h], axis=-1) @ raw["mtp.fc.weight"].T
        x = block(x, causal(T), None)
        out = rms(x, 1.0 + raw["mtp.norm.weight"], eps)
        return out @ raw["lm_head.weight"].T, out
    p = layout.mtp_prefix(j)
    if layout.deepseek:
        embed = raw[f"model.layers.{layout.n_trunk}.embed_tokens.weight"][tokens] * pos0  # own (first MTP layer's)
        e = rms(embed, raw[p + "enorm.weight"], eps)
        h = rms(hidden, raw[p + "hnorm.weight"], eps)
        x = mx.concatenate([e, h], axis=-1) @ raw[p + "eh_proj.weight"].T  # embedding first
        x = block(x, causal(T), None)
        logits = rms(x, raw[p + "shared_head.norm.weight"], eps) @ raw[p + "shared_head.head.weight"].T
        return logits, x
    embed = raw["model.embed_tokens.weight"][tokens] * pos0  # MiMo shares the trunk's
    e = rms(embed, raw[p + "token_layernorm.weight"], eps)
    h = rms(hidden, raw[p + "hidden_layernorm.weight"], eps)
    x = mx.concatenate([h, e], axis=-1) @ raw[p + "input_proj.weight"].T  # hidden first
    x = block(x, causal(T), None)
    return rms(x, raw[p + "final_layernorm.weight"], eps) @ raw["lm_head.weight"].T, x


# -- fixtures --------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(family, **overrides):
        key = (family, json.dumps(overrides, sort_keys=True))
        if key not in made:
            path = tiny_checkpoint(family, tmp_path_factory.mktemp(family), vocab_size=VOCAB, **overrides)
            config = json.loads((path / "config.json").read_text())
            made[key] = (path, mtplx.load(path), read_shards(path), Layout(family, config))
        return made[key]

    return get


def mtp_overrides(family, n):
    return {"mtp_num_hidden_layers": n} if family.startswith("qwen") else {"num_nextn_predict_layers": n}


# -- the head's forward against the reference ------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_head_forward_equals_plain_op_reference(checkpoints, family):
    path, model, raw, layout = checkpoints(family)
    hidden, tokens = fixed_inputs(2, 5, model.text_model.embed_tokens.weight.shape[1])
    logits, out = model.head(hidden, tokens)
    ref_logits, ref_out = reference_head(layout, raw, hidden, tokens)
    assert logits.shape == (2, 5, VOCAB) and out.shape == hidden.shape
    assert close(logits, ref_logits)
    assert close(out, ref_out)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_head_output_at_one_position_per_row_is_that_position_of_the_full_pass(checkpoints, family):
    """`at` (the catch-up's): the MLP and output head run at each row's
    position alone; the output there and every position's cache entries are
    the full pass's."""
    path, model, raw, layout = checkpoints(family)
    hidden, tokens = fixed_inputs(3, 4, model.text_model.embed_tokens.weight.shape[1], seed=5)
    at = mx.array([3, 0, 2], dtype=mx.int32)
    full_cache, cache = SlotKVCache(3), SlotKVCache(3)
    logits, out = model.head(hidden, tokens, [full_cache])
    logits_at, out_at = model.head(hidden, tokens, [cache], at=at)
    rows = mx.arange(3)
    assert logits_at.shape == (3, 1, VOCAB) and out_at.shape == (3, 1, hidden.shape[-1])
    assert close(logits_at[:, 0], logits[rows, at]) and close(out_at[:, 0], out[rows, at])
    assert close(cache.keys, full_cache.keys) and close(cache.values, full_cache.values)


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3", "mimo"])
def test_several_mtp_layers_are_several_head_layers_used_round_robin(checkpoints, family):
    path, model, raw, layout = checkpoints(family, **mtp_overrides(family, 2))
    assert len(model.head.layers) == 2
    hidden, tokens = fixed_inputs(1, 4, model.text_model.embed_tokens.weight.shape[1], seed=3)
    for depth in (2, 3):  # depth 2 -> layer 1, depth 3 -> layer 0
        logits, out = model.head(hidden, tokens, depth=depth)
        ref_logits, ref_out = reference_head(layout, raw, hidden, tokens, depth=depth)
        assert close(logits, ref_logits) and close(out, ref_out)
    assert not close(model.head(hidden, tokens, depth=1)[0], model.head(hidden, tokens, depth=2)[0])


def test_fp8_deepseek_head_equals_reference(checkpoints):
    path, model, raw, layout = checkpoints("deepseek_v3", quantization_config=FP8)
    assert any(k.endswith("weight_scale_inv") and k.startswith("model.layers.2.") for k in raw)
    hidden, tokens = fixed_inputs(1, 4, 32)
    logits, out = model.head(hidden, tokens)
    ref_logits, ref_out = reference_head(layout, raw, hidden, tokens)
    assert close(logits, ref_logits, 1e-3) and close(out, ref_out, 1e-3)


# -- which hidden state feeds the head ----------------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_forward_returns_the_hidden_state_the_family_head_consumes(checkpoints, family):
    """Post-norm families: lm_head(hidden) is the trunk's logits. MiMo (pre-norm):
    lm_head(norm(hidden)) is, and lm_head(hidden) is not."""
    path, model, raw, layout = checkpoints(family)
    tokens = mx.array([[1, 5, 9, 2, 7, 3]])
    logits, hidden = model.forward(tokens)
    W = raw["lm_head.weight"]
    norm_w = raw[f"{layout.trunk}norm.weight"] + (1.0 if layout.qwen else 0.0)
    renormed = rms(hidden, norm_w, layout.eps) @ W.T
    if family == "mimo":
        assert close(renormed, logits)
        assert not close(hidden @ W.T, logits)
    else:
        assert close(hidden @ W.T, logits)
        assert not close(renormed, logits)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "mimo"])
def test_head_over_trunk_hidden_equals_reference_chain(checkpoints, family):
    """The whole chain a draft step uses: forward's hidden into the head."""
    path, model, raw, layout = checkpoints(family)
    tokens = mx.array([[4, 8, 15, 16, 23, 12]])
    _, hidden = model.forward(tokens)
    logits, _ = model.head(hidden[:, :-1], tokens[:, 1:])
    ref_logits, _ = reference_head(layout, raw, hidden[:, :-1], tokens[:, 1:])
    assert close(logits, ref_logits)


# -- the head's cache and the position-0 rule -----------------------------------------


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "mimo"])
@pytest.mark.parametrize("cache_kind", ["kv", "slot"])
def test_head_with_cache_in_chunks_equals_one_causal_pass(checkpoints, family, cache_kind):
    """Positions continue across chunks: only the pair at position 0 gets a zero
    embedding, whether the offset is an int (KVCache) or per row (SlotKVCache)."""
    path, model, raw, layout = checkpoints(family)
    hidden, tokens = fixed_inputs(2, 6, model.text_model.embed_tokens.weight.shape[1], seed=11)
    full, full_out = model.head(hidden, tokens)
    cache = [KVCache() if cache_kind == "kv" else SlotKVCache(2) for _ in model.head.layers]
    parts = [model.head(hidden[:, a:b], tokens[:, a:b], cache) for a, b in ((0, 3), (3, 4), (4, 6))]
    assert close(mx.concatenate([p[0] for p in parts], axis=1), full)
    assert close(mx.concatenate([p[1] for p in parts], axis=1), full_out)


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo"])
def test_embedding_is_zeroed_only_at_position_zero(checkpoints, family):
    path, model, raw, layout = checkpoints(family)
    hidden, tokens = fixed_inputs(1, 3, model.text_model.embed_tokens.weight.shape[1], seed=5)

    def changed(t):
        return tokens.at[0, t].add(1) % VOCAB

    logits, _ = model.head(hidden, tokens)
    assert close(model.head(hidden, changed(0))[0], logits)  # the token at position 0 is ignored
    assert not close(model.head(hidden, changed(1))[0][:, 1], logits[:, 1])  # at position 1 it is not


# -- the transforms the head's tensors need, checked against plain ops ---------------


def test_deepseek_experts_are_stacked_from_per_expert_tensors(checkpoints):
    path, model, raw, layout = checkpoints("deepseek_v3")
    switch = model.head.layers[0].mtp_block.mlp.switch_mlp
    for proj in ("gate_proj", "up_proj", "down_proj"):
        stacked = getattr(switch, proj).weight  # [E, out, in]
        per_expert = [raw[f"model.layers.2.mlp.experts.{e}.{proj}.weight"] for e in range(4)]
        assert mx.array_equal(stacked, mx.stack(per_expert)).item()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite"])
def test_mla_kv_b_proj_is_split_into_embed_q_and_unembed_out(checkpoints, family):
    path, model, raw, layout = checkpoints(family)
    tc = layout.config
    heads, nope, v_dim = tc["num_attention_heads"], tc["qk_nope_head_dim"], tc["v_head_dim"]
    kv_b = raw["model.layers.2.self_attn.kv_b_proj.weight"]  # [heads * (nope + v), kv_lora]
    assert kv_b.shape == (heads * (nope + v_dim), tc["kv_lora_rank"])
    per_head = kv_b.reshape(heads, nope + v_dim, -1)
    attn = model.head.layers[0].mtp_block.self_attn
    assert mx.array_equal(attn.embed_q.weight, per_head[:, :nope, :].swapaxes(1, 2)).item()
    assert mx.array_equal(attn.unembed_out.weight, per_head[:, nope:, :]).item()


def test_deepseek_fp8_weights_are_block_dequantised_with_scale_inv(checkpoints):
    path, model, raw, layout = checkpoints("deepseek_v3", quantization_config=FP8)
    q = raw["model.layers.2.self_attn.o_proj.weight"]
    scale_inv = raw["model.layers.2.self_attn.o_proj.weight_scale_inv"]
    assert q.dtype == mx.uint8 and scale_inv.shape == (1, 1)  # one 128x128 block for a 32x32 weight
    expected = (mx.from_fp8(q, dtype=mx.float32) * scale_inv[0, 0]).astype(mx.bfloat16)
    assert mx.array_equal(model.head.layers[0].mtp_block.self_attn.o_proj.weight, expected).item()
    # The shared experts too (the stacked ones go through the same dequant first).
    e1 = raw["model.layers.2.mlp.experts.1.up_proj.weight"]
    s1 = raw["model.layers.2.mlp.experts.1.up_proj.weight_scale_inv"]
    got = model.head.layers[0].mtp_block.mlp.switch_mlp.up_proj.weight[1]
    assert mx.array_equal(got, (mx.from_fp8(e1, dtype=mx.float32) * s1[0, 0]).astype(mx.bfloat16)).item()


def test_qwen_head_norms_get_the_plus_one_shift(checkpoints):
    path, model, raw, layout = checkpoints("qwen3_5")
    head = model.head
    for name, module in (("pre_fc_norm_embedding", head.pre_fc_norm_embedding), ("norm", head.norm)):
        assert mx.array_equal(module.weight, 1.0 + raw[f"mtp.{name}.weight"]).item()
    assert mx.array_equal(
        head.layers[0].input_layernorm.weight, 1.0 + raw["mtp.layers.0.input_layernorm.weight"]
    ).item()


def test_qwen3_5_moe_fused_gate_up_proj_is_split(checkpoints):
    path, model, raw, layout = checkpoints("qwen3_5_moe")
    fused = raw["mtp.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    inter = fused.shape[1] // 2
    switch = model.head.layers[0].mlp.switch_mlp
    assert mx.array_equal(switch.gate_proj.weight, fused[:, :inter]).item()
    assert mx.array_equal(switch.up_proj.weight, fused[:, inter:]).item()


def test_deepseek_head_uses_its_own_embedding_and_output_head(checkpoints):
    path, model, raw, layout = checkpoints("deepseek_v3")
    assert mx.array_equal(model.head.embed_tokens.weight, raw["model.layers.2.embed_tokens.weight"]).item()
    assert not mx.array_equal(model.head.embed_tokens.weight, raw["model.embed_tokens.weight"]).item()
    assert mx.array_equal(
        model.head.layers[0].shared_head.head.weight, raw["model.layers.2.shared_head.head.weight"]
    ).item()


# -- converted layout (mtp.safetensors sidecar), full precision and quantised ---------


def _write_sidecar(src: Path, dst: Path, head: nn.Module, quantization=None):
    import shutil

    shutil.copytree(src, dst)
    mx.save_safetensors(str(dst / "mtp.safetensors"), {"mtp." + k: v for k, v in tree_flatten(head.parameters())})
    config = json.loads((dst / "config.json").read_text())
    config["mtplx"] = {"head_quantization": quantization, "mtp_format": "mlx"}  # as mtplx convert marks it
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite", "mimo"])
def test_sidecar_head_loads_to_the_same_outputs(checkpoints, tmp_path, family):
    path, model, raw, layout = checkpoints(family)
    _write_sidecar(path, tmp_path / "conv", model.head)
    again = mtplx.load(tmp_path / "conv")
    assert again.info["source"] == "mtp.safetensors"
    hidden, tokens = fixed_inputs(1, 4, model.text_model.embed_tokens.weight.shape[1])
    assert mx.array_equal(again.head(hidden, tokens)[0], model.head(hidden, tokens)[0]).item()


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo"])
def test_quantised_sidecar_head_is_rebuilt_quantised(checkpoints, tmp_path, family):
    path, model, raw, layout = checkpoints(family)
    quant = {"group_size": 32, "bits": 8}
    fresh = mtplx.load(path).head
    nn.quantize(
        fresh,
        group_size=32,
        bits=8,
        class_predicate=lambda p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    _write_sidecar(path, tmp_path / "q", fresh, quant)
    again = mtplx.load(tmp_path / "q")
    assert isinstance(
        again.head.layers[0].mtp_block.mlp.down_proj if family == "mimo" else again.head.layers[0].eh_proj,
        nn.QuantizedLinear,
    )
    hidden, tokens = fixed_inputs(1, 4, model.text_model.embed_tokens.weight.shape[1])
    assert mx.array_equal(again.head(hidden, tokens)[0], fresh(hidden, tokens)[0]).item()
    # 8-bit stays close to the full-precision head (a broken dequant would not).
    assert close(again.head(hidden, tokens)[0], model.head(hidden, tokens)[0], 0.1)


def test_qwen3_5_moe_mtp_experts_stored_one_by_one_load_as_the_fused_ones(tmp_path):
    """Qwen3.5-35B-A3B and -122B-A10B fuse the trunk's experts but store the
    MTP layer's one by one (Qwen3.6 fuses both); either gives the same head."""
    from mtplx.testing import write_shards

    fused = tiny_checkpoint("qwen3_5_moe", tmp_path / "fused", vocab_size=48)
    tensors = read_shards(fused)
    mlp = "mtp.layers.0.mlp.experts."
    gate_up, down = tensors.pop(mlp + "gate_up_proj"), tensors.pop(mlp + "down_proj")  # [E, 2I, H], [E, H, I]
    I = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tensors[f"{mlp}{e}.gate_proj.weight"] = gate_up[e, :I]
        tensors[f"{mlp}{e}.up_proj.weight"] = gate_up[e, I:]
        tensors[f"{mlp}{e}.down_proj.weight"] = down[e]
    each = tmp_path / "each"
    each.mkdir()
    for f in fused.iterdir():  # config and tokenizer files; write_shards writes the weights and index
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            (each / f.name).write_bytes(f.read_bytes())
    write_shards(each, tensors, 2)
    a, b = mtplx.load(fused), mtplx.load(each)
    hidden = mx.random.normal((1, 5, a.text_model.embed_tokens.weight.shape[1]))
    tokens = mx.array([[3, 4, 5, 6, 7]])
    want, got = a.head(hidden, tokens), b.head(hidden, tokens)
    assert all(mx.array_equal(x, y).item() for x, y in zip(want, got))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "glm4_moe", "glm4_moe_lite", "mimo"])
def test_block_fp8_releases_of_every_family_load_dequantised_as_deepseek_v3s(checkpoints, family):
    # mlx-lm dequantises weight_scale_inv blocks in deepseek_v3's sanitize
    # only; the other trunks refused the scales as unknown parameters.
    path, model, raw, layout = checkpoints(family, quantization_config=FP8)

    def expected(key):
        q, s = raw[key], raw[key + "_scale_inv"]
        assert q.dtype == mx.uint8 and s.shape == (1, 1)  # one 128x128 block
        return (mx.from_fp8(q, dtype=mx.float32) * s[0, 0]).astype(mx.bfloat16)

    suffix = "self_attn.o_proj.weight"
    mtp = [k for k in raw if k.endswith(suffix) and model.family.is_mtp_key(k, layout.config)]
    trunk_key = next(k for k in raw if k.endswith("layers.1." + suffix) and k not in mtp)
    trunk = dict(tree_flatten(model.trunk.parameters()))
    got = next(v for k, v in trunk.items() if k.endswith("layers.1." + suffix))
    assert mx.array_equal(got, expected(trunk_key)).item()
    head = [v for k, v in tree_flatten(model.head.parameters()) if k.endswith(suffix)]
    assert len(mtp) == len(head) == 1 and mx.array_equal(head[0], expected(mtp[0])).item()
    prompts = [[3, 4, 5, 6], [9, 8]]
    plain = mtplx.MTPLXRuntime(model, mtplx.MTPContract(depth=0), max_batch=2).generate(prompts, max_tokens=8)
    spec = mtplx.MTPLXRuntime(model, mtplx.MTPContract(depth=2), max_batch=2).generate(prompts, max_tokens=8)
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
