"""The default model's training recipe: corpus, tokenizer, training forward,
export layout, and a short end-to-end run."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mtplx
from mtplx.models.families.gated_delta_chunked import chunked_gated_delta, log_gate
from mtplx.training.corpus import HELD_OUT_MODULES, function_examples, is_held_out, split_corpus, stdlib_sources
from mtplx.training.export import export_checkpoint
from mtplx.training.model import ModelShape, TinyMTP, release_config
from mtplx.training.train import TrainSettings, mtp_losses, train

TINY = ModelShape(
    vocab_size=300,
    hidden_size=32,
    num_hidden_layers=4,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_value_heads=2,
    linear_num_key_heads=1,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def _random_tokens(shape, vocab, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32))


@pytest.mark.parametrize("length,chunk", [(37, 8), (64, 16), (5, 32)])
def test_chunked_gated_delta_equals_mlx_lm_recurrence(length, chunk):
    from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

    mx.random.seed(1)
    B, Hk, Hv, D = 2, 1, 2, 16
    q, k = normalize_qk(
        mx.random.normal((B, length, Hk, D)), mx.random.normal((B, length, Hk, D)), inv_scale=D**-0.5, eps=1e-6
    )
    v = mx.random.normal((B, length, Hv, D))
    a, b = mx.random.normal((B, length, Hv)), mx.random.normal((B, length, Hv))
    A_log, dt_bias = mx.log(mx.random.uniform(0.5, 8, (Hv,))), mx.ones((Hv,))
    want, _ = gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), mx.zeros((B, Hv, D, D)))
    got, _ = chunked_gated_delta(q, k, v, log_gate(A_log, a, dt_bias), mx.sigmoid(b), chunk)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-5


def test_chunked_gated_delta_gradients_equal_the_recurrence_gradients():
    from mlx_lm.models.gated_delta import gated_delta_ops

    mx.random.seed(2)
    B, T, H, D = 1, 19, 2, 8
    q, k, v, r = (mx.random.normal((B, T, H, D)) for _ in range(4))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    log_g, beta = -mx.random.uniform(0, 2, (B, T, H)), mx.random.uniform(0, 1, (B, T, H))

    def recurrent(q, k, v, log_g, beta):
        y, _ = gated_delta_ops(q, k, v, mx.exp(log_g), beta, mx.zeros((B, H, D, D)))
        return (y * r).sum()

    def chunked(q, k, v, log_g, beta):
        return (chunked_gated_delta(q, k, v, log_g, beta, 8)[0] * r).sum()

    args, argnums = (q, k, v, log_g, beta), (0, 1, 2, 3, 4)
    for want, got in zip(mx.grad(recurrent, argnums)(*args), mx.grad(chunked, argnums)(*args)):
        assert mx.abs(want - got).max().item() < 1e-5


def test_training_forward_equals_mlx_lm_forward():
    mx.random.seed(0)
    model = TinyMTP(release_config(TINY))
    tokens = _random_tokens((2, 45), TINY.vocab_size)
    diff = mx.abs(model.hidden_chunked(tokens) - model.hidden(tokens)).max().item()
    assert diff < 1e-4


def test_trunk_needs_a_gated_delta_layer():
    with pytest.raises(ValueError, match="gated-delta"):
        release_config(ModelShape(num_hidden_layers=2, full_attention_interval=1))


def test_config_is_the_qwen3_5_release_layout():
    config = release_config(TINY)
    assert config["model_type"] == "qwen3_5"
    tc = config["text_config"]
    assert tc["model_type"] == "qwen3_5_text" and tc["mtp_num_hidden_layers"] == 1
    assert set(tc["layer_types"]) == {"linear_attention", "full_attention"}


def test_joint_loss_falls_on_a_repeated_batch():
    mx.random.seed(0)
    model = TinyMTP(release_config(TINY))
    stream = np.tile(np.arange(1, 40, dtype=np.int32), 50)  # a pattern the model can learn
    settings = TrainSettings(steps=30, batch_size=4, seq_len=24, learning_rate=1e-2, warmup_steps=3, log_every=10)
    curve = train(model, stream, settings)
    assert curve[-1]["trunk"] < curve[0]["trunk"] - 0.5
    assert curve[-1]["head_d1"] < curve[0]["head_d1"] - 0.5
    assert curve[-1]["head_d2"] < curve[0]["head_d2"] - 0.5


class _Oracle:
    """A stand-in model on the counting sequence x_t = t whose trunk predicts
    x_{t+1} and whose head, given (h_t, x_{t+1}), predicts x_{t+1} + 1."""

    V = 64

    def hidden_chunked(self, tokens):
        return mx.eye(self.V)[(tokens + 1) % self.V]  # [B, T, V]

    def lm_head(self, hidden):
        return 50.0 * hidden

    def head(self, hidden, next_tokens, depth=1):
        return 50.0 * mx.eye(self.V)[(next_tokens + 1) % self.V], hidden


@pytest.mark.parametrize("distill", [0.0, 1.0])
def test_losses_pair_hidden_t_and_token_t1_with_token_t2(distill):
    tokens = mx.arange(40)[None]  # [1, 40]
    total, trunk, d1, d2 = mtp_losses(_Oracle(), tokens, TrainSettings(distill=distill))
    # Any misalignment of targets or teacher positions costs ~50 nats.
    assert max(total.item(), trunk.item(), d1.item(), d2.item()) < 1e-3


def test_bigram_warm_start_makes_a_fresh_model_predict_the_next_and_next_next_token():
    from mtplx.training.model import initialize
    from mtplx.training.warm_start import warm_start

    mx.random.seed(0)
    model = TinyMTP(release_config(TINY))
    initialize(model)
    stream = np.tile(np.arange(5, 25, dtype=np.int32), 200)  # x_{t+1} = x_t + 1, a 20-cycle
    info = warm_start(model, stream, steps=300)
    assert info["bigram_fit_loss"] < 0.1
    tokens = mx.array(stream[None, :60])
    _, trunk, d1, _ = mtp_losses(model, tokens, TrainSettings(distill=0.0))
    assert trunk.item() < 0.5 and d1.item() < 0.5


def test_exported_checkpoint_computes_what_the_trained_model_computes(tmp_path):
    from mtplx.models.tokenizer_files import write_char_tokenizer

    mx.random.seed(0)
    model = TinyMTP(release_config(TINY))
    # Norms away from 1, so a missing or extra zero-centre shift shows.
    noisy = [
        (k, 1.0 + 0.3 * mx.random.normal(v.shape))
        for k, v in tree_flatten(model.parameters())
        if k.endswith("norm.weight")
    ]
    model.load_weights(noisy, strict=False)
    export_checkpoint(model, release_config(TINY), tmp_path)
    write_char_tokenizer(tmp_path, 64)
    loaded = mtplx.load(tmp_path)
    tokens = _random_tokens((1, 20), TINY.vocab_size)
    hidden = model.hidden(tokens)
    got_logits, got_hidden = loaded.forward(tokens)
    assert mx.abs(got_logits - model.lm_head(hidden)).max().item() < 1e-5
    want, want_out = model.head(hidden[:, :-1], tokens[:, 1:])
    got, got_out = loaded.head(got_hidden[:, :-1], tokens[:, 1:])
    assert mx.abs(got - want).max().item() < 1e-5
    want2, _ = model.head(want_out, tokens[:, 1:], depth=2)
    got2, _ = loaded.head(got_out, tokens[:, 1:], depth=2)
    assert mx.abs(got2 - want2).max().item() < 1e-5


def test_held_out_modules_never_reach_the_training_split():
    train_files, held = split_corpus(stdlib_sources())
    assert not any(is_held_out(f.module) for f in train_files)
    assert {f.module.split(".")[0] for f in held} == set(HELD_OUT_MODULES)


def test_function_examples_split_signature_docstring_and_body():
    text = (
        "class A:\n"
        "    @staticmethod\n"
        "    def f(x):\n"
        '        """Double x."""\n'
        "        return 2 * x\n"
        "def g():\n"
        '    """No body."""\n'
    )
    (ex,) = function_examples("m", text)
    assert ex.id == "m.A.f"
    assert ex.prompt == '@staticmethod\ndef f(x):\n    """Double x."""\n'
    assert ex.reference == "    return 2 * x\n"
    assert ex.signature == "def f(x):\n" and ex.summary == "Double x."


def test_short_training_run_writes_a_checkpoint_mtplx_loads_with_a_complete_head(tmp_path):
    from mtplx.training.tiny import train_tiny

    meta = train_tiny(
        tmp_path,
        steps=3,
        seed=0,
        shape=TINY,
        settings=TrainSettings(batch_size=2, seq_len=32, log_every=1),
        corpus_files=12,
        eval_prompts=4,
        eval_new_tokens=4,
        measure_costs=False,
        log=lambda _: None,
    )
    loaded = mtplx.load(tmp_path)
    assert loaded.head is not None and len(loaded.head.layers) == 1
    assert loaded.vocab_size == TINY.vocab_size
    written = json.loads((tmp_path / "training.json").read_text())
    assert written["steps"] == 3 and len(written["loss_curve"]) == 3
    assert written["corpus"]["held_out_modules"] == list(HELD_OUT_MODULES)
    assert all(np.isfinite(e["loss"]) for e in written["loss_curve"])
    assert meta["load_checks"]["tokenizer_round_trip"]["samples"] > 0


def test_training_is_deterministic_for_a_seed(tmp_path):
    from mtplx.training.tiny import train_tiny

    def run(out, seed):
        train_tiny(
            out,
            steps=2,
            seed=seed,
            shape=TINY,
            settings=TrainSettings(batch_size=2, seq_len=16, log_every=1),
            corpus_files=6,
            eval_prompts=2,
            eval_new_tokens=2,
            measure_costs=False,
            log=lambda _: None,
        )
        return mx.load(str(out / "model-00001-of-00001.safetensors")), (out / "tokenizer.json").read_text()

    (a, tok_a), (b, tok_b), (c, _) = run(tmp_path / "a", 0), run(tmp_path / "b", 0), run(tmp_path / "c", 1)
    assert tok_a == tok_b
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert not all(mx.array_equal(a[k], c[k]).item() for k in a)
