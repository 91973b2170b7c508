"""`mtplx convert` and `describe_model`: tiny HF checkpoints converted with
mlx-lm's own trunk conversion plus the MTP head sidecar, then loaded back."""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten

import mtplx
from mtplx.models.adapter import CheckpointError
from mtplx.models.convert import convert
from mtplx.models.families import supported_model_types
from mtplx.models.info import describe_model, format_model_description, quantized_modules
from mtplx.testing import tiny_checkpoint, write_shards

VOCAB = 32
ALL_FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]
TOKENS = mx.array([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])  # [B, T]
NEXT = mx.array([[1, 4, 1, 5, 9, 2, 6, 5], [7, 1, 8, 2, 8, 1, 8, 2]])  # [B, T]
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

# Quantised round trip, measured on these tiny random models (hidden 64,
# groups 32 and 64, seeds 0 and 1) as max |logit - source logit| / max |source
# logit|, trunk logits and head logits (end to end: the converted trunk's
# hidden states into the converted head):
#   qwen3_5, deepseek_v3, mimo   8 bits: trunk <= 0.036, head <= 0.022
#                                4 bits: trunk <= 0.545, head <= 0.30
# (The MoE Qwen variants are not asserted here: quantising their tiny random
# routers flips expert choices, up to 0.35 at 8 bits.)
# Stated tolerances, with headroom; a broken head (wrong bits, group size or
# layout) is off by ~1 or more. The tight check is the fake-quantisation test.
TOLERANCE = {8: 0.05, 4: 0.6}


def no_mtp(family):
    return {"mtp_num_hidden_layers": 0} if family.startswith("qwen") else {"num_nextn_predict_layers": 0}


def rel_error(got: mx.array, expected: mx.array) -> float:
    return (mx.abs(got - expected).max() / mx.abs(expected).max()).item()


def head_outputs(model, hidden=None):
    """(trunk logits, head logits, head hidden) on the fixed tokens."""
    logits, h = model.forward(TOKENS)  # [B, T, V], [B, T, H]
    q, out = model.head(h if hidden is None else hidden, NEXT)  # [B, T, V], [B, T, H]
    return logits, q, out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    def make(family, **overrides):
        return tiny_checkpoint(family, tmp_path_factory.mktemp(family), vocab_size=VOCAB, **overrides)

    return make


@pytest.fixture(scope="module")
def float_conversion(tmp_path_factory):
    """family -> (src, dst, report) of an unquantised float32 conversion (cached)."""
    done = {}

    def get(family):
        if family not in done:
            src = tiny_checkpoint(family, tmp_path_factory.mktemp(family), vocab_size=VOCAB)
            dst = tmp_path_factory.mktemp(family + "-mlx") / "out"
            done[family] = (src, dst, convert(src, dst, dtype="float32", progress=False))
        return done[family]

    return get


# -- exact round trip ------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_float_round_trip_gives_identical_trunk_logits_and_head_outputs(float_conversion, family):
    src, dst, report = float_conversion(family)
    source, converted = mtplx.load(src), mtplx.load(dst)
    assert converted.info["source"] == "mtp.safetensors"
    assert converted.num_head_layers == source.num_head_layers == 1
    for a, b in zip(head_outputs(source), head_outputs(converted)):
        assert mx.array_equal(a, b).item()
    text = "the cat sat"
    assert converted.tokenizer.encode(text) == source.tokenizer.encode(text)
    assert report["family"] == source.family.name and report["head"]["layers"] == 1
    assert report["head"]["full_precision"] and report["trunk"]["quantization"] == []


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_converted_trunk_loads_in_plain_mlx_lm_with_the_source_logits(float_conversion, family):
    # Also for deepseek_v3, whose HF layout mlx-lm cannot strictly load: the
    # conversion leaves no MTP layer in the trunk shards.
    src, dst, _ = float_conversion(family)
    reference, _ = mlx_lm.load(str(dst))
    expected, _ = mtplx.load(src).forward(TOKENS)
    assert mx.array_equal(reference(TOKENS), expected).item()


