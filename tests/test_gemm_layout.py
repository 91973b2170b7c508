"""Dense weights re-laid for the CPU's GEMM (mtplx.backends.cpu.gemm_layout): the same
values, and decoding that does not depend on batch size or verify width."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mtplx
from mtplx import MTPContract, MTPLXRuntime
from mtplx.assets import default_model_path
from mtplx.backends.cpu.gemm_layout import lay_out_for_cpu_gemm
from mtplx.decode.cache import make_slot_caches
from mtplx.decode.passes import SlotPass
from mtplx.decode.sampling import SamplingParams

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the layout is for the CPU backend")


@pytest.fixture(scope="module")
def model():
    model = mtplx.load(default_model_path())
    MTPLXRuntime(model)  # a runtime re-lays the weights it decodes with
    return model


def test_load_keeps_mlx_lms_layout_and_a_runtime_relays_the_same_values_once():
    import mlx_lm

    loaded = mtplx.load(default_model_path())
    reference, _ = mlx_lm.load(str(default_model_path()))
    tokens = mx.array([np.random.default_rng(0).integers(1, 500, 5).tolist()])
    assert "gemm_layout" not in loaded.info
    assert mx.array_equal(loaded.trunk(tokens), reference(tokens)).item()
    before = dict(tree_flatten(loaded.trunk.parameters()))
    MTPLXRuntime(loaded)
    count = loaded.info["gemm_layout"]
    assert count > 0 and lay_out_for_cpu_gemm(loaded) == count
    after = dict(tree_flatten(loaded.trunk.parameters()))
    assert after.keys() == before.keys()
    assert all(after[k].shape == before[k].shape and mx.array_equal(after[k], before[k]).item() for k in after)
    got, want = loaded.trunk(tokens), reference(tokens)
    assert mx.abs(got - want).max().item() < 1e-4 * mx.abs(want).max().item()


def _blas_gemm_is_row_invariant() -> bool:
    """Whether this BLAS computes a row of x @ W (W re-laid) the same way
    whatever the number of rows, at the shapes the built-in model decodes
    with. OpenBLAS's SkylakeX-family kernels do; its Haswell/Zen kernels
    (AVX2-only CPUs) send a one-row product down a different path, ~1e-6 off."""
    rng = np.random.default_rng(2)
    for n_in, n_out in ((96, 512), (288, 96)):
        w = mx.contiguous(mx.array(rng.standard_normal((n_in, n_out)), dtype=mx.float32)).T  # [out, in], re-laid
        x = mx.array(rng.standard_normal((64, n_in)), dtype=mx.float32)
        one = x[:1] @ w.T
        if not all(mx.array_equal((x[:rows] @ w.T)[:1], one).item() for rows in (2, 4, 8, 16, 64)):
            return False
    return True


bit_exact_blas = pytest.mark.skipif(
    not _blas_gemm_is_row_invariant(), reason="this BLAS's GEMM result for a row depends on the number of rows"
)


def _decode_logits(model, prompts, tokens, T):
    """Logits of a pass over tokens[:, :T] after prefilling prompts [B, L]."""
    caches = make_slot_caches(model.layer_kinds, len(prompts))
    model.forward(mx.array(prompts), caches)
    logits, _ = SlotPass(model.forward, keep_pending=T > 1)((mx.array(tokens)[:, :T],), caches, T=T)
    return logits  # [B, T, V]


@bit_exact_blas
def test_a_rows_decode_logits_are_bit_identical_at_any_batch_size_and_verify_width(model):
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, 500, (16, 12)).tolist()  # one length: no padding in the prefill
    tokens = rng.integers(1, 500, (16, 4)).tolist()
    alone = _decode_logits(model, prompts[:1], tokens[:1], 1)[0, 0]
    for B in (1, 4, 16):
        for T in (1, 2, 4):
            got = _decode_logits(model, prompts[:B], tokens[:B], T)[0, 0]
            assert mx.array_equal(got, alone).item(), f"batch {B}, verify width {T}"


@bit_exact_blas
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_emits_plain_decodings_tokens_and_logprobs_bit_for_bit(model, temperature):
    prompts = ["def add(a, b):\n", "class Stack:\n    def push(self, x):\n", "import os\n\n"]
    sp = SamplingParams(temperature=temperature)
    runs = {
        depth: MTPLXRuntime(model, MTPContract(depth=depth, acceptance="coupled"), max_batch=2).generate(
            prompts, sampling=sp, max_tokens=24, seed=3, logprobs=True
        )
        for depth in (0, 2)
    }
    for plain, spec in zip(runs[0], runs[2]):
        assert spec.tokens == plain.tokens
        assert spec.logprobs == plain.logprobs  # floats compared exactly
    assert sum(sum(c.accepted_by_depth) for c in runs[2]) > 0


def test_a_relaid_linear_multiplies_by_its_in_out_array_and_honours_a_replaced_weight():
    import mlx.nn as nn

    from mtplx.backends.cpu.gemm_layout import RelaidLinear, _relay_linears

    rng = np.random.default_rng(3)
    for bias in (True, False):
        layer = nn.Linear(48, 40, bias=bias)
        x = mx.array(rng.standard_normal((2, 3, 48)), dtype=mx.float32)
        want = layer(x)
        assert _relay_linears(layer) == 1 and type(layer) is RelaidLinear
        assert sorted(k for k, _ in tree_flatten(layer.parameters())) == (["bias", "weight"] if bias else ["weight"])
        got = layer(x)
        # The same GEMM as x @ weight.T on the re-laid weight: bit for bit, with no Transpose node.
        assert mx.array_equal(got, x @ layer.weight.T + (layer.bias if bias else 0)).item()
        assert mx.abs(got - want).max().item() < 1e-5
        layer.load_weights([("weight", mx.zeros((40, 48)))], strict=False)  # a weight set later is the one used
        assert mx.array_equal(layer(x), mx.broadcast_to(layer.bias if bias else mx.zeros((40,)), (2, 3, 40))).item()


@pytest.mark.parametrize("T", [1, 4, 20])  # a step, a verify, a prompt chunk (the fast-exp forms)
def test_projections_over_token_rows_give_the_batched_matmuls_values_bit_for_bit(model, monkeypatch, T):
    from mtplx.backends.cpu import activations as cpu_activations

    rng = np.random.default_rng(4)
    prompts = rng.integers(1, 500, (3, 12)).tolist()
    tokens = rng.integers(1, 500, (3, T)).tolist()
    rows = _decode_logits(model, prompts, tokens, T)
    monkeypatch.setattr(cpu_activations, "token_rows", lambda x: x)  # every projection over the [B, T, D] input itself
    batched = _decode_logits(model, prompts, tokens, T)
    assert rows.shape == batched.shape == (3, T, model.vocab_size)
    assert mx.array_equal(rows, batched).item()
