"""The trunk pass run as a chain of per-layer graphs (mtplx.decode.passes.StagedPass)."""

import mlx.core as mx
import numpy as np
import pytest
from model_helpers import prefilled_slot_caches, slot_cache_state

import mtplx
import mtplx.decode.passes as compiled
from mtplx.decode.cache import SlotKVCache
from mtplx.decode.passes import SlotPass, StagedPass
from mtplx.testing import tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # qwen3_5 mixes gated-delta and attention layers, so stages hold both kinds.
    return mtplx.load(tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("ckpt"), vocab_size=64))


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("layers_per_stage", [1, 2])
def test_a_staged_pass_leaves_the_logits_caches_and_pending_states_of_the_one_graph_pass(model, T, layers_per_stage):
    tokens = mx.array([[5, 9, 11][:T]] * 3)  # [3, T]
    one, staged = prefilled_slot_caches(model), prefilled_slot_caches(model)
    want = SlotPass(model.forward, keep_pending=True)((tokens,), one, T=T)
    run = StagedPass(model, keep_pending=True, layers_per_stage=layers_per_stage)
    assert len(run.stages) == -(-len(model.layer_kinds) // layers_per_stage) > 1
    got = run((tokens,), staged, T=T)
    for w, g in zip([*want, *slot_cache_state(one)], [*got, *slot_cache_state(staged)], strict=True):
        assert w.shape == g.shape and mx.allclose(w, g, rtol=0, atol=1e-6).item()
    for a, b in zip(one, staged):
        if isinstance(a, SlotKVCache):
            assert a.host_max == b.host_max


def test_each_stage_is_started_before_the_next_is_built(model, monkeypatch):
    """The point of staging: the host builds stage i+1 while stage i runs."""
    events = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(compiled.mx, "async_eval", lambda *a: (events.append("start"), real_async_eval(*a))[1])
    run = StagedPass(model, keep_pending=False, layers_per_stage=1)

    def recording(i, stage):
        def call(inputs, caches, T, shared=None):
            events.append(f"build {i}")
            return stage(inputs, caches, T, shared)

        return call

    run.stages = [(layers, recording(i, stage)) for i, (layers, stage) in enumerate(run.stages)]
    logits, _ = run((mx.array([[5]] * 3),), prefilled_slot_caches(model), T=1)
    mx.eval(logits)
    n = len(model.layer_kinds)
    assert events == [e for i in range(n) for e in (f"build {i}", "start")][:-1]


def test_the_runtime_stages_its_trunk_pass_a_layer_at_a_time_on_the_cpu(model):
    from mtplx.decode.contract import MTPContract
    from mtplx.runtime import MTPLXRuntime

    if mx.default_device() != mx.cpu:
        pytest.skip("on a GPU the pass stays one graph")
    rt = MTPLXRuntime(model, MTPContract(depth=1), max_batch=2)
    assert [s.stop - s.start for s, _ in rt._verify.stages] == [1] * len(
        model.layer_kinds
    )  # one layer a stage on the CPU


def test_attention_layers_holding_one_lengths_array_make_their_mask_and_write_index_once_per_pass(model, monkeypatch):
    """PassPositions: over caches that hold one lengths array (the runtime's
    trunk after a commit) a staged pass makes the mask and write index once
    for all its attention layers, and leaves exactly what a pass making them
    per layer leaves."""
    T = 3
    tokens = mx.array([[5, 9, 11]] * 3)  # [3, T]
    per_layer, shared = prefilled_slot_caches(model), prefilled_slot_caches(model, one_lengths=True)
    made = []
    real = compiled.pass_positions
    monkeypatch.setattr(compiled, "pass_positions", lambda *a: (made.append(a[1:]), real(*a))[1])
    run = StagedPass(model, keep_pending=True, layers_per_stage=1)
    want = run((tokens,), per_layer, T=T)
    n_attention = model.layer_kinds.count("attn")
    assert n_attention > 1 and len(made) == n_attention
    made.clear()
    got = run((tokens,), shared, T=T)
    assert len(made) == 1
    for w, g in zip([*want, *slot_cache_state(per_layer)], [*got, *slot_cache_state(shared)], strict=True):
        assert w.shape == g.shape and mx.array_equal(w, g).item()


def test_a_commit_hands_every_trunk_attention_cache_one_lengths_array(model):
    from mtplx.decode.slots import SlotBatch

    batch = SlotBatch(model, size=3, depth=2)
    kv = [c for c in batch.trunk if isinstance(c, SlotKVCache)]
    for c in kv:
        c.lengths = mx.array([4, 7, 0], dtype=mx.int32)  # equal values, separate arrays
    batch.commit_trunk(batch.trunk_lengths(), mx.array([2, 3, 0], dtype=mx.int32), all_kept=False, span=12)
    assert len(kv) > 1 and all(c.lengths is kv[0].lengths for c in kv)
    assert kv[0].lengths.tolist() == [6, 10, 0] and all(c.host_max == 12 for c in kv)


def test_conv_taps_split_ahead_of_the_passes_leave_what_splitting_in_every_pass_leaves(model):
    """backends.cpu.conv.prepare_conv_taps: the gated-delta conv's taps split once
    give the same logits and caches bit for bit, and a conv weight replaced
    after the split is used, not the stale taps."""
    from mlx.utils import tree_flatten

    from mtplx.backends.cpu.conv import prepare_conv_taps

    tokens = mx.array([[5, 9, 11]] * 3)  # [3, T]
    gdns = [l.linear_attn for l in model.text_model.layers if hasattr(l, "linear_attn")]
    assert gdns

    def run():
        caches = prefilled_slot_caches(model)
        out = SlotPass(model.forward, keep_pending=True)((tokens,), caches, T=3)
        mx.eval(out, slot_cache_state(caches))
        return [*out, *slot_cache_state(caches)]

    for g in gdns:
        g.__dict__.pop("conv_taps", None)
    per_pass = run()
    prepare_conv_taps(model)
    assert all(len(g.conv_taps[1]) == g.conv1d.weight.shape[1] for g in gdns)
    assert not any("conv_taps" in k for k, _ in tree_flatten(model.trunk.parameters()))
    split_once = run()
    assert all(mx.array_equal(a, b).item() for a, b in zip(per_pass, split_once, strict=True))
    first = gdns[0]
    old = first.conv1d.weight
    try:
        first.conv1d.weight = old * 2.0
        changed = run()
        assert not all(mx.array_equal(a, b).item() for a, b in zip(split_once, changed))
    finally:
        first.conv1d.weight = old


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gated_delta_q_and_k_normalised_side_by_side_are_mlx_lms_normalize_qk_bit_for_bit(dtype):
    from types import SimpleNamespace

    from mlx_lm.models.gated_delta import normalize_qk

    from mtplx.models.families.qwen import split_qkv

    Hk, Dk, Hv, Dv = 2, 32, 4, 24
    gdn = SimpleNamespace(num_k_heads=Hk, head_k_dim=Dk, num_v_heads=Hv, head_v_dim=Dv, key_dim=Hk * Dk)
    conv_out = mx.array(np.random.default_rng(6).normal(0, 3, (3, 5, 2 * Hk * Dk + Hv * Dv)).astype(np.float32))
    conv_out = conv_out.astype(dtype)
    q, k, v = split_qkv(gdn, conv_out)
    q_in, k_in, v_in = (
        t.reshape(3, 5, -1, d) for t, d in zip(mx.split(conv_out, [Hk * Dk, 2 * Hk * Dk], -1), (Dk, Dk, Dv))
    )
    q_ref, k_ref = normalize_qk(q_in, k_in, inv_scale=Dk**-0.5, eps=1e-6)
    assert q.dtype == dtype and q.shape == (3, 5, Hk, Dk) and v.shape == (3, 5, Hv, Dv)
    assert mx.array_equal(q, q_ref).item() and mx.array_equal(k, k_ref).item() and mx.array_equal(v, v_in).item()
    assert not mx.array_equal(q, k_ref).item()  # q and k carry different scales
