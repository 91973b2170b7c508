"""Slot caches: writing rows in place of a scatter; the span a compiled pass reads."""

import mlx.core as mx
import pytest

from mtplx.decode.cache import put_rows


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 2], [3], [0, 2], [3, 1], [2, 1, 0]])
@pytest.mark.parametrize("scalar", [False, True])
def test_put_rows_writes_exactly_what_a_scatter_writes(rows, scalar):
    full = mx.random.normal((4, 2, 5, 3))  # [B, H, C, D]
    values = 0.0 if scalar else mx.random.normal((len(rows), 2, 5, 3))
    expected = mx.array(full)
    expected[mx.array(rows)] = values
    got = put_rows(mx.array(full), rows, values)
    assert got.shape == full.shape and got.dtype == full.dtype
    assert mx.array_equal(got, expected).item()


def test_put_rows_casts_to_the_caches_dtype_and_leaves_an_empty_set_alone():
    full = mx.zeros((3, 4), dtype=mx.int32)
    assert put_rows(full, [], mx.ones((0, 4))) is full
    got = put_rows(full, [1, 2], mx.full((2, 4), 7.0))
    assert got.dtype == mx.int32 and got.tolist() == [[0] * 4, [7] * 4, [7] * 4]


def test_read_span_rounds_up_to_a_whole_bucket_within_the_capacity():
    from mtplx.decode.cache import SPAN_BUCKET, read_span

    b = SPAN_BUCKET
    assert read_span(1, 4 * b) == b
    assert read_span(b, 4 * b) == b
    assert read_span(b + 1, 4 * b) == 2 * b
    assert read_span(4 * b + 1, 8 * b) == 5 * b
    assert read_span(3 * b + 1, 3 * b + 8) == 3 * b + 8  # never past the capacity


@pytest.mark.parametrize("T", [1, 3])
def test_a_compiled_pass_reading_a_bucket_gives_the_logits_of_one_reading_the_whole_capacity(tmp_path, monkeypatch, T):
    import mtplx
    import mtplx.decode.cache as cache
    from mtplx.decode.cache import make_slot_caches
    from mtplx.decode.passes import SlotPass, common_span
    from mtplx.testing import tiny_checkpoint

    model = mtplx.load(tiny_checkpoint("qwen3_5", tmp_path / "ckpt", vocab_size=64))
    prompts = mx.array([[(7 * b + 3 * i) % 60 + 1 for i in range(20)] for b in range(3)])  # [3, 20]
    tokens = mx.array([[5, 9, 11][:T]] * 3)  # [3, T]
    results, read = {}, set()
    make_mask = cache.SlotKVCache.make_mask

    def recording_mask(self, N, *args, **kwargs):
        read.add(self.host_max + N)  # the positions the attention reads
        return make_mask(self, N, *args, **kwargs)

    monkeypatch.setattr(cache.SlotKVCache, "make_mask", recording_mask)
    for bucket in (64, 1 << 20):  # the second reads every position of the capacity
        monkeypatch.setattr(cache, "SPAN_BUCKET", bucket)
        caches = make_slot_caches(model.layer_kinds, 3)
        model.forward(prompts, caches)
        read.clear()
        kv = next(c for c in caches if isinstance(c, cache.SlotKVCache))
        span = common_span(caches, kv.host_max + T)
        logits, _ = SlotPass(model.forward, keep_pending=T > 1)((tokens,), caches, T=T)
        mx.eval(logits)
        assert read == {span}, (read, span)  # what the traced pass read
        results[span] = logits
    assert sorted(results) == [64, kv.keys.shape[2]] and kv.keys.shape[2] > 64  # the two passes read apart
    short, whole = results[64], results[kv.keys.shape[2]]
    assert mx.allclose(short, whole, rtol=0, atol=1e-6).item()
