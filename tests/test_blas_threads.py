"""OpenBLAS's thread count: single-threaded decode cycles where their GEMMs
are too small to split, the caller's count everywhere else."""

import mlx.core as mx
import pytest

from mtplx.backends.cpu import blas_threads
from mtplx.backends.cpu.blas_threads import OPENBLAS_SPLITS_ABOVE, SINGLE_THREAD_MNK, decode_threads, gemm_row_cost
from mtplx.decode.contract import MTPContract
from mtplx.decode.requests import Request
from mtplx.decode.sampling import SamplingParams
from mtplx.models.loader import load
from mtplx.runtime import MTPLXRuntime

# Switching is only observable where OpenBLAS is loaded and starts with several threads.
switching = pytest.mark.skipif(
    (blas_threads.openblas_threads() or 1) < 2, reason="no OpenBLAS with several threads in this process"
)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]


@pytest.fixture
def forced(monkeypatch):
    """The test model's GEMMs are far below OpenBLAS's split: move the window onto them."""
    monkeypatch.setattr(blas_threads, "OPENBLAS_SPLITS_ABOVE", 0)
    monkeypatch.setattr(blas_threads, "SINGLE_THREAD_MNK", 2**40)


def test_decode_runs_single_threaded_only_between_openblas_split_and_the_cut_off():
    cost = 96 * 512  # the built-in model's largest GEMM row
    assert decode_threads(cost, 4) is None  # 196,608: OpenBLAS does not split it anyway
    assert decode_threads(cost, 12) == 1  # a batch-4 verify over 3 tokens
    assert decode_threads(cost, 64) is None  # 3.1M: two threads pay
    assert decode_threads(1, OPENBLAS_SPLITS_ABOVE) is None  # OpenBLAS splits only above it
    assert decode_threads(1, OPENBLAS_SPLITS_ABOVE + 1) == 1
    assert decode_threads(1, SINGLE_THREAD_MNK) is None
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


def _spy_on_counts(monkeypatch, rt):
    """The OpenBLAS count at every evaluation a cycle launch starts, and after each prefill."""
    seen = {"cycle": set(), "prefill": set()}
    launching = []
    import mtplx.decode.runtime as runtime

    real_async_eval, prepare, launch = runtime.mx.async_eval, rt.prepare, rt._launch

    def async_eval(*arrays):
        if launching:  # the prefill's last step starts its stages too
            seen["cycle"].add(blas_threads.openblas_threads())
        return real_async_eval(*arrays)

    def spy_launch(*args):
        launching.append(True)
        try:
            return launch(*args)
        finally:
            launching.pop()

    def spy_prepare(*args):
        out = prepare(*args)
        seen["prefill"].add(blas_threads.openblas_threads())
        return out

    monkeypatch.setattr(runtime.mx, "async_eval", async_eval)
    monkeypatch.setattr(rt, "prepare", spy_prepare)
    monkeypatch.setattr(rt, "_launch", spy_launch)
    return seen


@switching
def test_a_cycle_is_launched_single_threaded_prefill_at_the_callers_count_and_outputs_do_not_change(
    tiny_model, monkeypatch, forced
):
    model = load(tiny_model)
    callers = blas_threads.openblas_threads()
    monkeypatch.setattr(blas_threads, "SINGLE_THREAD_MNK", 0)  # never single-threaded
    plain = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2).generate(PROMPTS, max_tokens=12)
    monkeypatch.setattr(blas_threads, "SINGLE_THREAD_MNK", 2**40)
    rt = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2)
    seen = _spy_on_counts(monkeypatch, rt)
    got = rt.generate(PROMPTS, max_tokens=12)
    assert seen == {"cycle": {1}, "prefill": {callers}}
    assert blas_threads.openblas_threads() == callers
    # Below OpenBLAS's real split the count cannot change a GEMM: outputs must not move.
    assert [(c.tokens, c.steps) for c in got] == [(c.tokens, c.steps) for c in plain]


