"""Held-out measurements of a trained model: loss, acceptance and cost.

Teacher-forced acceptance follows the trunk's own greedy continuations, what greedy speculation is scored
against: depth 1 at t, the head's argmax from (h_t, x_{t+1}) is the trunk's x_{t+2}; depth 2 (cumulative),
the head fed its own output and depth-1 draft also gives the trunk's x_{t+3}.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

import mlx.core as mx
import numpy as np

from mtplx.autodepth.costs import interleaved_times


def windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """`count` evenly spaced windows of `length` tokens [count, length]."""
    if len(stream) < length:
        raise ValueError("stream shorter than one window")
    starts = np.linspace(0, len(stream) - length, num=count).astype(np.int64)
    return np.stack([stream[s : s + length] for s in starts])


def held_out_loss(model, stream: np.ndarray, seq_len: int = 192, count: int = 32, batch: int = 8) -> Dict[str, float]:
    """Mean cross-entropy (nats/token) of the trunk and of the head at depth 1 and 2 (recursive, cache-free)
    on held-out windows; `model` is an MTPModel."""
    import mlx.nn as nn

    data = windows(stream, seq_len + 1, count)
    sums = np.zeros(3)
    for i in range(0, count, batch):
        tokens = mx.array(data[i : i + batch])  # [b, N]
        logits, hidden = model.forward(tokens)  # [b, N, V], [b, N, H]
        l1, out1 = model.head(hidden[:, :-1], tokens[:, 1:])  # [b, N-1, V]
        l2, _ = model.head(out1[:, :-1], tokens[:, 2:], depth=2)  # [b, N-2, V]
        ce = lambda lg, tg: nn.losses.cross_entropy(lg.astype(mx.float32), tg, reduction="mean").item()
        n = tokens.shape[0]
        sums += n * np.array(
            [ce(logits[:, :-1], tokens[:, 1:]), ce(l1[:, :-1], tokens[:, 2:]), ce(l2[:, :-1], tokens[:, 3:])]
        )
    trunk, d1, d2 = (sums / count).tolist()
    return {
        "trunk_ce": round(trunk, 4),
        "head_d1_ce": round(d1, 4),
        "head_d2_ce": round(d2, 4),
        "windows": count,
        "seq_len": seq_len,
    }


def greedy_continue(model, prompts: mx.array, new_tokens: int) -> mx.array:
    """Trunk-only greedy decoding of equal-length prompts [B, P] -> [B, P + new]."""
    cache = model.make_cache()
    logits, _ = model.forward(prompts, cache)  # [B, P, V]
    out = [prompts]
    for i in range(new_tokens):
        nxt = mx.argmax(logits[:, -1], axis=-1)[:, None]  # [B, 1]
        out.append(nxt)
        if i + 1 < new_tokens:
            logits, _ = model.forward(nxt, cache)
    return mx.concatenate(out, axis=1)


def teacher_forced_acceptance(
    model, prompts: Sequence[Sequence[int]], new_tokens: int = 64, prompt_len: int = 48, batch: int = 16
) -> Dict:
    """Greedy acceptance at depth 1 and cumulative depth 2 over the trunk's greedy continuation of each
    prompt's last `prompt_len` tokens; the head's cache kept as the runtime keeps it."""
    from mlx_lm.models.cache import KVCache

    rows = [list(p)[-prompt_len:] for p in prompts if len(p) >= prompt_len]
    if not rows:
        raise ValueError(f"no prompt has {prompt_len} tokens")
    hits = np.zeros(2)
    drafted = 0
    for i in range(0, len(rows), batch):
        seq = greedy_continue(model, mx.array(rows[i : i + batch]), new_tokens)  # [B, L]
        logits, hidden = model.forward(seq)  # [B, L, V], [B, L, H]
        target = mx.argmax(logits, axis=-1)  # [B, L] trunk's choice for the next position
        P, L = prompt_len, seq.shape[1]
        cache = [KVCache() for _ in range(len(model.head.layers))]
        # The head's history over the prompt: pairs (h_t, x_{t+1}) for t < P-2.
        model.head(hidden[:, : P - 2], seq[:, 1 : P - 1], cache)
        for t in range(P - 2, L - 2):
            l1, out1 = model.head(hidden[:, t : t + 1], seq[:, t + 1 : t + 2], cache)  # [B, 1, V]
            d1 = mx.argmax(l1[:, -1], axis=-1)  # [B]
            l2, _ = model.head(out1, d1[:, None], cache, depth=2)
            d2 = mx.argmax(l2[:, -1], axis=-1)
            for c in cache:
                c.trim(1)  # the depth-2 entry used the head's own hidden: roll back
            ok1 = d1 == target[:, t + 1]
            ok2 = ok1 & (d2 == target[:, t + 2])
            hits += np.array([ok1.sum().item(), ok2.sum().item()])
            drafted += int(d1.shape[0])
    return {
        "depth1": round(float(hits[0] / drafted), 4),
        "depth2_cumulative": round(float(hits[1] / drafted), 4),
        "positions": drafted,
        "prompts": len(rows),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }


def runtime_acceptance(
    model,
    prompts: Sequence[Sequence[int]],
    temperature: float,
    depth: int = 3,
    max_tokens: int = 64,
    batch: int = 16,
    seed: int = 0,
) -> Dict:
    """Cumulative acceptance by depth 1..`depth` of MTPLXRuntime itself decoding `prompts` at `temperature`:
    unlike the teacher-forced figure it includes what the runtime's own drafting loses and, under sampling,
    the residual rule's acceptance, which is what `depth="auto"` has to predict."""
    from mtplx.bench.run import acceptance_summary
    from mtplx.decode.contract import MTPContract
    from mtplx.decode.sampling import SamplingParams
    from mtplx.runtime import MTPLXRuntime

    rt = MTPLXRuntime(model, MTPContract(depth=depth), max_batch=batch)
    outs = rt.generate(
        list(prompts), sampling=SamplingParams(temperature=temperature), max_tokens=max_tokens, seed=seed
    )
    acc = acceptance_summary(outs, depth)  # docs/design.md "Metrics", as the bench reports it
    return {
        "by_depth": [None if a is None else round(a, 4) for a in acc["acceptance_by_depth"]],
        "temperature": temperature,
        "row_cycles": acc["row_cycles"],
        "prompts": len(outs),
        "max_tokens": max_tokens,
    }