def test_qwen3_5_zero_centred_norms_are_shifted_exactly_once(float_conversion):
    # The converted trunk is MLX layout (conv1d [C, K, 1]), so mlx-lm's
    # sanitize must not add the +1 again when it loads it.
    src, dst, _ = float_conversion("qwen3_5")
    hf = {k: v for f in sorted(src.glob("model-*.safetensors")) for k, v in mx.load(str(f)).items()}
    mlx = mx.load(str(dst / "model.safetensors"))
    name = "layers.1.input_layernorm.weight"
    assert mx.array_equal(mlx[f"language_model.model.{name}"], hf[f"model.language_model.{name}"] + 1.0).item()
    sidecar = mx.load(str(dst / "mtp.safetensors"))
    assert mx.array_equal(sidecar["mtp.norm.weight"], hf["mtp.norm.weight"] + 1.0).item()
    assert mx.array_equal(
        sidecar["mtp.layers.0.input_layernorm.weight"], hf["mtp.layers.0.input_layernorm.weight"] + 1.0
    ).item()


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "qwen3_next", "mimo"])
def test_several_mtp_layers_round_trip_at_every_depth(ckpt, tmp_path, family):
    layers = {"mtp_num_hidden_layers": 2} if family.startswith("qwen") else {"num_nextn_predict_layers": 2}
    src = ckpt(family, **layers)
    convert(src, tmp_path / "out", dtype="float32", progress=False)
    source, converted = mtplx.load(src), mtplx.load(tmp_path / "out")
    assert converted.num_head_layers == 2
    _, hidden = source.forward(TOKENS)
    for depth in (1, 2):
        a, b = source.head(hidden, NEXT, depth=depth), converted.head(hidden, NEXT, depth=depth)
        assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5", "mimo"])
