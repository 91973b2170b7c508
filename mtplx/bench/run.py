"""`mtplx bench`: MTPLX against mlx-lm's `batch_generate`, side by side in one process.

Per batch size and temperature it times the mlx-lm baseline (its own load) and MTPLX at each depth in rounds
on the same prompts, and reports medians of paired ratios. tokens/s = generated tokens / wall seconds of the
whole `generate` call, prefill included; `decode_*` fields leave out each engine's prompt processing, as
`predicted_speedup` (from the bare costs) does. Method: docs/performance.md, "The benchmark".
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from mtplx.decode.contract import MAX_DEPTH, MTPContract

Depth = Union[int, str]

DEFAULT_BATCH_SIZES = (1, 4, 16, 64)

# `make bench`: prompts clipped so prefill (which speculation does not speed up) stays a minority of the time;
# batch 4 streams 32 prompts through its slots, as a job does, since one batch alone ends raggedly.
QUICK = dict(
    batch_sizes=(1, 4, 16),
    depths=(0, 1, 2, 3, "auto"),
    temperatures=(0.0, 1.0),
    max_tokens=64,
    repeats=5,
    max_prompt_tokens=128,
    num_prompts={1: 1, 4: 32, 16: 16},
)
WARMUP_TOKENS = 16  # a warm-up run builds graphs and buffers; it need not be long
SHORT_RUN_PROMPTS = 8  # runs of fewer prompts get proportionally more rounds (BenchPlan.rounds)

# Bare-cost rounds before a batch size's runs and after each round of runs, so the costs cover the same slow
# spells as the runs they predict (docs/bench-history.md, on the bare costs' rounds).
BARE_COST_ROUNDS_FIRST = 24
BARE_COST_ROUNDS_BETWEEN = 3
REPO_PROMPTS = Path(__file__).resolve().parents[2] / "jobs" / "data" / "prompts.parquet"

# Used when jobs/data/prompts.parquet is absent (an installed wheel) or pyarrow is.
BUILTIN_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def is_prime(n):\n    """True when n is a prime number."""\n',
    'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):\n',
    'def read_lines(path):\n    """Return the lines of the file at path, without newlines."""\n',
    'def flatten(items):\n    """Flatten a list of lists into one list."""\n',
    'import os\n\n\ndef walk_files(root):\n    """Yield every file path under root."""\n',
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    'def word_counts(text):\n    """Map each word of text to how often it occurs."""\n',
)


@dataclass(frozen=True)
class BenchPlan:
    batch_sizes: Tuple[int, ...]
    depths: Tuple[Depth, ...]
    temperatures: Tuple[float, ...]
    max_tokens: int
    num_prompts: Union[None, int, Dict[int, int]]  # prompts per run: all batch sizes, or by batch size
    repeats: int
    seed: int
    max_prompt_tokens: Optional[int] = None
    draft_vocab: int = 0  # MTPContract.draft_vocab of every MTPLX run
    bare_rounds: Tuple[int, int] = (BARE_COST_ROUNDS_FIRST, BARE_COST_ROUNDS_BETWEEN)  # before the runs, between
    fixed_rounds: Optional[int] = None  # rounds at every batch size, instead of `rounds`' rule

    def __post_init__(self):
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if len(set(self.batch_sizes)) < len(self.batch_sizes):  # a --prompts count per size would be lost
            raise ValueError(f"batch sizes repeat: {self.batch_sizes}")
        for d in self.depths:
            if d != "auto" and (isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_DEPTH):
                raise ValueError(f"depths must be ints in 0..{MAX_DEPTH} or 'auto', got {d!r}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"the seed must be in [0, 2**64), got {self.seed}")
        if not self.depths:
            raise ValueError("at least one depth is needed")
        if not self.temperatures or min(self.temperatures) < 0:
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.max_tokens < 1 or self.repeats < 1:
            raise ValueError("max_tokens and repeats must be >= 1")
        counts = self.num_prompts.values() if isinstance(self.num_prompts, dict) else [self.num_prompts]
        if any(n is not None and n < 1 for n in counts):
            raise ValueError(f"prompts per run must be >= 1, got {self.num_prompts}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")
        if min(self.bare_rounds) < 1 or len(self.bare_rounds) != 2:
            raise ValueError(
                f"bare_rounds must be two counts >= 1 (before the runs, between rounds), got {self.bare_rounds}"
            )
        if self.fixed_rounds is not None and self.fixed_rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.fixed_rounds}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0: the whole vocabulary), got {self.draft_vocab}")

    def rounds(self, batch_size: int) -> int:
        """`repeats`, times SHORT_RUN_PROMPTS // prompts per run: short runs are noisiest and cheap to repeat
        (on a small model; `fixed_rounds` sets them where a run is long)."""
        if self.fixed_rounds is not None:
            return self.fixed_rounds
        return self.repeats * max(1, SHORT_RUN_PROMPTS // self.prompts_per_run(batch_size))

    def prompts_per_run(self, batch_size: int) -> int:
        """One run's prompts at this batch size (default: one full batch; more stream through its slots)."""
        n = self.num_prompts
        if isinstance(n, dict):
            return n.get(batch_size, batch_size)
        return n or batch_size

    def cost_depths(self, max_depth_auto: int) -> List[int]:
        """Verify depths whose cost a prediction needs ("auto" may pick any up to its max)."""
        ks = {d for d in self.depths if d != "auto" and d > 0}
        if "auto" in self.depths:
            ks |= set(range(1, max_depth_auto + 1))
        return sorted(ks)