@switching
def test_a_switch_waits_for_the_work_in_flight(monkeypatch, forced, tiny_model):
    events = []
    lib = blas_threads._openblas()
    real_set, real_sync = lib.openblas_set_num_threads, mx.synchronize

    class Lib:  # the library, recording each switch
        def openblas_get_num_threads(self):
            return lib.openblas_get_num_threads()

        def openblas_set_num_threads(self, n):
            events.append(("set", n))
            real_set(n)

    monkeypatch.setattr(blas_threads, "_openblas", lambda: Lib())
    monkeypatch.setattr(blas_threads.mx, "synchronize", lambda: (events.append(("sync",)), real_sync())[1])
    MTPLXRuntime(load(tiny_model), MTPContract(depth=2), max_batch=2).generate(PROMPTS, max_tokens=12)
    sets = [i for i, e in enumerate(events) if e[0] == "set"]
    assert len(sets) >= 2
    assert all(i > 0 and events[i - 1] == ("sync",) for i in sets)


@switching
def test_the_caller_gets_its_count_back_between_completions_and_after_an_early_close(tiny_model, forced):
    rt = MTPLXRuntime(load(tiny_model), MTPContract(depth=2), max_batch=2)
    callers = blas_threads.openblas_threads()
    stream = rt.stream(
        iter([Request(index=i, prompt=p, sampling=SamplingParams(), max_tokens=30) for i, p in enumerate(PROMPTS)])
    )
    next(stream)
    assert blas_threads.openblas_threads() == callers  # paused at a completion
    next(stream)
    assert blas_threads.openblas_threads() == callers
    stream.close()
    assert blas_threads.openblas_threads() == callers


@switching
def test_generate_gives_the_callers_count_back_once_at_the_end_not_at_every_completion(tiny_model, forced, monkeypatch):
    rt = MTPLXRuntime(load(tiny_model), MTPContract(depth=2), max_batch=2)
    callers = blas_threads.openblas_threads()
    released = []
    real = rt.threads.release
    monkeypatch.setattr(rt.threads, "release", lambda: (released.append(rt), real()))
    out = rt.generate(PROMPTS, max_tokens=12)
    assert len(out) == len(PROMPTS) and released == [rt]  # each give-back waits for the cycle in flight
    assert blas_threads.openblas_threads() == callers


@switching
def test_a_runtime_respects_a_count_the_caller_set(tiny_model, forced):
    lib = blas_threads._openblas()
    callers = lib.openblas_get_num_threads()
    rt = MTPLXRuntime(load(tiny_model), MTPContract(depth=2), max_batch=2)
    rt.generate(PROMPTS[:2], max_tokens=4)
    try:
        lib.openblas_set_num_threads(callers - 1)  # as threadpoolctl's limits do
        rt.generate(PROMPTS, max_tokens=8)
        assert lib.openblas_get_num_threads() == callers - 1
    finally:
        lib.openblas_set_num_threads(callers)


@switching
def test_a_stream_left_unfinished_does_not_switch_the_count_under_another_runtime(tiny_model, forced):
    model = load(tiny_model)
    a = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2)
    b = MTPLXRuntime(model, MTPContract(depth=2), max_batch=2)
    requests = [Request(index=i, prompt=p, sampling=SamplingParams(), max_tokens=30) for i, p in enumerate(PROMPTS)]
    left = a.stream(iter(requests))
    next(left)  # a holds nothing while paused, but its stream is still open
    batch = b._stream(iter(requests), 0)  # b's decode loop, without the completions' hand-back
    next(batch)
    assert blas_threads.openblas_threads() == 1  # b holds the count
    left.close()  # as the garbage collector would, at any moment
    assert blas_threads.openblas_threads() == 1
    batch.close()
    b.threads.release()


@switching
def test_bare_cost_passes_run_at_their_cycles_counts_and_give_the_count_back(tiny_model, forced):
    from mtplx.autodepth.costs import BareCostSampler

    callers = blas_threads.openblas_threads()
    sampler = BareCostSampler(load(tiny_model), 2, [1, 2], context=8)
    for name, run in sampler.passes.items():
        mx.eval(run())
        assert blas_threads.openblas_threads() == 1, name
    sampler.sample(1)
    assert blas_threads.openblas_threads() == callers
    assert sampler.costs().verify_s[2] > 0
