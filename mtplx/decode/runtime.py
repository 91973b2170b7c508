"""BatchRuntime: the batched decode loop (docs/design.md, "The decode cycle").
A cycle: head catch-up and drafts in one graph (decode.draft), one verify
pass, accept (decode.accept), commit; then the host emits, applies stop
rules and refills, reading each cycle after launching the next."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from mtplx.backends import CycleThreads
from mtplx.decode.accept import cycle_draws, decide
from mtplx.decode.cache import SlotKVCache
from mtplx.decode.checks import (
    PromptError,
    prompt_list,
    row_id_list,
    seed_value,
    stop_strings,
    stop_token_id_list,
    token_ids,
    valid_text,
)
from mtplx.decode.contract import MTPContract
from mtplx.decode.depth import FixedDepth, ScriptedDepths
from mtplx.decode.draft import DraftChain, HeadPending
from mtplx.decode.numerics import log_softmax_f32, nonfinite_rows, replace_nonfinite_rows
from mtplx.decode.passes import trunk_pass
from mtplx.decode.prefill import Prefilled, prefill_by_length
from mtplx.decode.prefix import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, build_prefixes, plan_shares, split_grain
from mtplx.decode.prepare import drafting_model, prepare_for_decoding
from mtplx.decode.requests import Completion, Request, error_completion, find_stop_string
from mtplx.decode.sampling import (
    SamplingParams,
    batch_sampling,
    position_keys,
    row_hash,
    row_key_base,
    speculative_accept,
    target_probs,
)
from mtplx.decode.slots import Row, SlotBatch
from mtplx.models.loader import encode_text


def check_runtime_args(model, contract: MTPContract, max_batch: int) -> None:
    """The errors a runtime raises before any work (calibration included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    # "auto" picks the fastest depth; without a head that is plain decoding.
    if contract.depth not in (0, "auto") and model.head is None:
        raise ValueError(
            f"{model.path}: this checkpoint has no MTP head, so it cannot draft "
            f"(depth={contract.depth!r}); decode plainly at depth 0 (MTPContract(depth=0), --depth 0) "
            f"or let depth 'auto' choose"
        )


class BatchRuntime:
    """The batched decode loop; `policy` (`decode.depth`) picks each cycle's
    depth, by default the contract's. `mtplx.MTPLXRuntime` builds "auto"'s."""

    def __init__(self, model, contract: MTPContract = MTPContract(), max_batch: int = 8, policy=None):
        check_runtime_args(model, contract, max_batch)
        if policy is None:
            if contract.depth == "auto":
                raise ValueError("depth 'auto' needs its calibrated policy: build the runtime with mtplx.MTPLXRuntime")
            policy = FixedDepth(contract.depth)
        if policy.max_depth > 0 and model.head is None:
            raise ValueError(f"{model.path}: this checkpoint has no MTP head, so it cannot draft")
        prepare_for_decoding(model)
        model = drafting_model(model, contract)
        self.model = model
        self.contract = contract
        self.max_batch = max_batch
        self.policy = policy
        self.depth = policy.max_depth  # what the batch is built for
        self.eos = set(model.eos_token_ids)
        # Small decode GEMMs run OpenBLAS single-threaded (backends.cpu.blas_threads).
        self.threads = CycleThreads(model)
        # Per-step gated-delta states only when commit can roll back. Also the
        # prefill's last-token step (at depth 0 the decode step's own trace).
        self._verify = trunk_pass(model, keep_pending=self.depth > 0, compiled=contract.compile)
        self._draft_chain = (
            DraftChain(
                model.head,
                model.num_head_layers,
                contract.acceptance,
                compiled=contract.compile,
                ids=model.draft_ids,
                vocab=model.vocab_size,
            )
            if self.depth > 0
            else None
        )
        # Shared prompt prefixes' states, kept across groups and calls (decode.prefix).
        cache_bytes = contract.prefix_cache_bytes
        self.prefixes = PrefixCache(DEFAULT_PREFIX_CACHE_BYTES if cache_bytes is None else cache_bytes)
        # Recent launch times: launch to launch is one cycle, which calibration takes medians of.
        self.launch_started: deque = deque(maxlen=4096)
        # Prefill or rows moved since the last launch: that interval is no cycle.
        self._disturbed = True
        if policy.warm_up_depths():
            self._warm_up_every_depth()
        self._reset_stats()

    def _reset_stats(self):
        self.stats = _new_stats(self.depth)
        self.launch_started.clear()
        record = self.policy.record
        if record is not None:
            self.stats["auto_depth"] = record
            record["cycles_by_depth"] = {str(k): 0 for k in range(self.depth + 1)}

    def _warm_up_every_depth(self, sampling: SamplingParams = SamplingParams(), logprobs: bool = False):
        """Trace the passes of each of the policy's `warm_up_depths` on dummy
        rows, so the job's first cycles there do not pay for it."""
        policy = self.policy
        depths = list(policy.warm_up_depths())
        max_tokens = (self.depth + 1) * len(depths) + 2  # no row ends before the sequence does
        if self.model.max_context is not None:
            max_tokens = min(max_tokens, self.model.max_context - 4)
        if max_tokens < 1:
            return  # a context too short for dummy rows: the job's first bursts trace instead
        sampled = policy.choose(True, lambda: False)
        self.policy = ScriptedDepths(depths, sampled_depth=sampled, max_depth=self.depth)
        self._reset_stats()
        try:
            self._decode_dummy_rows(4, max_tokens, sampling, logprobs)
        finally:
            self.policy = policy

    def warm_up(self, sampling: SamplingParams = SamplingParams(), logprobs: bool = False) -> None:
        """Decode dummy rows for one full-depth cycle and forget them, so these
        settings' passes are traced and built before the caller's work
        (depth "auto": its sampled/logprobs ones). Outputs do not change."""
        if self.policy.warm_up_depths():
            if not sampling.greedy or logprobs:
                self._warm_up_every_depth(sampling, logprobs)
                self._reset_stats()
            return
        # A two-token prompt pass, as for longer prompts (a size-1 axis builds
        # other kernels), the first token, then one cycle drafting `depth`.
        max_tokens, prompt_len = self.depth + 2, 3
        limit = self.model.max_context
        if limit is not None and prompt_len + max_tokens > limit:
            return
        self._decode_dummy_rows(prompt_len, max_tokens, sampling, logprobs)
        self._reset_stats()

    def _decode_dummy_rows(self, prompt_len: int, max_tokens: int, sampling: SamplingParams, logprobs: bool):
        """A full batch of dummy rows that no end of sequence stops."""
        prompts = [[(1 + b) % self.model.vocab_size] * prompt_len for b in range(self.max_batch)]
        eos, self.eos = self.eos, set()
        try:
            self.generate(prompts, sampling=sampling, max_tokens=max_tokens, logprobs=logprobs)
        finally:
            self.eos = eos
            mx.synchronize()

    def generate(
        self,
        prompts: Sequence[Union[str, Sequence[int]]],
        sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        max_tokens: int = 256,
        seed: int = 0,
        stop: Sequence[str] = (),
        n: int = 1,
        row_ids: Optional[Sequence] = None,
        stop_token_ids: Sequence[int] = (),
        logprobs: bool = False,
    ) -> List[Completion]:
        """Complete every prompt (a string or token ids); results in input,
        then sample, order. A prompt with invalid ids ends as an error."""
        prompts = prompt_list(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError("sampling must be one SamplingParams or one per prompt")
        row_ids = row_id_list(row_ids, len(prompts))
        stop = stop_strings(stop)
        requests = [
            Request(
                index=i,
                prompt=p,
                sampling=sp,
                max_tokens=max_tokens,
                row_id=None if row_ids is None else row_ids[i],
                n=n,
                stop=stop,
                stop_token_ids=stop_token_id_list(stop_token_ids),
                logprobs=logprobs,
            )
            for i, (p, sp) in enumerate(zip(prompts, sampling))
        ]
        # No caller code runs between completions: the OpenBLAS thread count
        # is handed back once, at the end (docs/performance.md).
        try:
            out = list(self._stream(requests, seed_value(seed)))
        finally:
            self.threads.release()
        return sorted(out, key=lambda c: (c.index, c.sample_index))

    def stream(self, requests: Iterable[Request], seed: int = 0) -> Iterator[Completion]:
        """Yield each Completion as soon as its row finishes. Requests are pulled
        lazily; the runtime alone decides batch composition."""
        seed = seed_value(seed)
        try:
            for completion in self._stream(requests, seed):
                self.threads.release()  # the caller's code between completions runs at its own count
                yield completion
        finally:
            self.threads.release()

    def _stream(self, requests: Iterable[Request], seed: int) -> Iterator[Completion]:
        batch = SlotBatch(self.model, self.max_batch, self.depth)
        waiting = _Samples(iter(requests))
        inflight = None
        while True:
            # Launch the next cycle before reading the one in flight: reading overlaps compute.
            if inflight is not None and self._may_end_rows(inflight):
                yield from self._collect(batch, inflight)
                inflight = None
                self._disturbed = True
            yield from self._refill(batch, waiting, seed, in_flight=int(inflight is not None))
            if self._should_shrink(batch, waiting):
                if inflight is not None:  # slots move: read the cycle in flight first
                    yield from self._collect(batch, inflight)
                    inflight = None
                    batch.flush(0)
                self._disturbed = True
                if batch.any_active():
                    batch = batch.shrunk()
                    self._set_sampling(batch, seed)
                    self.stats["batch_shrinks"] += 1
            launched = None
            if batch.any_active():
                k = self._cycle_depth(batch, waiting)
                if k is None:  # the policy's script is over (calibration, warm-up)
                    if inflight is not None:
                        yield from self._collect(batch, inflight)
                    return
                launched = self._launch(batch, int(inflight is not None), k)
            if inflight is not None:
                yield from self._collect(batch, inflight)
            inflight = launched
            if inflight is None and not batch.any_active() and not waiting.pending:
                self.policy.finished()
                return

    def _refill(self, batch: SlotBatch, waiting: "_Samples", seed: int, in_flight: int) -> Iterator[Completion]:
        for b in batch.free_slots():
            while batch.rows[b] is None and waiting.pending:
                item = waiting.next(self, seed)
                if item is None:
                    break
                kind, payload = item
                if kind == "done":
                    yield payload
                    continue
                pre, row, first = payload
                finished = self._finish_if_done(row, [first])
                if finished is not None:
                    yield finished
                    continue
                batch.load(b, pre, row, first)
        if batch.flush(in_flight) or batch.sampling is None:
            self._set_sampling(batch, seed)
            self._disturbed = True

    @staticmethod
    def _set_sampling(batch: SlotBatch, seed: int):
        """The rows' sampling settings and key material as device arrays (rebuilt when rows change)."""
        rows = batch.rows
        batch.sampling = batch_sampling([r.req.sampling if r is not None else SamplingParams() for r in rows])
        batch.key_base = (
            None
            if batch.sampling.all_greedy
            else row_key_base(
                seed,
                [r.key_hash if r is not None else 0 for r in rows],
                [r.sample_index if r is not None else 0 for r in rows],
            )
        )  # [B] uint64

    def _may_end_rows(self, inf: "_InFlight") -> bool:
        """Whether the cycle in flight can end a row at max_tokens: then it is
        read first, so the next cycle does not compute that slot for nothing."""
        return any(r is not None and len(r.tokens) + inf.depth + 1 >= r.req.max_tokens for r in inf.rows)

    def _should_shrink(self, batch: SlotBatch, waiting: "_Samples") -> bool:
        """Once nothing waits, rows left over run in a smaller batch (a cycle
        computes every slot, occupied or not)."""
        return (
            self.contract.shrink_batch
            and not waiting.pending
            and batch.any_active()
            and batch.shrink_size() < batch.size
        )

    def prepare(self, batch: List[tuple], seed: int) -> List["_Prepared"]:
        """Prefill encoded requests [(request, ids)] together, then draw the
        first token of every sample of every request in one vectorised step."""
        self._disturbed = True
        self.threads.for_prompts()  # a prompt pass's GEMMs are large enough to split
        t0 = time.perf_counter()
        prompts = [ids for _, ids in batch]
        with_head = self._prefill_head()
        starts, computed = self._shared_prefixes(prompts, with_head)
        pres = prefill_by_length(
            self.model, prompts, self.contract.prefill_chunk, with_head, step=self._verify, starts=starts
        )
        self.stats["prefill_seconds"] += time.perf_counter() - t0
        shared = [0 if s is None else s.length for s in starts]
        self.stats["prefill_tokens"] += computed + sum(len(ids) - n for ids, n in zip(prompts, shared))
        self.stats["shared_prefix_tokens"] += sum(req.n * n for (req, _), n in zip(batch, shared))
        reqs = [req for req, _ in batch]
        owner = [i for i, req in enumerate(reqs) for _ in range(req.n)]  # sample -> request
        samples = [s for req in reqs for s in range(req.n)]
        hashes = [_key_hash(req) for req in reqs]
        last = mx.concatenate([pre.last_logits for pre in pres], axis=0)  # [R, V]
        bad = nonfinite_rows(last)  # [R]
        logits = last[mx.array(owner)][:, None]  # [S, 1, V]
        keys = position_keys(seed, [hashes[i] for i in owner], samples, mx.zeros((len(owner), 1), dtype=mx.int32))
        p = target_probs(logits, batch_sampling([reqs[i].sampling for i in owner]))  # [S, 1, V]
        p = replace_nonfinite_rows(p, bad[mx.array(owner)])
        _, first = speculative_accept(
            mx.zeros((len(owner), 0), dtype=mx.int32),
            p[:, :0],
            p,
            keys,
            rule=self.contract.acceptance,
            check_finite=False,
        )  # [S]
        lp = mx.take_along_axis(log_softmax_f32(logits[:, 0]), first[:, None], axis=-1)[:, 0]  # [S]
        first, lp, bad = first.tolist(), lp.tolist(), bad.tolist()
        out, at = [], 0
        for i, (req, pre) in enumerate(zip(reqs, pres)):
            firsts = first[at : at + req.n]
            lps = lp[at : at + req.n] if req.logprobs else None
            out.append(_Prepared(req, pre, hashes[i], firsts, lps, bool(bad[i]), shared[i]))
            at += req.n
        return out

    def _shared_prefixes(self, prompts: List[List[int]], with_head: bool):
        """Per prompt, the prefix state its prefill starts from (None: from
        scratch), and the trunk positions computed to build new ones."""
        if not self.contract.share_prefix_min:
            return [None] * len(prompts), 0
        grain = split_grain(self.contract.prefill_chunk)
        plan = plan_shares(prompts, self.contract.share_prefix_min, grain, self.prefixes.keys(with_head))
        if not plan.parents:
            return [None] * len(prompts), 0
        built = build_prefixes(self.model, prompts, plan, self.prefixes, self.contract.prefill_chunk, with_head)
        return built.states, built.computed

    def _prefill_head(self) -> bool:
        """Whether prompts also go through the head (where rows may draft soon);
        a gap in a row's head history costs acceptance, never output."""
        return self.depth > 0 and self.policy.prefills_head()

    def _encode(self, req: Request) -> List[int]:
        if isinstance(req.prompt, str):
            ids = encode_text(self.model.tokenizer, valid_text(req.prompt))
        else:
            ids = token_ids(req.prompt)
        if not ids:
            raise PromptError("empty prompt")
        vocab = self.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"prompt token ids must be in [0, {vocab})")
        # Only rejected drafts land past it: the limit is on what a row keeps, as vLLM's.
        limit = self.model.max_context
        if limit is not None and len(ids) + req.max_tokens > limit:
            raise PromptError(
                f"prompt of {len(ids)} tokens + max_tokens {req.max_tokens} exceeds the model context of {limit} tokens"
            )
        return ids

    # -- one decode cycle (device only: nothing here waits for the host) ----
    def _cycle_depth(self, batch: SlotBatch, waiting: "_Samples") -> Optional[int]:
        """The depth of the next cycle, from the policy; None stops the decode."""
        sampled_residual = not batch.sampling.all_greedy and self.contract.acceptance == "residual"
        live = sum(r is not None for r in batch.rows)
        return self.policy.choose(sampled_residual, lambda: live > 1 and waiting.drained())

    def _launch(self, batch: SlotBatch, in_flight: int, k: int) -> "_InFlight":
        # The widest pass: the verify, or the head catch-up over the pairs a deeper cycle left.
        positions = max(k + 1, batch.cu_tokens.shape[1]) if k > 0 else 1
        self.threads.for_rows(batch.size * positions)
        t0 = time.perf_counter()
        self.launch_started.append(t0)
        self.policy.launched(k, t0, clean=not self._disturbed and batch.size == self.max_batch)
        self._disturbed = False
        rows = list(batch.rows)
        span = batch.span_bound(batch.trunk_len, in_flight)
        greedy = batch.sampling.all_greedy  # no random draws, no probability tensors
        draws = (
            None
            if greedy
            else cycle_draws(
                batch.key_base,
                batch.emitted[:, None] + mx.arange(k + 1, dtype=mx.int32)[None, :],
                self.contract.acceptance,
                compiled=self.contract.compile,
            )
        )  # [B, k+1, ...]: the randomness of each completion position this cycle decides
        num_valid = mx.clip(batch.max_tokens - batch.emitted - 1, 0, k)  # [B] rows near max_tokens draft fewer

        if k > 0:
            drafts, q = self._draft(batch, span, draws, k)  # [B, k], [B, k, V]
            mx.async_eval(drafts)  # computed while the host builds the verify
        else:
            drafts = mx.zeros((batch.size, 0), dtype=mx.int32)
            q = None
        before = batch.trunk_lengths()  # [B] (None without attention layers), the commit's base
        for c in batch.trunk:
            if isinstance(c, SlotKVCache):
                c.host_max = span
        verify_in = mx.concatenate([batch.primary[:, None], drafts], axis=1)  # [B, k+1]
        logits, hidden = self._verify((verify_in,), batch.trunk, T=k + 1)  # [B, k+1, V], [B, k+1, H]
        # Started now, so its tail computes while the host builds accept and commit.
        mx.async_eval(logits, hidden)
        d = decide(
            logits,
            drafts,
            q,
            num_valid,
            batch.active,
            draws,
            batch.sampling,
            rule=self.contract.acceptance,
            logprobs=any(r is not None and r.logprobs is not None for r in rows),
            compiled=self.contract.compile,
        )
        accepted, nxt, emitted_ids, keep = d.accepted, d.next_token, d.emitted_ids, d.keep
        batch.commit_trunk(before, keep, all_kept=(k == 0), span=span + k + 1, compiled=self.contract.compile)
        if k > 0:  # next cycle's depth-1 inputs: (H_0, d_1)..(H_{a-1}, d_a), (H_a, c)
            batch.cu_hidden = hidden
            batch.cu_tokens = emitted_ids.astype(mx.int32)
            batch.cu_take = mx.where(batch.active, accepted, 0)
            batch.cu_keep = keep
        batch.primary = nxt.astype(mx.int32)
        batch.emitted = batch.emitted + keep
        outputs = [accepted, emitted_ids, d.num_valid, d.bad] + ([d.logprobs] if d.logprobs is not None else [])
        mx.async_eval(outputs + batch.cache_state())
        self.stats["cycles"] += 1
        if self.policy.record is not None:
            self.policy.record["cycles_by_depth"][str(k)] += 1
        self.stats["decode_seconds"] += time.perf_counter() - t0
        return _InFlight(rows, k, accepted, emitted_ids, d.num_valid, d.bad, d.logprobs)

    def _draft(self, batch: SlotBatch, span: int, draws: Optional[mx.array], k: int):
        """Head catch-up, then d_1..d_k, in one graph (decode.draft)."""
        pending = HeadPending(batch.cu_hidden, batch.cu_tokens, batch.cu_take, batch.cu_keep)
        return self._draft_chain(pending, draws, batch.sampling, batch.head, k, span)

    def _collect(self, batch: SlotBatch, inf: "_InFlight") -> List[Completion]:
        t0 = time.perf_counter()
        # Python lists: the per-row loop indexes them, numpy scalars are slower.
        a = inf.accepted.tolist()  # waits for the cycle
        ids = inf.emitted_ids.tolist()
        nv = inf.nv.tolist()
        bad = inf.bad.tolist()
        lp = None if inf.logprobs is None else inf.logprobs.tolist()
        live = [b for b, r in enumerate(inf.rows) if r is not None]
        self.policy.observe([a[b] for b in live], [nv[b] for b in live])
        finished = []
        for b, row in enumerate(inf.rows):
            if row is None or batch.rows[b] is not row:
                continue  # the slot's row finished before this cycle was read
            batch.trunk_len[b] += a[b] + 1
            done = self._emit_row(row, a[b], ids[b], nv[b], bad[b], None if lp is None else lp[b])
            if done is not None:
                finished.append(done)
                batch.release(b)
                self._disturbed = True
        self.stats["decode_seconds"] += time.perf_counter() - t0
        return finished

    def _emit_row(self, row: Row, a: int, ids, nv: int, bad: bool, lp) -> Optional[Completion]:
        row.steps += 1
        if nv:
            row.drafted[:nv] += 1
        if a:
            row.accepted[:a] += 1
        # Drafts accepted before a non-finite decided position stand: one may
        # end the row, and then plain decoding never computes that position.
        new = ids[: a if bad else a + 1]
        if lp is not None and row.logprobs is not None:
            row.logprobs.extend(lp[: len(new)])
        row.tokens.extend(new)
        self.stats["decode_tokens"] += len(new)
        done = self._finish_if_done(row, new)
        if done is None and bad:
            return self._complete(row, "error", f"non-finite logits at completion position {len(row.tokens)}")
        return done

    def _finish_if_done(self, row: Row, new: List[int]) -> Optional[Completion]:
        """Apply EOS / stop ids / stop strings / max_tokens to a row's new tokens."""
        req = row.req
        start = len(row.tokens) - len(new)
        if row.stop_ids is None:
            row.stop_ids = frozenset(self.eos | set(req.stop_token_ids))
        stop_ids = row.stop_ids
        stop_at = next((start + i for i, t in enumerate(new) if t in stop_ids), None)
        if req.stop:
            # Only tokens before a stop id: plain decoding meets those first.
            upto = len(row.tokens) if stop_at is None else stop_at
            hit = find_stop_string(self.model.tokenizer, row.tokens[:upto], req.stop, row.stop_checked)
            if hit is not None:
                m, text = hit
                del row.tokens[m:]
                _trim(row)
                return self._complete(row, "stop", text=text)
            row.stop_checked = upto
        if stop_at is not None:
            del row.tokens[stop_at:]  # the stop token itself is not output
            _trim(row)
            return self._complete(row, "stop")
        if len(row.tokens) >= req.max_tokens:
            del row.tokens[req.max_tokens :]
            _trim(row)
            return self._complete(row, "length")
        return None

    def _complete(self, row: Row, reason: str, error: Optional[str] = None, text: Optional[str] = None):
        if text is None:
            text = self.model.tokenizer.decode(row.tokens) if row.tokens else ""
        return Completion(
            index=row.req.index,
            sample_index=row.sample_index,
            row_id=row.req.row_id,
            tokens=list(row.tokens),
            text=text,
            finish_reason=reason,
            error=error,
            drafted_by_depth=[int(x) for x in row.drafted],
            accepted_by_depth=[int(x) for x in row.accepted],
            steps=row.steps,
            prompt_tokens=row.prompt_tokens,
            shared_prefix_tokens=row.shared_prefix_tokens,
            logprobs=row.logprobs,
        )


@dataclass
class _InFlight:
    """A launched cycle: the rows it ran for and its device outputs."""

    rows: list
    depth: int
    accepted: mx.array  # [B]
    emitted_ids: mx.array  # [B, k+1]
    nv: mx.array  # [B]
    bad: mx.array  # [B]
    logprobs: Optional[mx.array]  # [B, k+1]


@dataclass
class _Prepared:
    req: Request
    pre: Prefilled
    key_hash: int
    first_tokens: List[int]  # [n] one per sample
    first_logprobs: Optional[List[float]]
    nonfinite: bool
    shared_prefix: int = 0  # prompt tokens its prefill took from a shared prefix

    def items(self, depth: int):
        for s in range(self.req.n):
            if self.nonfinite:
                msg = "non-finite logits at completion position 0"
                done = error_completion(self.req, s, msg, self.pre.length)
                done.shared_prefix_tokens = self.shared_prefix
                yield "done", done
            else:
                yield "row", (self.pre, self.row(s, depth), self.first_tokens[s])

    def row(self, s: int, depth: int) -> Row:
        row = Row(self.req, s, self.key_hash, self.pre.length, depth, shared_prefix_tokens=self.shared_prefix)
        row.tokens.append(self.first_tokens[s])
        if row.logprobs is not None:
            row.logprobs.append(self.first_logprobs[s])
        return row


class _Samples:
    """Expands requests into (request, sample) rows, prefilled a group at a
    time (up to a batch's rows and a padded token budget, even when one slot
    is free: docs/performance.md); a request's n samples share one prefill."""

    def __init__(self, requests: Iterator[Request]):
        self.requests = requests
        self.ready = deque()  # ("row", (pre, row, first)) or ("done", Completion)
        self.ahead: Optional[Request] = None  # read ahead by `drained`
        self.exhausted = False

    @property
    def pending(self) -> bool:
        return bool(self.ready) or self.ahead is not None or not self.exhausted

    def drained(self) -> bool:
        """Whether no row is left to come (reads one request ahead to know early)."""
        if not self.ready and self.ahead is None and not self.exhausted:
            self.ahead = self._pull()
        return not self.pending

    def _pull(self) -> Optional[Request]:
        if self.ahead is not None:
            req, self.ahead = self.ahead, None
            return req
        req = next(self.requests, None)
        self.exhausted = req is None
        return req

    def next(self, rt: BatchRuntime, seed: int):
        if not self.ready:
            self._prepare_group(rt, seed, want=rt.max_batch)
        return self.ready.popleft() if self.ready else None

    def _prepare_group(self, rt: BatchRuntime, seed: int, want: int):
        group, rows, longest = [], 0, 0
        budget = rt.contract.prefill_batch_tokens
        while rows < want:
            req = self._pull()
            if req is None:
                break
            try:
                ids = rt._encode(req)
            except PromptError as e:  # every sample of a bad prompt is an error row
                self.ready.extend(("done", error_completion(req, s, str(e))) for s in range(req.n))
                continue
            group.append((req, ids))
            rows += req.n
            longest = max(longest, len(ids))
            if longest * len(group) >= budget:
                break
        if group:
            for prepared in rt.prepare(group, seed):
                self.ready.extend(prepared.items(rt.depth))


def _key_hash(req: Request) -> int:
    base = row_hash(req.row_id)
    if req.sampling.seed is not None:
        base = row_hash((base, int(req.sampling.seed)))
    return base


def _trim(row: Row):
    if row.logprobs is not None:
        del row.logprobs[len(row.tokens) :]


def _new_stats(depth: int) -> dict:
    return {
        "prefill_tokens": 0,  # prompt tokens computed (shared prefixes once)
        "shared_prefix_tokens": 0,  # prompt tokens taken from a shared prefix, per sample row
        "decode_tokens": 0,
        "prefill_seconds": 0.0,
        "decode_seconds": 0.0,
        "cycles": 0,
        "batch_shrinks": 0,
        "depth_used": depth,
    }
