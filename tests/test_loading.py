"""`mtplx.load` on every family: the trunk is mlx-lm's, untouched; broken or
partial checkpoints fail with a CheckpointError that names the problem."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models import deepseek_v3
from mlx_lm.utils import load_model

import mtplx
from mtplx.models.adapter import CheckpointError
from mtplx.models.families import supported_model_types
from mtplx.testing import tiny_checkpoint, write_shards

VOCAB = 32
ALL_FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]
TOKENS = mx.array([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])


def no_mtp(family):
    return {"mtp_num_hidden_layers": 0} if family.startswith("qwen") else {"num_nextn_predict_layers": 0}


def rewrite(path: Path, edit):
    """Apply `edit` to the dict of all shard tensors and rewrite shards + index."""
    files = sorted(path.glob("model-*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(mx.load(str(f)))
    edit(tensors)
    for f in files:
        f.unlink()
    write_shards(path, tensors, len(files))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    def make(family, **overrides):
        return tiny_checkpoint(family, tmp_path_factory.mktemp(family), vocab_size=VOCAB, **overrides)

    return make


# -- the trunk is mlx-lm's -----------------------------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_trunk_logits_equal_mlx_lm_on_the_same_directory(ckpt, family):
    path = ckpt(family)
    model = mtplx.load(path)
    if family == "deepseek_v3":
        # mlx-lm 0.32 cannot strictly load a DeepSeek whose MTP layer is not
        # layer 61 (see the next test); its own loader, non-strict, ignores it.
        reference, _ = load_model(path, strict=False)
    else:
        reference, _ = mlx_lm.load(str(path))
    expected = reference(TOKENS)
    logits, _ = model.forward(TOKENS)
    assert mx.allclose(logits, expected, atol=1e-5, rtol=1e-5).item()
    assert mx.allclose(model.trunk(TOKENS), expected, atol=1e-5, rtol=1e-5).item()
    assert model.head is not None and model.tokenizer is not None


def test_mlx_lm_alone_rejects_a_deepseek_whose_mtp_layer_is_not_61_but_mtplx_loads_it(ckpt):
    path = ckpt("deepseek_v3")  # 2 trunk layers: the MTP layer is model.layers.2
    with pytest.raises(ValueError, match="model.layers.2"):
        mlx_lm.load(str(path))
    model = mtplx.load(path)
    assert isinstance(model.trunk, deepseek_v3.Model)  # mlx-lm's class, subclassed, not forked
    assert len(model.head.layers) == 1


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "mimo", "qwen3_next"])
def test_several_mtp_layers_load_as_several_head_layers(ckpt, family):
    n = {"mtp_num_hidden_layers": 3} if family.startswith("qwen") else {"num_nextn_predict_layers": 3}
    model = mtplx.load(ckpt(family, **n))
    assert model.num_head_layers == 3
    assert len(model.make_head_cache()) == 3


def test_loads_from_a_directory_without_an_index(ckpt):
    path = ckpt("mimo")
    (path / "model.safetensors.index.json").unlink()
    assert mtplx.load(path).head is not None


def test_an_hf_layout_head_shard_named_mtp_safetensors_is_read_as_hf_layout(ckpt):
    # Some Qwen3.5 exports keep the mtp.* tensors in a shard of that name, the
    # name `mtplx convert` gives its MLX-layout head; read as that layout, the
    # zero-centred norms went unshifted and the head was wrong without an error.
    from mlx.utils import tree_flatten

    path = ckpt("qwen3_5")
    reference = dict(tree_flatten(mtplx.load(path).head.parameters()))
    tensors = {}
    for f in sorted(path.glob("model-*.safetensors")):
        tensors.update(mx.load(str(f)))
        f.unlink()
    head = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    assert head
    write_shards(path, {k: v for k, v in tensors.items() if k not in head}, 1)
    mx.save_safetensors(str(path / "mtp.safetensors"), head, metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "mtp.safetensors" for k in head})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = mtplx.load(path)
    assert model.info["source"] == "shards"
    loaded = dict(tree_flatten(model.head.parameters()))
    assert loaded.keys() == reference.keys()
    assert all(mx.array_equal(loaded[k], reference[k]).item() for k in reference)


# -- no head ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3", "glm4_moe", "mimo"])
def test_checkpoint_without_mtp_layers_loads_with_head_none(ckpt, family):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing declared, nothing to warn about
        model = mtplx.load(ckpt(family, **no_mtp(family)))
    assert model.head is None and model.num_head_layers == 0
    logits, hidden = model.forward(TOKENS)
    assert logits.shape == (2, 8, VOCAB)


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo"])
def test_mtp_tensors_dropped_by_a_conversion_warn_and_load_the_trunk(ckpt, family):
    path = ckpt(family)
    mtp = mtplx.load(path).family.is_mtp_key
    config = json.loads((path / "config.json").read_text())
    rewrite(path, lambda t: [t.pop(k) for k in [k for k in t if mtp(k, config)]])
    with pytest.warns(UserWarning, match="holds no MTP tensors"):
        model = mtplx.load(path)
    assert model.head is None


# -- broken checkpoints -------------------------------------------------------------


def test_truncated_shard_is_named(ckpt):
    path = ckpt("deepseek_v3")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"truncated safetensors file .*{shard.name}"):
        mtplx.load(path)


@pytest.mark.parametrize(
    "family, key, named",
    [
        ("deepseek_v3", "model.layers.2.enorm.weight", "enorm"),
        ("deepseek_v3", "model.layers.2.mlp.experts.1.up_proj.weight", "model.layers.2.mlp.experts.1.up_proj.weight"),
        ("deepseek_v3", "model.layers.2.embed_tokens.weight", "embed_tokens"),
        # the checkpoint's name, not the head's embed_q / unembed_out it is split into
        (
            "glm4_moe_lite",
            "model.layers.2.self_attn.kv_b_proj.weight",
            r"model\.layers\.2\.self_attn\.kv_b_proj\.weight",
        ),
        ("mimo", "model.mtp_layers.0.input_proj.weight", "input_proj"),
        ("qwen3_next", "mtp.pre_fc_norm_hidden.weight", "pre_fc_norm_hidden"),
    ],
)
def test_missing_mtp_tensor_is_named(ckpt, family, key, named):
    path = ckpt(family)
    rewrite(path, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"missing MTP tensor.*{named}"):
        mtplx.load(path)


@pytest.mark.parametrize(
    "family, key, named",
    [
        ("deepseek_v3", "model.layers.2.bogus.weight", "bogus.weight"),
        ("glm4_moe", "model.layers.2.shared_head.bias", "shared_head.bias"),
        ("mimo", "model.mtp_layers.0.bogus.weight", "bogus.weight"),
        ("qwen3_5", "mtp.bogus.weight", "bogus.weight"),
    ],
)
def test_unknown_mtp_tensor_is_named(ckpt, family, key, named):
    path = ckpt(family)
    rewrite(path, lambda t: t.__setitem__(key, mx.zeros((4,))))
    with pytest.raises(CheckpointError, match=f"unknown MTP tensor.*{named}"):
        mtplx.load(path)


def test_misshaped_mtp_tensor_is_named(ckpt):
    path = ckpt("deepseek_v3")
    rewrite(path, lambda t: t.__setitem__("model.layers.2.eh_proj.weight", mx.zeros((32, 32))))
    with pytest.raises(CheckpointError, match=r"eh_proj.weight.*shape \(32, 32\), expected \(32, 64\)"):
        mtplx.load(path)


def test_a_misshaped_mtp_tensor_the_trunk_transforms_is_named_as_the_checkpoint_names_it(ckpt):
    path = ckpt("glm4_moe_lite")
    key = "model.layers.2.self_attn.kv_b_proj.weight"
    rewrite(path, lambda t: t.__setitem__(key, t[key][:-4]))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.2\.self_attn\.kv_b_proj\.weight' has shape .* as "
        r"model\.layers\.1\.self_attn\.kv_b_proj\.weight has",
    ):
        mtplx.load(path)


@pytest.mark.parametrize(
    "family, key",
    [
        ("qwen3_5", "model.language_model.layers.1.mlp.down_proj.weight"),
        ("deepseek_v3", "model.layers.1.mlp.experts.1.gate_proj.weight"),  # a key the trunk's sanitize looks up
    ],
)
def test_a_missing_trunk_tensor_is_one_line_naming_what_is_missing(ckpt, family, key):
    path = ckpt(family)
    rewrite(path, lambda t: t.pop(key))
    with pytest.raises(CheckpointError) as e:
        mtplx.load(path)
    message = str(e.value)
    assert "\n" not in message and "issing" in message and "layers.1.mlp" in message, message


def test_mtp_layers_beyond_the_declared_count_are_an_error(ckpt):
    path = ckpt("deepseek_v3", num_nextn_predict_layers=2)
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="2 MTP layer.*num_nextn_predict_layers=1"):
        mtplx.load(path)


def test_unsupported_model_type_lists_the_supported_ones(ckpt):
    path = ckpt("mimo")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'") as err:
        mtplx.load(path)
    for model_type in ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo", "qwen3_5", "qwen3_5_moe", "qwen3_next"):
        assert model_type in str(err.value)
    assert set(supported_model_types()) >= {"deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"}


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        mtplx.load(tmp_path / "nowhere")


def test_tiny_checkpoint_rejects_an_unknown_family(tmp_path):
    with pytest.raises(ValueError, match="deepseek_v3"):
        tiny_checkpoint("llama", tmp_path)


def test_end_of_sequence_ids_come_from_generation_config_as_mlx_lm_takes_them(tmp_path):
    path = tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=VOCAB)
    model = mtplx.load(path)
    assert model.eos_token_ids == {0}  # config.json's
    plain = mtplx.MTPLXRuntime(model, mtplx.MTPContract(depth=0), max_batch=1).generate([[3, 4]], max_tokens=12)[0]
    assert len(plain.tokens) >= 3
    stop = plain.tokens[2]  # a token the row emits third
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, stop]}))
    model = mtplx.load(path)
    assert model.eos_token_ids == {0, stop}
    assert set(mlx_lm.load(str(path))[1].eos_token_ids) == {0, stop}
    out = mtplx.MTPLXRuntime(model, mtplx.MTPContract(depth=0), max_batch=1).generate([[3, 4]], max_tokens=12)[0]
    assert out.finish_reason == "stop"
    assert out.tokens == plain.tokens[: plain.tokens.index(stop)]


def test_a_release_that_names_its_own_code_loads_on_a_terminal_without_asking_to_run_it(tmp_path):
    # MiMo and DeepSeek-V3 releases name their own Python classes in
    # config.json (auto_map); transformers asked on a terminal whether to
    # run them and waited 15 s for an answer.
    pty = pytest.importorskip("pty")
    import os
    import select
    import sys
    import time

    path = tiny_checkpoint("mimo", tmp_path / "m", vocab_size=VOCAB)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_mimo.MiMoConfig"}
    (path / "config.json").write_text(json.dumps(config))
    ran = tmp_path / "ran"
    (path / "configuration_mimo.py").write_text(
        f"open({str(ran)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n\n\nclass MiMoConfig(PretrainedConfig):\n    model_type = 'mimo'\n"
    )
    script = f"import mtplx; mtplx.load({str(path)!r}); print('LOADED')"
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:  # the child: a process whose stdin is a terminal
        os.execv(sys.executable, [sys.executable, "-c", script])
    out = b""
    while time.perf_counter() - t0 < 60:
        ready, _, _ = select.select([fd], [], [], 60)
        try:
            chunk = os.read(fd, 4096) if ready else b""
        except OSError:
            chunk = b""
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert "LOADED" in text and "custom code" not in text, text[-2000:]
    assert time.perf_counter() - t0 < 12  # no 15 s wait for an answer
    assert not ran.exists()


def test_a_checkpoint_without_a_tokenizer_vocabulary_is_a_clear_error(ckpt):
    # transformers alone builds a tokenizer of the special tokens, which
    # encodes every text as [] and makes each prompt an "empty prompt".
    path = ckpt("mimo")
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="cannot load the tokenizer from .*: no vocabulary file .*tokenizer.json"):
        mtplx.load(path)