def test_fp8_checkpoint_converts_to_its_dequantised_float_weights(ckpt, tmp_path, family):
    src = ckpt(family, quantization_config=FP8)
    convert(src, tmp_path / "out", dtype="float32", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config  # the written weights are not fp8
    for a, b in zip(head_outputs(mtplx.load(src)), head_outputs(mtplx.load(tmp_path / "out"))):
        assert mx.array_equal(a, b).item()


# -- quantisation -------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "mimo"])
def test_quantised_round_trip_stays_within_the_stated_tolerance(ckpt, tmp_path, family, bits):
    src = ckpt(family, hidden_size=64)
    report = convert(src, tmp_path / "out", dtype="float32", q_bits=bits, q_group_size=32, progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["mtplx"]["head_quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    assert report["head"]["quantization"][0]["bits"] == bits and not report["head"]["full_precision"]
    source, converted = mtplx.load(src), mtplx.load(tmp_path / "out")
    assert quantized_modules(converted.head) and quantized_modules(converted.trunk)
    ref_logits, ref_q, _ = head_outputs(source)
    logits, q, _ = head_outputs(converted)
    assert rel_error(logits, ref_logits) <= TOLERANCE[bits]
    assert rel_error(q, ref_q) <= TOLERANCE[bits]
    assert rel_error(logits, ref_logits) > 0  # it did quantise


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_head_equals_the_source_head_with_fake_quantised_weights(ckpt, tmp_path, bits):
    # DeepSeek's head owns its embedding and output head, so with the same
    # input hidden states its output depends on the head's weights alone.
    # group 64 leaves the layers with 16/24-wide inputs in float.
    src = ckpt("deepseek_v3", hidden_size=64)
    convert(src, tmp_path / "out", dtype="float32", q_bits=bits, q_group_size=64, progress=False)
    source, converted = mtplx.load(src), mtplx.load(tmp_path / "out")
    quantized = quantized_modules(converted.head)
    src_modules = dict(source.head.named_modules())
    updates = []
    for path in quantized:
        w = src_modules[path].weight
        updates.append((f"{path}.weight", mx.dequantize(*mx.quantize(w, 64, bits), 64, bits)))
    source.head.load_weights(updates, strict=False)
    assert "layers.0.mtp_block.self_attn.q_b_proj" not in quantized  # input 24: float
    assert "layers.0.mtp_block.mlp.switch_mlp.up_proj" in quantized  # experts: QuantizedSwitchLinear
    assert "layers.0.eh_proj" in quantized and "embed_tokens" in quantized
    _, hidden = source.forward(TOKENS)
    expected, _ = source.head(hidden, NEXT)
    got, _ = converted.head(hidden, NEXT)
    assert rel_error(got, expected) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_quantize_head_false_keeps_the_head_float_and_unchanged(ckpt, tmp_path, family):
    src = ckpt(family, hidden_size=64)
    report = convert(
        src, tmp_path / "out", dtype="float32", q_bits=4, q_group_size=32, quantize_head=False, progress=False
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["mtplx"]["head_quantization"] is None and report["head"]["full_precision"]
    source, converted = mtplx.load(src), mtplx.load(tmp_path / "out")
    assert quantized_modules(converted.trunk) and not quantized_modules(converted.head)
    expected = dict(tree_flatten(source.head.parameters()))
    got = dict(tree_flatten(converted.head.parameters()))
    assert got.keys() == expected.keys()
    assert all(mx.array_equal(got[k], expected[k]).item() for k in got)


def test_quantised_moe_head_keeps_its_router_float_where_the_trunk_uses_other_bits(ckpt, tmp_path):
    # mlx-lm quantises Qwen MoE routers at 8 bits whatever q_bits is; the
    # sidecar records one bits/group size, so the head's router stays float.
    src = ckpt("qwen3_5_moe", hidden_size=64)
    convert(src, tmp_path / "out", dtype="float32", q_bits=4, q_group_size=32, progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["language_model.model.layers.0.mlp.gate"]["bits"] == 8
    converted = mtplx.load(tmp_path / "out")
    layer = converted.head.layers[0].mlp
    assert type(layer.gate) is nn.Linear
    assert layer.switch_mlp.up_proj.bits == 4
    q, _ = converted.head(converted.forward(TOKENS)[1], NEXT)
    assert mx.all(mx.isfinite(q)).item()


def test_quantising_an_already_quantised_checkpoint_is_refused(ckpt, tmp_path):
    src = ckpt("mimo", hidden_size=64)
    convert(src, tmp_path / "q4", q_bits=4, q_group_size=32, progress=False)
    with pytest.raises(ValueError, match="already quantised"):
        convert(tmp_path / "q4", tmp_path / "q8", q_bits=8, q_group_size=32, progress=False)
    assert not (tmp_path / "q8").exists()


def test_default_dtype_follows_the_config_like_mlx_lm_and_keeps_fp32_routing_biases(ckpt, tmp_path):
    src = ckpt("deepseek_v3")  # config: torch_dtype bfloat16, tensors float32
    report = convert(src, tmp_path / "out", progress=False)
    assert report["dtype"] == "bfloat16"
    head = dict(tree_flatten(mtplx.load(tmp_path / "out", lazy=True).head.parameters()))
    assert head["layers.0.eh_proj.weight"].dtype == mx.bfloat16
    # deepseek_v3's cast_predicate keeps e_score_correction_bias in float32.
    assert head["layers.0.mtp_block.mlp.gate.e_score_correction_bias"].dtype == mx.float32


# -- no head -------------------------------------------------------------------------------


def test_checkpoint_declaring_no_mtp_layers_converts_the_trunk_with_a_warning(ckpt, tmp_path):
    src = ckpt("qwen3_5", **no_mtp("qwen3_5"))
    with pytest.warns(UserWarning, match="holds no MTP tensors: converting the trunk alone"):
        report = convert(src, tmp_path / "out", dtype="float32", progress=False)
    assert report["head"] is None and not (tmp_path / "out" / "mtp.safetensors").exists()
    converted = mtplx.load(tmp_path / "out")
    assert converted.head is None
    assert mx.array_equal(converted.forward(TOKENS)[0], mtplx.load(src).forward(TOKENS)[0]).item()


def test_checkpoint_whose_mtp_tensors_were_stripped_converts_the_trunk_with_a_warning(ckpt, tmp_path):
    src = ckpt("deepseek_v3")
    files = sorted(src.glob("model-*.safetensors"))
    tensors = {k: v for f in files for k, v in mx.load(str(f)).items() if not k.startswith("model.layers.2.")}
    for f in files:
        f.unlink()
    write_shards(src, tensors, len(files))
    with pytest.warns(UserWarning, match="holds no MTP tensors") as caught:
        report = convert(src, tmp_path / "out", dtype="float32", progress=False)
    assert len(caught) == 1  # the loader's own warning is folded into convert's
    assert report["head"] is None
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["mtplx"] == {"head_quantization": None, "converted_from": str(src.resolve()), "mtp_format": None}
    with pytest.warns(UserWarning, match="declares 1 MTP layer"):
        assert mtplx.load(tmp_path / "out").head is None


# -- errors ----------------------------------------------------------------------------------


def test_unknown_family_lists_the_supported_ones(ckpt, tmp_path):
    src = ckpt("mimo")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'") as err:
        convert(src, tmp_path / "out", progress=False)
    assert all(t in str(err.value) for t in supported_model_types())
    assert not (tmp_path / "out").exists()


def test_missing_source_or_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        convert(tmp_path / "nowhere", tmp_path / "out", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        convert(tmp_path / "empty", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_non_empty_destination_is_refused_unless_overwrite(float_conversion, tmp_path):
    src, _, _ = float_conversion("mimo")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=True"):
        convert(src, dst, progress=False)
    assert (dst / "old.txt").read_text() == "keep me"
    convert(src, dst, dtype="float32", progress=False, overwrite=True)
    assert not (dst / "old.txt").exists() and mtplx.load(dst).head is not None
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind


def test_destination_inside_the_source_path_is_refused(float_conversion):
    src, _, _ = float_conversion("mimo")
    with pytest.raises(ValueError, match="would overwrite the source"):
        convert(src, src, progress=False, overwrite=True)
    with pytest.raises(ValueError, match="would overwrite the source"):
        convert(src, src.parent, progress=False, overwrite=True)
    with pytest.raises(ValueError, match="inside the source"):
        convert(src, src / "sub", progress=False)
    assert not (src / "sub").exists()


def test_invalid_quantisation_options_are_named(float_conversion, tmp_path):
    src, _, _ = float_conversion("mimo")
    with pytest.raises(ValueError, match="q_bits must be one of"):
        convert(src, tmp_path / "out", q_bits=7, progress=False)
    with pytest.raises(ValueError, match="q_group_size must be one of"):
        convert(src, tmp_path / "out", q_bits=4, q_group_size=48, progress=False)


def test_progress_bar_counts_the_steps(float_conversion, tmp_path, capsys):
    src, _, _ = float_conversion("mimo")
    convert(src, tmp_path / "out", dtype="float32", progress=True)
    err = capsys.readouterr().err
    assert "convert" in err and "8/8" in err


# -- describe_model ----------------------------------------------------------------------------


def _count(module) -> int:
    return sum(v.size for _, v in tree_flatten(module.parameters()))


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "mimo", "qwen3_next"])
def test_describe_counts_the_parameters_of_the_loaded_modules(float_conversion, family):
    src, _, _ = float_conversion(family)
    d = describe_model(src)
    model = mtplx.load(src, lazy=True)
    assert d["family"] == model.family.name and d["model_type"] == family
    assert d["trunk"]["parameters"] == _count(model.trunk)
    assert d["head"]["parameters"] == _count(model.head)
    assert d["trunk"]["tensors"] == len(tree_flatten(model.trunk.parameters()))
    assert d["trunk"]["layers"] == len(model.text_model.layers)
    assert d["head_depth"] == d["head_declared_layers"] == 1
    assert d["head_complete"] is True and d["head_problem"] is None
    assert d["head_source"] == "shards" and d["trunk"]["dtypes"] == ["float32"]
    assert "head complete: True" in format_model_description(d)


def test_describe_a_quantised_conversion_counts_logical_parameters(ckpt, tmp_path):
    src = ckpt("mimo", hidden_size=64)
    convert(src, tmp_path / "out", dtype="float32", q_bits=4, q_group_size=32, progress=False)
    before, after = describe_model(src), describe_model(tmp_path / "out")
    assert after["trunk"]["parameters"] == before["trunk"]["parameters"]
    assert after["head"]["parameters"] == before["head"]["parameters"]
    assert after["head_source"] == "mtp.safetensors" and after["converted_from"] == str(src.resolve())
    assert after["head"]["quantization"] == [{"mode": "affine", "bits": 4, "group_size": 32, "modules": 8}]
    assert after["head"]["bytes"] < before["head"]["bytes"] / 4
    assert "affine 4-bit, group 32" in format_model_description(after)


def test_describe_reports_a_head_that_cannot_load_instead_of_raising(ckpt):
    src = ckpt("mimo")
    files = sorted(src.glob("model-*.safetensors"))
    tensors = {k: v for f in files for k, v in mx.load(str(f)).items() if k != "model.mtp_layers.0.input_proj.weight"}
    for f in files:
        f.unlink()
    write_shards(src, tensors, len(files))
    d = describe_model(src)
    assert d["head"] is None and d["head_complete"] is False
    assert "input_proj" in d["head_problem"] and d["trunk"]["parameters"] > 0
    assert "head complete: False" in format_model_description(d)


def test_describe_reports_a_checkpoint_without_mtp_tensors_as_incomplete(ckpt):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # describing warns nothing: it reports
        d = describe_model(ckpt("qwen3_next", **no_mtp("qwen3_next")))
    assert d["head"] is None and d["head_complete"] is False and d["head_depth"] == 0
    assert "no MTP tensors" in d["head_problem"]