@dataclass
class Run:
    """One timed `generate` call."""

    tokens: int
    seconds: float
    prefill_seconds: float
    completions: list = field(default_factory=list)
    cycles: int = 0  # MTPLX's decode cycles (each over the whole batch)
    cycles_by_depth: Optional[Dict[str, int]] = None  # "auto": this run's cycles at each depth

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(self.tokens, self.seconds)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens over the time outside prompt processing (each engine's own prefill timer)."""
        return tokens_per_s(self.tokens, self.seconds - self.prefill_seconds)


def run_bench(
    model_path=None,
    *,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    depths: Sequence[Depth] = (0, 1, 2, 3, "auto"),
    temperatures: Sequence[float] = (0.0, 1.0),
    max_tokens: int = 128,
    num_prompts: Union[None, int, Dict[int, int]] = None,
    repeats: int = 5,
    prompts: Optional[Sequence[Union[str, Sequence[int]]]] = None,
    seed: int = 0,
    progress: bool = True,
    max_prompt_tokens: Optional[int] = None,
    draft_vocab: int = 0,
    bare_rounds: Tuple[int, int] = (BARE_COST_ROUNDS_FIRST, BARE_COST_ROUNDS_BETWEEN),
    rounds: Optional[int] = None,
) -> List[dict]:
    """-> a header record, then one per (engine, batch size, depth, temperature). `prompts`: strings or token
    lists (default: the held-out prompts); `max_prompt_tokens`: keep each prompt's last N tokens."""
    import mlx.core as mx

    from mtplx import load
    from mtplx.assets import default_model_path
    from mtplx.decode.prepare import drafting_model

    plan = BenchPlan(
        tuple(int(b) for b in batch_sizes),
        tuple(depths),
        tuple(float(t) for t in temperatures),
        int(max_tokens),
        num_prompts,
        int(repeats),
        int(seed),
        max_prompt_tokens,
        int(draft_vocab),
        tuple(int(r) for r in bare_rounds),
        rounds,
    )
    log = _progress_printer(progress)
    asked = plan.depths
    path = Path(model_path) if model_path is not None else default_model_path()
    model = load(path)
    plan = _depths_the_model_can_run(plan, model, path)
    # The head as every MTPLX run drafts with it, made once: each runtime and the bare costs share its
    # gathered output rows (a runtime given a drafting view keeps it).
    model = drafting_model(model, MTPContract(depth=1, draft_vocab=plan.draft_vocab))
    if 0 not in plan.depths:  # measured_speedup is over MTPLX's plain decoding in the same rounds
        plan = replace(plan, depths=(0,) + plan.depths)
        _notice("depth 0 added: measured speed-ups are over MTPLX's plain decoding, run in the same rounds")
    # The baseline's own load keeps mlx-lm's layout; the runtime re-lays its weights (backends.cpu.gemm_layout).
    reference = load(path)
    texts, source = (list(prompts), "given") if prompts is not None else default_prompts()
    pool = encode_prompts(model.tokenizer, texts, plan.max_prompt_tokens)
    header = header_record(path, plan, len(pool), source)
    if asked != plan.depths:
        header["settings"]["depths_asked"] = list(asked)
    records = [header]
    for B in plan.batch_sizes:
        records += bench_batch_size(model, reference, plan, pool, B, log)
        mx.clear_cache()
    header["mtplx_gemm_layout"] = model.info.get("gemm_layout", 0)  # weights re-laid
    context = max(
        decode_context([take_prompts(pool, plan.prompts_per_run(B))], B, plan.max_tokens) for B in plan.batch_sizes
    )
    header["memory"] = {"peak_rss_bytes": peak_rss_bytes(), "cache_bytes_per_row": cache_bytes_per_row(model, context)}
    header["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return records


def _notice(message: str) -> None:
    """A change to what was asked for: on stderr even under --quiet."""
    print(f"mtplx bench: {message}", file=sys.stderr, flush=True)


def _depths_the_model_can_run(plan: BenchPlan, model, path: Path) -> BenchPlan:
    """Without an MTP head only depths 0 and "auto" run: drop the others (a notice), or an error if none."""
    drafting = [d for d in plan.depths if d not in (0, "auto")]
    if model.head is not None or not drafting:
        return plan
    kept = tuple(d for d in plan.depths if d in (0, "auto"))
    if not kept:
        raise ValueError(
            f"{path}: this checkpoint has no MTP head, so it can only be benchmarked at depth 0 "
            "(plain decoding): pass --depths 0"
        )
    _notice(f"{path}: no MTP head: depths {', '.join(map(str, drafting))} left out (plain decoding only)")
    return replace(plan, depths=kept)


def bench_batch_size(model, reference, plan: BenchPlan, pool: List[List[int]], B: int, log) -> List[dict]:
    """Every temperature x depth at batch size B (`reference`: the mlx-lm baseline's own load)."""
    from mtplx.autodepth.costs import BareCostSampler
    from mtplx.runtime import MTPLXRuntime

    n = plan.prompts_per_run(B)
    batches = [take_prompts(pool, n, start=r * n) for r in range(plan.rounds(B))]  # one per round
    context = decode_context(batches, B, plan.max_tokens)
    max_auto = MTPContract(depth="auto").max_depth_auto
    log(f"batch {B}: bare costs at context {context}, sampled before and between rounds")
    contract = partial(MTPContract, draft_vocab=plan.draft_vocab)
    bare = BareCostSampler(model, B, plan.cost_depths(max_auto), context)
    bare.sample(plan.bare_rounds[0])
    # Built once per batch size: "auto" calibrates (times its own cycles) when built.
    runtimes = {d: MTPLXRuntime(model, contract(depth=d), max_batch=B) for d in plan.depths}
    between = partial(bare.sample, plan.bare_rounds[1])
    rounds = {
        t: run_rounds(reference, runtimes, batches, B, t, plan, between_rounds=between) for t in plan.temperatures
    }
    costs = bare.costs()  # over every round of this batch size, so the runs' slow spells too
    records = []
    for t, (base_runs, pairs) in rounds.items():
        records += setting_records(runtimes, B, t, base_runs, pairs, costs, plan, log)
    return records


def peak_rss_bytes() -> Optional[int]:
    """This process's peak resident memory (both engines' weights and caches, and the runs' peaks)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def cache_bytes_per_row(model, context: int) -> dict:
    """Bytes of one row's caches at `context` positions, from the slot caches a one-row forward fills: the
    trunk's attention KV, its gated-delta conv windows and states (whatever the context), the head's KV."""
    import mlx.core as mx

    from mtplx.decode.cache import SlotKVCache, make_slot_caches

    def per_position(c) -> int:
        return (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]

    caches = make_slot_caches(model.layer_kinds, 1)
    model.forward(mx.zeros((1, context), dtype=mx.int32), caches)
    kv = sum(per_position(c) for c in caches if isinstance(c, SlotKVCache)) * context
    state = sum(a.nbytes for c in caches if not isinstance(c, SlotKVCache) for a in c.arrays)
    head = 0
    if model.head is not None:
        hidden = model.text_model.norm.weight.shape[0]
        head_caches = [SlotKVCache(1) for _ in range(model.num_head_layers)]
        model.head(mx.zeros((1, context, hidden)), mx.zeros((1, context), dtype=mx.int32), cache=head_caches)
        head = sum(per_position(c) for c in head_caches) * context
    return {"context": context, "trunk_kv": kv, "gated_delta_state": state, "head_kv": head, "total": kv + state + head}


def decode_context(batches: Sequence[List[List[int]]], batch_size: int, max_tokens: int) -> int:
    """Context of the bare costs: a batch's longest row's (a batched pass reads every row that far), halfway
    through decoding, averaged over the runs' batches (docs/bench-history.md, "Two corrections")."""
    groups = [batch[i : i + batch_size] for batch in batches for i in range(0, len(batch), batch_size)]
    return round(statistics.mean(max(len(p) for p in group) for group in groups) + max_tokens / 2)


def run_rounds(
    reference,
    runtimes: Dict[Depth, object],
    batches: Sequence[List[List[int]]],
    B: int,
    t: float,
    plan: BenchPlan,
    between_rounds: Callable[[], None] = lambda: None,
):
    """The baseline and every depth at one (batch size, temperature), round r on batches[r], after a
    warm-up on the first: -> (baseline runs, {depth: [(its round's baseline run, run)]})."""
    warmup = min(plan.max_tokens, WARMUP_TOKENS)
    baseline = partial(run_baseline, reference, temperature=t, seed=plan.seed, batch_size=B)
    baseline(batches[0], max_tokens=warmup)
    engines = {d: partial(run_engine, rt, temperature=t, seed=plan.seed) for d, rt in runtimes.items()}
    for engine in engines.values():
        engine(batches[0], max_tokens=warmup)
    # Every depth in each round, so a slow spell of the machine hits all depths alike.
    pairs: Dict[Depth, List[Tuple[Run, Run]]] = {d: [] for d in runtimes}
    base_runs: List[Run] = []
    depths, orders = list(engines), balanced_orders(len(engines))
    for r in range(plan.rounds(B)):
        batch = batches[r % len(batches)]
        base = baseline(batch, max_tokens=plan.max_tokens)
        base_runs.append(base)
        for d in (depths[i] for i in orders[r % len(orders)]):
            pairs[d].append((base, engines[d](batch, max_tokens=plan.max_tokens)))
        between_rounds()
    return base_runs, pairs


def balanced_orders(n: int) -> List[List[int]]:
    """Orders of n engines, one per round, in which every engine runs at every position and right after every
    other (or the baseline) equally often: a Williams design, n orders for even n, 2n for odd n (each followed
    by its reverse). A plain rotation fixes each engine's predecessor, and that can move its speed."""
    if n < 2:
        return [list(range(n))]
    first, low, high = [0], 1, n - 1
    for j in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        if j % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    square = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2 == 0:
        return square
    return [order for row in square for order in (row, row[::-1])]


def setting_records(
    runtimes: Dict[Depth, object],
    B: int,
    t: float,
    base_runs: List[Run],
    pairs: Dict[Depth, List[Tuple[Run, Run]]],
    costs,
    plan: BenchPlan,
    log,
) -> List[dict]:
    """The baseline's record, then each depth's."""
    records = []
    for d, rt in runtimes.items():
        rec = mtplx_record(rt, d, B, t, pairs[d], costs, plan)
        if rec["ratio_vs_mlx_lm"] is None:  # every baseline run generated nothing
            versus = "no ratio to mlx-lm (its runs generated no tokens)"
        else:
            lo, hi = rec["ratio_spread"]
            versus = f"x{rec['ratio_vs_mlx_lm']:.3f} vs mlx-lm [{lo:.3f}, {hi:.3f}]"
        log(f"  B={B} T={t:g} depth={d}: {rec['tokens_per_s']:.1f} tok/s, {versus}")
        records.append(rec)
    add_measured_speedups(records)
    add_auto_vs_best(records)
    return [baseline_record(B, t, base_runs, plan)] + records


def baseline_logits_processors(model) -> list:
    """What mlx-lm's baseline needs to sample the tokens MTPLX may: where the output layer is padded
    past the tokenizer's vocabulary, a cut of the padded ids (both sides still compute the whole layer)."""
    vocab = model.vocab_size
    if int(model.text_model.embed_tokens.weight.shape[0]) == vocab:
        return []
    from mtplx.models.loader import cut_to_vocab

    return [lambda tokens, logits: cut_to_vocab(logits, vocab)]


def run_baseline(
    model, prompts: List[List[int]], max_tokens: int, temperature: float, seed: int, batch_size: int
) -> Run:
    """`mlx_lm.batch_generate` on the trunk of `model`, decoding `batch_size` rows at a time."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    t0 = time.perf_counter()
    out = batch_generate(
        model.trunk,
        model.tokenizer,
        prompts=prompts,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=temperature),
        verbose=False,
        return_token_ids=True,
        # mlx-lm decodes max(completion, prefill) batch sizes at once: both = B caps it at B.
        completion_batch_size=batch_size,
        prefill_batch_size=min(batch_size, 8),
        logits_processors=baseline_logits_processors(model),
    )
    seconds = time.perf_counter() - t0
    return Run(sum(len(ids) for ids in out.token_ids), seconds, out.stats.prompt_time)


def run_engine(rt, prompts: List[List[int]], max_tokens: int, temperature: float, seed: int) -> Run:
    from mtplx.decode.sampling import SamplingParams

    prefill_before, cycles_before = rt.stats["prefill_seconds"], rt.stats["cycles"]
    auto = rt.stats.get("auto_depth")
    by_depth_before = dict(auto["cycles_by_depth"]) if auto else None
    t0 = time.perf_counter()
    outs = rt.generate(prompts, sampling=SamplingParams(temperature=temperature), max_tokens=max_tokens, seed=seed)
    seconds = time.perf_counter() - t0
    errors = [c.error for c in outs if c.finish_reason == "error"]
    if errors:  # a timing over failed rows would compare different work
        raise RuntimeError(f"MTPLX failed {len(errors)} of {len(outs)} bench rows; first: {errors[0]}")
    prefill = rt.stats["prefill_seconds"] - prefill_before
    by_depth = None
    if auto:  # the runtime's counts run on over warm-ups and other temperatures
        by_depth = {k: n - by_depth_before.get(k, 0) for k, n in auto["cycles_by_depth"].items()}
    return Run(sum(len(c.tokens) for c in outs), seconds, prefill, outs, rt.stats["cycles"] - cycles_before, by_depth)


def mtplx_record(rt, depth: Depth, B: int, t: float, pairs: List[Tuple[Run, Run]], costs, plan: BenchPlan) -> dict:
    engine_runs = [e for _, e in pairs]
    ratios = paired_ratios([(b.tokens_per_s, e.tokens_per_s) for b, e in pairs])
    completions = [c for run in engine_runs for c in run.completions]
    acc = acceptance_summary(completions, rt.depth)
    # Below B where rows end at different cycles: predicted_speedup counts each row's own cycles.
    batch_cycles = sum(e.cycles for e in engine_runs)
    acc["rows_per_cycle"] = acc["row_cycles"] / batch_cycles if batch_cycles else None
    acc["cycles"] = batch_cycles
    auto = rt.stats.get("auto_depth")
    if auto:  # the runtime's record, with the cycle counts of these timed runs only
        by_depth = {k: sum(e.cycles_by_depth.get(k, 0) for e in engine_runs) for k in auto["cycles_by_depth"]}
        auto = {**copy.deepcopy(auto), "cycles_by_depth": by_depth}
    mix = _depth_mix(auto["cycles_by_depth"] if auto else None, rt.depth)
    # Each round's own prediction from its own prompts' acceptance; "auto" by its mix of depths.
    run_predicted = [
        predicted_from_ideal(
            costs,
            acceptance_summary(e.completions, rt.depth)["ideal_tokens_per_cycle"],
            _depth_mix(e.cycles_by_depth, rt.depth),
        )
        for e in engine_runs
    ]
    rec = {
        "engine": "mtplx",
        "batch_size": B,
        "depth": depth,
        "depth_used": auto["depth"] if auto else rt.depth,
        "temperature": t,
        **_run_fields(engine_runs, plan, B),
        "baseline_tokens_per_s": statistics.median(b.tokens_per_s for b, _ in pairs),
        **ratio_summary(ratios),
        "decode_ratio_vs_mlx_lm": _median_or_none(
            paired_ratios([(b.decode_tokens_per_s, e.decode_tokens_per_s) for b, e in pairs])
        ),
        **acc,
        "predicted_speedup": predicted_from_ideal(costs, acc["ideal_tokens_per_cycle"], mix),
        "run_predicted_speedups": run_predicted,  # in round order
        "measured_speedup": None,  # both filled once depth 0 is known
        "measured_decode_speedup": None,
        "bare_costs": costs.as_dict(),
    }
    if depth != "auto":
        rec["cycle_time"] = cycle_time(engine_runs, costs, rt.depth)
    if depth == "auto":
        rec["auto_choice"] = auto
        rec["cycles_by_depth"] = auto["cycles_by_depth"]
    return rec


def cycle_time(runs: List[Run], costs, k: int) -> Optional[dict]:
    """Where a cycle's time goes at fixed depth k: its measured seconds (decode time over cycles), the bare
    verify over k + 1 tokens (the step at k = 0), the k head passes, and the rest (the drafts' sampling,
    accept, commit, refill and host work beyond the bare passes)."""
    cycles = sum(r.cycles for r in runs)
    if not cycles:
        return None
    cycle_s = sum(r.seconds - r.prefill_seconds for r in runs) / cycles
    verify_s = costs.verify_s.get(k, costs.step_s) if k else costs.step_s
    heads_s = k * costs.head_s
    return {"cycle_s": cycle_s, "verify_s": verify_s, "heads_s": heads_s, "rest_s": cycle_s - verify_s - heads_s}


def _depth_mix(cycles_by_depth: Optional[Dict[str, int]], depth: int) -> Dict[int, int]:
    """{k: cycles} of the depths an "auto" engine's cycles ran at, or {depth: 1} (fixed depth, no cycles)."""
    mix = {int(k): n for k, n in (cycles_by_depth or {}).items() if n}
    return mix or {depth: 1}


def baseline_record(B: int, t: float, runs: List[Run], plan: BenchPlan) -> dict:
    return {
        "engine": "mlx_lm",
        "batch_size": B,
        "depth": None,
        "depth_used": None,
        "temperature": t,
        **_run_fields(runs, plan, B),
        "ratio_vs_mlx_lm": 1.0,
        "ratio_ci": None,
        "ratio_spread": [1.0, 1.0],
        "paired_ratios": [],
        "decode_ratio_vs_mlx_lm": 1.0,
        "acceptance_by_depth": None,
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "ideal_tokens_per_cycle": None,
        "predicted_speedup": None,
        "measured_speedup": None,
        "measured_decode_speedup": None,
        "run_predicted_speedups": None,
        "bare_costs": None,
    }


def _run_fields(runs: List[Run], plan: BenchPlan, B: int) -> dict:
    return {
        "num_prompts": plan.prompts_per_run(B),
        "max_tokens": plan.max_tokens,
        "runs": len(runs),
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
        "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs),
        "run_tokens_per_s": [r.tokens_per_s for r in runs],  # in round order
        "run_decode_tokens_per_s": [r.decode_tokens_per_s for r in runs],
        "generated_tokens": statistics.median(r.tokens for r in runs),
        "prefill_fraction": statistics.median(r.prefill_seconds / r.seconds for r in runs),
    }


def add_measured_speedups(records: List[dict]) -> None:
    """measured_speedup: median over rounds of a depth's run over depth 0's run of the same round (drift
    mostly cancels); measured_decode_speedup: the same without prefill; decode_over_predicted: median over
    rounds of a round's decode speed-up over its own prediction."""
    plain = next((r for r in records if r["depth"] == 0), None)
    if plain is None:
        return
    for r in records:
        for field_, runs in (
            ("measured_speedup", "run_tokens_per_s"),
            ("measured_decode_speedup", "run_decode_tokens_per_s"),
        ):
            ratios = paired_ratios(list(zip(plain[runs], r[runs])))
            r[field_] = _median_or_none(ratios)
            r[field_ + "_ci"] = median_interval(ratios)
        if r["depth"] != 0 and r.get("run_predicted_speedups"):
            rounds = zip(plain["run_decode_tokens_per_s"], r["run_decode_tokens_per_s"], r["run_predicted_speedups"])
            shares = [e / b / p for b, e, p in rounds if b > 0 and p]
            r["decode_over_predicted"] = _median_or_none(shares)
            r["decode_over_predicted_ci"] = median_interval(shares)


def add_auto_vs_best(records: List[dict]) -> None:
    """On the "auto" record: `best_fixed_depth` (highest ratio_vs_mlx_lm) and `auto_vs_best`, the median of
    auto's run over that of the depth best on the rounds of the other parity: picked on the same rounds, the
    best of several noisy medians is biased high (that figure stays as `auto_vs_best_same_rounds`)."""
    auto = next((r for r in records if r["depth"] == "auto"), None)
    fixed = [r for r in records if r["depth"] != "auto" and r["ratio_vs_mlx_lm"] is not None]
    if auto is None or not fixed:
        return
    best = max(fixed, key=lambda r: r["ratio_vs_mlx_lm"])
    auto["best_fixed_depth"] = best["depth"]
    same_rounds = paired_ratios(list(zip(best["run_tokens_per_s"], auto["run_tokens_per_s"])))
    auto["auto_vs_best_same_rounds"] = _median_or_none(same_rounds)
    ratios = _cross_fitted_auto_ratios(auto, fixed)
    if ratios is None:  # nothing to pick the depth on apart from the rounds themselves
        ratios = same_rounds
    auto["auto_vs_best"] = _median_or_none(ratios)
    auto["auto_vs_best_ci"] = median_interval(ratios)


def _cross_fitted_auto_ratios(auto: dict, fixed: List[dict]) -> Optional[List[float]]:
    """`add_auto_vs_best`'s ratios; None under two rounds or without every fixed depth's per-round ratios."""
    rounds = len(auto["run_tokens_per_s"])
    aligned = all(len(r.get("paired_ratios") or ()) == rounds for r in fixed)
    if rounds < 2 or not aligned:
        return None
    ratios = []
    for parity in (0, 1):
        others = [i for i in range(rounds) if i % 2 != parity]
        best = max(fixed, key=lambda r: statistics.median(r["paired_ratios"][i] for i in others))
        ratios += paired_ratios(
            [(best["run_tokens_per_s"][i], auto["run_tokens_per_s"][i]) for i in range(rounds) if i % 2 == parity]
        )
    return ratios


def _median_or_none(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def paired_ratios(pairs: Sequence[Tuple[float, float]]) -> List[float]:
    """engine tok/s / baseline tok/s for each adjacent (baseline, engine) pair."""
    return [e / b for b, e in pairs if b > 0]


def ratio_summary(ratios: Sequence[float]) -> dict:
    """Median of the paired ratios, its confidence interval and their spread (min, max)."""
    if not ratios:
        return {"ratio_vs_mlx_lm": None, "ratio_ci": None, "ratio_spread": None, "paired_ratios": []}
    return {
        "ratio_vs_mlx_lm": statistics.median(ratios),
        "ratio_ci": median_interval(ratios),
        "ratio_spread": [min(ratios), max(ratios)],
        "paired_ratios": list(ratios),
    }


CI_LEVEL = 0.9  # confidence of the interval given beside each median of paired ratios


def median_interval(xs: Sequence[float], level: float = CI_LEVEL) -> Optional[List[float]]:
    """Distribution-free interval for the median: [x_(j), x_(n+1-j)] with the largest j whose coverage,
    1 - 2 P(Binomial(n, 1/2) < j), is at least `level`; None when even [min, max] falls short (n < 5 at 90%)."""
    n = len(xs)
    below, j = 0, 0  # below: P(Binomial(n, 1/2) < j + 1) x 2^n
    while j < n // 2:
        below += math.comb(n, j)
        if 1 - 2 * below / 2**n < level:
            break
        j += 1
    if j == 0:
        return None
    s = sorted(xs)
    return [s[j - 1], s[n - j]]


def acceptance_summary(completions, depth: int) -> dict:
    """Job-level acceptance over completions, as docs/design.md "Metrics" defines it (acceptance_by_depth[i] is
    cumulative; mean_accepted_length is under ideal_tokens_per_cycle only where a stop token cut a cycle)."""
    cycles = sum(c.steps for c in completions)
    drafted = [sum(c.drafted_by_depth[i] for c in completions if i < len(c.drafted_by_depth)) for i in range(depth)]
    accepted = [sum(c.accepted_by_depth[i] for c in completions if i < len(c.accepted_by_depth)) for i in range(depth)]
    # The first token of a row comes from the prefill logits, not from a cycle.
    from_cycles = sum(max(len(c.tokens) - 1, 0) for c in completions)
    return {
        "acceptance_by_depth": [a / d if d else None for a, d in zip(accepted, drafted)],
        "acceptance_rate": sum(accepted) / sum(drafted) if sum(drafted) else None,
        "mean_accepted_length": from_cycles / cycles if cycles else None,
        "ideal_tokens_per_cycle": 1.0 + sum(accepted) / cycles if cycles else None,
        "row_cycles": cycles,  # summed over rows and over the timed runs
    }


def predicted_from_ideal(costs, ideal_tokens_per_cycle: Optional[float], depth) -> Optional[float]:
    """ideal x step time / (verify + k head times); `depth`: k, or {k: cycles} (weighted mean cycle time)."""
    if ideal_tokens_per_cycle is None:
        return None
    mix = depth if isinstance(depth, dict) else {depth: 1}
    cycle = sum(n * costs.cycle_s(k) for k, n in mix.items()) / sum(mix.values())
    return ideal_tokens_per_cycle * costs.step_s / cycle


def header_record(model_path: Path, plan: BenchPlan, num_prompts: int, prompt_source: str) -> dict:
    """Machine, versions, BLAS and settings: what a reader needs to rerun it."""
    return {
        "engine": "header",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "device": device_info(),
        "versions": versions(),
        "blas": blas_in_use(),
        "allocator": allocator_in_use(),
        "model": str(model_path),
        "prompts": {
            "count": num_prompts,
            "source": prompt_source,
            "per_run": {str(B): plan.prompts_per_run(B) for B in plan.batch_sizes},
            "rounds": "each round the next ones of the pool",
            "max_prompt_tokens": plan.max_prompt_tokens,
        },
        "max_tokens": plan.max_tokens,
        "settings": {
            "batch_sizes": list(plan.batch_sizes),
            "depths": list(plan.depths),
            "temperatures": list(plan.temperatures),
            "repeats": plan.repeats,
            "rounds_by_batch_size": {str(B): plan.rounds(B) for B in plan.batch_sizes},
            "seed": plan.seed,
            "warmup_tokens": min(plan.max_tokens, WARMUP_TOKENS),
            "acceptance": "residual",
            "draft_vocab": plan.draft_vocab,
            "bare_rounds": list(plan.bare_rounds),
        },
    }


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": _cpu_model() or platform.processor(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):  # the machine is shared: how busy it was matters
        info["loadavg_at_start"] = list(os.getloadavg())
    return info


def device_info() -> dict:
    """The device MLX ran on, named (a GPU's model: its figures mean nothing without it)."""
    import mlx.core as mx

    info = {"mlx_device": str(mx.default_device())}
    try:
        info.update({k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))})
    except (AttributeError, RuntimeError):  # an MLX without device_info
        pass
    return info


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from mtplx import __version__

    out = {"python": platform.python_version(), "mtplx": __version__}
    for dist in ("mlx", "mlx-lm", "numpy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def allocator_in_use() -> str:
    """The malloc in use: glibc's slows MLX (docs/performance.md, "OpenBLAS, jemalloc and OpenBLAS's threads")."""
    for lib in _mapped_libraries(("jemalloc", "tcmalloc", "mimalloc")):
        return Path(lib).name
    return "glibc malloc" if sys.platform.startswith("linux") else "system malloc"


def _mapped_libraries(parts: Sequence[str]) -> List[str]:
    """Files mapped into this process (Linux) whose name holds one of `parts`."""
    libs = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            name = line.rsplit(" ", 1)[-1]
            if any(s in name.lower() for s in parts):
                libs.add(name)
    except OSError:
        pass
    return sorted(libs)


def blas_in_use() -> dict:
    """The BLAS mapped into this process (Linux): runs on mlx-cpu's reference BLAS compare with no others."""
    from mtplx.backends import blas_info

    libs_sorted = _mapped_libraries(("blas", "lapack", "mkl"))
    preload = os.environ.get("LD_PRELOAD", "")
    if any(_mlx_may_use(lib) and "openblas" in Path(lib).name.lower() for lib in libs_sorted):
        name = "OpenBLAS"
    elif sys.platform == "darwin":
        name = "Accelerate"
    else:
        name = "mlx bundled (reference BLAS)" if sys.platform.startswith("linux") else "unknown"
    return {
        "name": name,
        "libraries": libs_sorted,
        "ld_preload": preload or None,
        "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
        # Its kernels (OPENBLAS_CORETYPE can force them; they change the speed a lot).
        "openblas_core": blas_info()["core"] if name == "OpenBLAS" else None,
        # Its threads outside decode cycles (small ones run on one, backends.cpu.blas_threads).
        "openblas_threads": blas_info()["threads"] if name == "OpenBLAS" else None,
    }


def _mlx_may_use(lib: str) -> bool:
    """False for a BLAS a wheel bundles under a private name (numpy's libscipy_openblas, in *.libs): it is
    mapped into every process that imports numpy, and MLX never calls it."""
    name = Path(lib).name.lower()
    return not ("scipy_openblas" in name or Path(lib).parent.name.endswith(".libs"))


def default_prompts() -> Tuple[List[str], str]:
    """(prompts, source): the held-out prompts of a source checkout (needs pyarrow), else the built-in ones."""
    try:
        import pyarrow.parquet as pq

        texts = pq.read_table(REPO_PROMPTS, columns=["prompt"]).column("prompt").to_pylist()
        texts = [p for p in texts if p]
        if texts:
            return texts, str(REPO_PROMPTS)
    except (ImportError, OSError, KeyError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        pass
    return list(BUILTIN_PROMPTS), "built-in"


def encode_prompts(
    tokenizer, prompts: Sequence[Union[str, Sequence[int]]], max_tokens: Optional[int] = None
) -> List[List[int]]:
    """Token lists, clipped to their last `max_tokens` tokens (the context a completion continues from)."""
    pool = [tokenizer.encode(p) if isinstance(p, str) else [int(x) for x in p] for p in prompts]
    if not pool or not all(pool):
        raise ValueError("the bench needs at least one prompt, and no empty ones")
    return pool if max_tokens is None else [ids[-max_tokens:] for ids in pool]


def take_prompts(pool: List[List[int]], n: int, start: int = 0) -> List[List[int]]:
    """n prompts of the pool from index `start`, cycling when it runs out."""
    return [pool[(start + i) % len(pool)] for i in range(n)]


def _progress_printer(enabled: bool) -> Callable[[str], None]:
    if not enabled:
        return lambda s: None
    return lambda s: print(s, file=sys.stderr, flush=True)


def _ints(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _depths(text: str) -> Tuple[Depth, ...]:
    return tuple("auto" if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> Tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mtplx.bench", description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="where to write the JSON records")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--quick", action="store_true", help="the short `make bench` settings (flags below override)")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="e.g. 1,4,16,64")
    p.add_argument("--depths", type=_depths, default=None, help="e.g. 0,1,2,3,auto")
    p.add_argument("--temperatures", type=_floats, default=None, help="e.g. 0,1")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument(
        "--prompts",
        type=_ints,
        default=None,
        dest="num_prompts",
        help="prompts per run: one count for every batch size, or one per batch size, e.g. 1,16,16 "
        "(default: the batch size, one full batch; more stream through the batch's slots)",
    )
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="keep each prompt's last N tokens")
    p.add_argument("--draft-vocab", type=int, default=None, help="the head scores this many ids (0: all)")
    p.add_argument("--rounds", type=int, default=None, help="rounds at every batch size (overrides --repeats' rule)")
    p.add_argument("--bare-rounds", type=_ints, default=None, help="bare-cost rounds before the runs, between rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="also draw tokens/s vs batch size here (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> dict:
    """run_bench keyword arguments: run_bench's defaults, or QUICK's, under the given flags."""
    base = dict(QUICK) if args.quick else {}
    names = ("batch_sizes", "depths", "temperatures", "max_tokens", "num_prompts", "repeats", "max_prompt_tokens")
    for name in (*names, "draft_vocab", "bare_rounds", "rounds"):
        value = getattr(args, name)
        if value is not None:
            base[name] = value
    if args.num_prompts is not None:
        base["num_prompts"] = prompts_by_batch_size(args.num_prompts, base.get("batch_sizes", DEFAULT_BATCH_SIZES))
    return {**base, "seed": args.seed, "progress": not args.quiet}


def prompts_by_batch_size(counts: Sequence[int], batch_sizes: Sequence[int]) -> Union[int, Dict[int, int]]:
    """--prompts: one count for all batch sizes, or one per batch size."""
    if len(counts) == 1:
        return counts[0]
    if len(counts) != len(batch_sizes):
        raise ValueError(
            f"--prompts has {len(counts)} counts for {len(batch_sizes)} batch sizes {tuple(batch_sizes)}: "
            "give one for all, or one per batch size"
        )
    return dict(zip(batch_sizes, counts))


def main(argv=None) -> int:
    """The command: 0 on success, 2 with one line on stderr for a problem a user can fix."""
    args = parse_args(argv)
    try:
        return _run_command(args)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"mtplx bench: {e}", file=sys.stderr)
        return 2


def _run_command(args: argparse.Namespace) -> int:
    from mtplx.bench.report import check_output_paths, format_table, write_plot

    check_output_paths(args.output, args.plot)  # fail before the run, not after it
    records = run_bench(args.model, **settings_from_args(args))
    Path(args.output).write_text(json.dumps(records, indent=2) + "\n")
    print(format_table(records))
    print(f"records written to {args.output}")
    if args.plot:
        write_plot(records, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