def _cost_row(times: Dict[str, List[float]], stat, verify_tokens) -> Dict[str, float]:
    row = {k: round(stat(v) * 1000, 3) for k, v in times.items()}
    row["head_over_trunk"] = round(row["head_1"] / row["trunk_1"], 3)
    for n in verify_tokens:
        row[f"verify_{n}_over_step"] = round(row[f"trunk_{n}"] / row["trunk_1"], 3)
    return row


def step_costs(model, batch_sizes=(1, 4), verify_tokens=(2, 3, 4), context: int = 64, repeats: int = 60) -> Dict:
    """Wall time (ms) of a trunk forward of 1 and of k+1 tokens and of one head pass after a `context`-token
    prefill: the median, and the minimum (the better estimate when other processes share the cores)."""
    from mlx_lm.models.cache import KVCache

    out = {}
    rng = np.random.default_rng(0)
    for B in batch_sizes:
        ctx = mx.array(rng.integers(1, model.vocab_size, (B, context)).astype(np.int32))
        cache = model.make_cache()
        _, hidden = model.forward(ctx, cache)
        head_cache = [KVCache() for _ in range(len(model.head.layers))]
        model.head(hidden[:, :-1], ctx[:, 1:], head_cache)
        mx.eval(hidden, [c.state for c in head_cache])
        fns = {"trunk_1": lambda: model.forward(ctx[:, -1:], cache)}
        for n in verify_tokens:
            fns[f"trunk_{n}"] = lambda n=n: model.forward(ctx[:, -n:], cache)
        fns["head_1"] = lambda: model.head(hidden[:, -1:], ctx[:, -1:], head_cache)
        times = interleaved_times(fns, repeats)
        out[f"batch_{B}"] = {
            "median_ms": _cost_row(times, statistics.median, verify_tokens),
            "min_ms": _cost_row(times, min, verify_tokens),
        }
    return out
