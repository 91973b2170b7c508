"""RoPE angles a trunk pass makes once for all its attention layers (mtplx.rope_angles)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from model_helpers import prefilled_slot_caches, slot_cache_state

import mtplx
import mtplx.backends.cpu.rope_angles as rope_angles_module
import mtplx.decode.cache as cache_module
from mtplx.backends.cpu.activations import shared_rope_spec
from mtplx.backends.cpu.rope_angles import RopeSpec, matches_fast_rope, rope_angles, rotate
from mtplx.decode.passes import StagedPass, trunk_pass
from mtplx.decode.prepare import prepare_for_decoding
from mtplx.testing import tiny_checkpoint

SPECS = [RopeSpec(6, 10000.0, 1.0), RopeSpec(64, 1e6, 1.0), RopeSpec(32, 500000.0, 0.25)]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("offsets,T", [([0, 5, 4093], 3), ([77], 1), ([131071, 2], 4)])
def test_rotating_with_a_pass_angles_gives_the_bits_of_fast_rope(spec, dtype, offsets, T):
    lengths = mx.array(offsets, dtype=mx.int32)
    for head_dim in (spec.dims, spec.dims + 18):  # all of a head rotated, and a part of it
        x = (mx.random.normal((len(offsets), 3, T, head_dim), key=mx.random.key(head_dim)) * 4).astype(dtype)
        cos, sin = rope_angles(lengths, T, spec)
        ours = rotate(x, spec.dims, cos, sin)
        theirs = mx.fast.rope(x, spec.dims, traditional=False, base=spec.base, scale=spec.scale, offset=lengths)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert mx.array_equal(ours, theirs).item()


def test_an_inverse_frequency_constant_one_unit_off_fails_the_bit_check(monkeypatch):
    """The check a pass relies on can fail: the fallback's constant
    log(base)/(dims/2) is float32, and one unit in its last place moves the
    rotated values."""
    spec = SPECS[1]
    assert matches_fast_rope(spec, 64, mx.float32)
    right = rope_angles_module._logf(spec.base)
    monkeypatch.setattr(rope_angles_module, "_logf", lambda x: float(np.nextafter(np.float32(right), np.float32(1e9))))
    matches_fast_rope.cache_clear()
    rope_angles_module._inverse_frequencies.cache_clear()
    try:
        assert not matches_fast_rope(spec, 64, mx.float32)
    finally:
        matches_fast_rope.cache_clear()
        rope_angles_module._inverse_frequencies.cache_clear()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("ckpt"), vocab_size=64))
    prepare_for_decoding(m)  # the attention that reads a pass's angles (mtplx.backends.cpu.activations)
    return m


@pytest.mark.parametrize("T", [1, 3])
def test_a_trunk_pass_makes_its_rope_angles_once_and_leaves_the_bits_of_rotating_per_layer(model, monkeypatch, T):
    spec = shared_rope_spec(model)
    assert spec is not None and trunk_pass(model, keep_pending=True).stages[0][1].rope == spec
    tokens = mx.array([[5, 9, 11][:T]] * 3)  # [3, T]
    per_layer, shared = (prefilled_slot_caches(model, one_lengths=True) for _ in range(2))
    want = StagedPass(model, keep_pending=True, layers_per_stage=1)((tokens,), per_layer, T=T)
    made = []
    real = cache_module.rope_angles
    monkeypatch.setattr(cache_module, "rope_angles", lambda *a: (made.append(a[1:]), real(*a))[1])
    got = StagedPass(model, keep_pending=True, layers_per_stage=1, rope=spec)((tokens,), shared, T=T)
    assert model.layer_kinds.count("attn") > 1 and made == [(T, spec)]
    for w, g in zip([*want, *slot_cache_state(per_layer)], [*got, *slot_cache_state(shared)], strict=True):
        assert w.shape == g.shape and mx.array_equal(w, g).item()


def test_no_shared_angles_where_an_attention_layer_rotates_another_way(model, tmp_path):
    first = next(l.self_attn for l, k in zip(model.text_model.layers, model.layer_kinds) if k == "attn")
    plain = first.rope
    try:
        first.rope = nn.RoPE(plain.dims, traditional=True, base=plain.base)
        assert shared_rope_spec(model) is None
    finally:
        first.rope = plain
    assert shared_rope_spec(model) is not None
    unprepared = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path, vocab_size=64))
    assert shared_rope_spec(unprepared) is None  # mlx-lm's own attention rotates with mx.fast.rope


def test_bare_passes_hand_every_attention_layer_one_lengths_array(model, monkeypatch):
    """The bare costs' trunk passes start as the runtime's do after a commit,
    so they make their positions and angles once per pass, as its cycles do."""
    from mtplx.autodepth.costs import BareCostSampler

    sampler = BareCostSampler(model, 2, depths=[2], context=6)
    made = []
    real = cache_module.rope_angles
    monkeypatch.setattr(cache_module, "rope_angles", lambda *a: (made.append(a[1]), real(*a))[1])
    for name in ("step", 2):
        mx.eval(sampler.passes[name]())
    assert made == [1, 3]
