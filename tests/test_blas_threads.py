"""OpenBLAS's thread count: single-threaded decode cycles where their GEMMs
are too small to split, the starting count everywhere else."""

import mlx.core as mx
import pytest

from mtplx import blas_threads
from mtplx.blas_threads import OPENBLAS_SPLITS_FROM, SINGLE_THREAD_MNK, decode_threads, gemm_row_cost
from mtplx.loader import load
from mtplx.mtp_patch import MTPContract
from mtplx.runtime import MTPLXRuntime

openblas = pytest.mark.skipif(blas_threads.openblas_threads() is None, reason="OpenBLAS is not loaded in this process")


def test_decode_runs_single_threaded_only_between_openblas_split_and_the_cut_off():
    cost = 96 * 512  # the built-in model's largest GEMM row
    assert decode_threads(cost, 4) is None  # 196,608: OpenBLAS does not split it anyway
    assert decode_threads(cost, 12) == 1  # a batch-4 verify over 3 tokens
    assert decode_threads(cost, 64) is None  # 3.1M: two threads pay
    assert decode_threads(cost, (OPENBLAS_SPLITS_FROM + cost - 1) // cost) == 1
    assert decode_threads(cost, SINGLE_THREAD_MNK // cost + 1) is None
    assert decode_threads(None, 12) is None  # weights that never reach BLAS


def test_the_row_cost_is_the_largest_float32_matrix_and_none_in_half_precision(tiny_model):
    from mlx.utils import tree_flatten

    model = load(tiny_model)
    cfg = model.config.get("text_config", model.config)
    lm_head = cfg["vocab_size"] * cfg["hidden_size"]
    mlp = cfg["hidden_size"] * cfg["intermediate_size"]
    sizes = {w.shape[0] * w.shape[1] for _, w in tree_flatten(model.trunk.parameters()) if w.ndim == 2}
    cost = gemm_row_cost(model)
    assert cost >= max(lm_head, mlp) and cost in sizes
    model.trunk.set_dtype(mx.bfloat16)
    model.head.set_dtype(mx.bfloat16)
    assert gemm_row_cost(model) is None


@openblas
def test_decode_cycles_run_single_threaded_and_prefill_and_the_caller_keep_the_starting_count(tiny_model, monkeypatch):
    model = load(tiny_model)
    started = blas_threads.openblas_threads()
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    plain = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2).generate(prompts, max_tokens=12)

    # The test model's GEMMs are far below OpenBLAS's split: move the window onto them.
    monkeypatch.setattr(blas_threads, "OPENBLAS_SPLITS_FROM", 1)
    monkeypatch.setattr(blas_threads, "SINGLE_THREAD_MNK", 2 ** 40)
    rt = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2)
    seen = {"launch": set(), "prefill": set()}
    launch, prepare = rt._launch, rt.prepare

    def spy_launch(*args):
        out = launch(*args)
        seen["launch"].add(blas_threads.openblas_threads())
        return out

    def spy_prepare(*args):
        out = prepare(*args)
        seen["prefill"].add(blas_threads.openblas_threads())
        return out

    monkeypatch.setattr(rt, "_launch", spy_launch)
    monkeypatch.setattr(rt, "prepare", spy_prepare)
    got = rt.generate(prompts, max_tokens=12)
    assert seen == {"launch": {1}, "prefill": {started}}
    assert blas_threads.openblas_threads() == started
    assert [c.tokens for c in got] == [c.tokens for c in plain]  # below the real split the count changes nothing

    # A stream dropped after its first completion gives the count back too.
    from mtplx.completion import Request
    from mtplx.sampling import SamplingParams

    stream = rt.stream(iter([Request(index=i, prompt=p, sampling=SamplingParams(), max_tokens=30)
                             for i, p in enumerate(prompts)]))
    next(stream)
    assert blas_threads.openblas_threads() == 1  # mid-decode
    stream.close()
    assert blas_threads.openblas_threads() == started


@openblas
def test_bare_cost_passes_leave_openblas_as_it_started(tiny_model, monkeypatch):
    from mtplx.costs import BareCostSampler

    monkeypatch.setattr(blas_threads, "OPENBLAS_SPLITS_FROM", 1)
    monkeypatch.setattr(blas_threads, "SINGLE_THREAD_MNK", 2 ** 40)
    started = blas_threads.openblas_threads()
    sampler = BareCostSampler(load(tiny_model), 2, [1, 2], context=8)
    sampler.sample(1)
    assert blas_threads.openblas_threads() == started
    assert sampler.costs().verify_s[2] > 0
