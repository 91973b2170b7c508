"""Slot caches: writing rows in place of a scatter."""

import mlx.core as mx
import pytest

from mtplx.cache import put_rows


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
