"""The backend seam (mtplx.backends): the CPU takes MTPLX's CPU forms, any
other device mlx-lm's modules as loaded plus the algorithm's own forms."""

import mlx.core as mx
import numpy as np
import pytest
from model_helpers import make_predictable, mlx_lm_greedy

import mtplx
from mtplx import MTPContract, MTPLXRuntime, backends
from mtplx.decode.prepare import prepare_for_decoding
from mtplx.testing import tiny_checkpoint

GPU = mx.Device(mx.gpu)


def test_the_cpu_names_todays_cpu_forms_and_a_gpu_names_none():
    cpu = backends.forms(mx.Device(mx.cpu))
    gpu = backends.forms(GPU)
    assert set(cpu) == set(gpu)
    for concern in ("linear", "activations", "rope", "experts", "gated_delta_conv", "blas_threads"):
        assert cpu[concern].startswith("cpu."), concern
    assert cpu["probabilities_exp"] == "cpu.activations.pow_exp"
    assert "chunk-wise" in cpu["gated_delta_prefill"] and "one trunk layer" in cpu["pass_stages"]
    assert not any("cpu" in form.lower() for form in gpu.values())
    assert gpu["rope"] == "mx.fast.rope" and gpu["probabilities_exp"] == "mx.exp"
    assert backends.forms() == cpu  # this machine: MLX's CPU backend


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The seam answering as it does for a GPU device (MLX runs on the CPU here)."""
    monkeypatch.setattr(backends, "on_cpu", lambda device=None: False)


def _qwen(tmp_path):
    return mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "m", vocab_size=48))


def test_on_a_gpu_the_model_keeps_mlx_lms_modules_and_kernels(tmp_path, as_on_a_gpu):
    model = _qwen(tmp_path)
    classes = [type(m) for _, m in model.trunk.named_modules()]
    prepare_for_decoding(model)
    assert [type(m) for _, m in model.trunk.named_modules()] == classes
    assert all(c.__module__.startswith(("mlx.", "mlx_lm.")) for c in classes)
    assert "gemm_layout" not in model.info and "fast_activations" not in model.info
    assert not any(hasattr(layer.linear_attn, "conv_taps") for layer in model.text_model.layers if layer.is_linear)
    assert backends.pass_stages(model) == (0, None)
    assert not backends.CycleThreads(model).active
    x = mx.array(np.linspace(-30, 30, 101, dtype=np.float32))
    assert mx.array_equal(backends.probabilities_exp(x), mx.exp(x)).item()
    assert not backends.chunked_prefill(mx.zeros((1, 64, 8)))


def test_on_the_cpu_the_decoder_swaps_in_its_cpu_forms(tmp_path):
    model = _qwen(tmp_path)
    prepare_for_decoding(model)
    assert model.info["gemm_layout"] > 0 and model.info["fast_activations"] > 0
    assert all(hasattr(layer.linear_attn, "conv_taps") for layer in model.text_model.layers if layer.is_linear)
    assert backends.pass_stages(model)[0] == 1 and backends.CycleThreads(model).active


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_with_the_gpu_forms_greedy_speculation_equals_mlx_lm_greedy(tmp_path, as_on_a_gpu, family):
    model = make_predictable(mtplx.load(tiny_checkpoint(family, tmp_path / family, vocab_size=48)))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 48, size=n)] for n in (4, 9, 6)]
    refs = [mlx_lm_greedy(model, p, 12) for p in prompts]
    out = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2).generate(prompts, max_tokens=12)
    assert [c.tokens for c in out] == refs
    assert sum(sum(c.accepted_by_depth) for c in out) > 0  # rollback of partly accepted drafts was exercised
