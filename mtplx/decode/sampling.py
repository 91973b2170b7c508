"""Per-row sampling: parameters, logit processing, keyed randomness and the
vectorised accept/correct/bonus step. Every draw is a pure function of a key
(no global RNG state) made of SplitMix64 words on device: mx.random's
uniforms can round up to 1.0. See docs/design.md, "Exactness" and "Keyed
randomness"."""

from __future__ import annotations

import enum
import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from mtplx import backends
from mtplx.decode.numerics import ZERO_MASS_TOL, log_softmax_f32, nonfinite_rows, raise_for_rows, safe_normalize

RULES = ("residual", "coupled")


@dataclass(frozen=True)
class SamplingParams:
    """How one row samples. temperature 0 means greedy (argmax, ties to the
    lowest token id); the filters then have no effect."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    # Mixed into the row's key with its row id: unlike vLLM's seed, rows with other ids still differ.
    seed: int | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, numbers.Real) or not (0.0 <= m < 1.0):
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {m!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer))):
            raise ValueError(f"seed must be an integer or None, got {s!r}")

    @property
    def greedy(self) -> bool:
        return bool(self.temperature == 0)


class BatchSampling(NamedTuple):
    """SamplingParams of B rows as device arrays, one entry per row."""

    temperature: mx.array  # [B] float32
    top_k: mx.array  # [B] int32
    top_p: mx.array  # [B] float32
    min_p: mx.array  # [B] float32
    greedy: mx.array  # [B] bool
    # Host-side, so the hot path never reads the device to branch.
    any_filter: bool = True  # some sampled row uses top-k / top-p / min-p
    all_greedy: bool = False
    any_greedy: bool = True  # some row is greedy: its one-hot is built alongside


_INT32_MAX = 2**31 - 1
_MIN_TEMPERATURE = 1.5e-45  # float32's smallest positive value, once rounded


def batch_sampling(params: Sequence[SamplingParams]) -> BatchSampling:
    return BatchSampling(
        # A positive temperature below float32's smallest (1.4e-45) would round to 0: 0 / 0.
        temperature=mx.array(
            [max(float(s.temperature), _MIN_TEMPERATURE) if not s.greedy else 0.0 for s in params], dtype=mx.float32
        ),
        # A top_k past int32 keeps every token, as any top_k past the vocabulary does.
        top_k=mx.array([min(int(s.top_k), _INT32_MAX) for s in params], dtype=mx.int32),
        top_p=mx.array([float(s.top_p) for s in params], dtype=mx.float32),
        min_p=mx.array([float(s.min_p) for s in params], dtype=mx.float32),
        greedy=mx.array([s.greedy for s in params], dtype=mx.bool_),
        any_filter=any(not s.greedy and (s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0.0) for s in params),
        all_greedy=all(s.greedy for s in params),
        any_greedy=any(s.greedy for s in params),
    )


_U64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64 increment (odd, golden ratio)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Arbitrary odd salts, so "seed 5" and "sample index 5" never mix alike.
_SALT_SEED = 0xD1B54A32D192ED03
_SALT_POS = 0x8CB92BA72F3D8DD7
_SALT_PURPOSE = 0xA0761D6478BD642F


class Purpose(enum.IntEnum):
    """What a draw is for; mixed into its key so draws never share bits."""

    DRAFT = 1  # the drafter's categorical draw (residual rule)
    ACCEPT = 2  # the uniform of the accept test
    RESIDUAL = 3  # the correction or bonus draw
    GUMBEL = 4  # the per-position target noise of the coupled rule


def _np_u64(v):
    return np.uint64(v & _U64)


def _mx_u64(v):
    # mx.array cannot take a Python int above 2**63 directly.
    return mx.array(np.uint64(v & _U64))


def _mix64(z, const):
    """SplitMix64 finaliser (a bijection); `const` makes z's uint64 scalar (numpy or mlx)."""
    z = (z ^ (z >> const(30))) * const(_MIX1)
    z = (z ^ (z >> const(27))) * const(_MIX2)
    return z ^ (z >> const(31))


def row_hash(row_id) -> int:
    """Stable 64-bit hash of a row id (not Python's salted hash()); 7, "7" and b"7" differ."""
    if isinstance(row_id, (int, np.integer)) and not isinstance(row_id, (bool, np.bool_)):
        data = b"int:" + str(int(row_id)).encode()
    elif isinstance(row_id, str):
        data = b"str:" + row_id.encode("utf-8")
    elif isinstance(row_id, bytes):
        data = b"bytes:" + row_id
    else:
        data = type(row_id).__qualname__.encode() + b":" + repr(row_id).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _row_base(seed: int, row_hashes, sample_index) -> np.ndarray:
    """uint64 [B]: per-row key material from seed, row hash and sample index (host, wrapping)."""
    # Through Python ints: numpy reads a list mixing ints above and below 2**63 as float64.
    if hasattr(row_hashes, "tolist"):
        row_hashes = row_hashes.tolist()
    hashes = np.array([int(h) & _U64 for h in row_hashes], dtype=np.uint64)  # [B]
    samples = np.broadcast_to(np.asarray(sample_index, dtype=np.int64), hashes.shape)
    samples = samples.astype(np.uint64)  # [B]
    seed_word = np.full(hashes.shape, int(seed or 0) & _U64, dtype=np.uint64)  # [B]
    with np.errstate(over="ignore"):
        h = _mix64(seed_word ^ _np_u64(_SALT_SEED), _np_u64)
        h = _mix64(h ^ hashes, _np_u64)
        h = _mix64(h + (samples + _np_u64(1)) * _np_u64(_GAMMA), _np_u64)
    return h


def _join64(keys: mx.array) -> mx.array:
    """uint32 [..., 2] -> uint64 [...]."""
    hi = keys[..., 0].astype(mx.uint64)
    lo = keys[..., 1].astype(mx.uint64)
    return (hi << _mx_u64(32)) | lo


def _split64(words: mx.array) -> mx.array:
    """uint64 [...] -> uint32 [..., 2] (high word first)."""
    hi = (words >> _mx_u64(32)).astype(mx.uint32)
    lo = (words & _mx_u64(0xFFFFFFFF)).astype(mx.uint32)
    return mx.stack([hi, lo], axis=-1)


def position_keys(seed: int, row_hashes, sample_index, positions: mx.array, compiled: bool = False) -> mx.array:
    """uint32 [B, T, 2]: the key of each row's token at each completion
    position [B, T]; row_hashes from row_hash, sample_index B ints (or one),
    seed None is 0. `compiled` traces the mixing (the same words)."""
    return keys_from_base(row_key_base(seed, row_hashes, sample_index), positions, compiled)


def row_key_base(seed: int, row_hashes, sample_index) -> mx.array:
    """uint64 [B]: each row's key material, which `keys_from_base` mixes with positions."""
    return mx.array(_row_base(seed, row_hashes, sample_index))


def keys_from_base(base: mx.array, positions, compiled: bool = False) -> mx.array:
    """uint32 [B, T, 2]: `position_keys` from rows' `row_key_base` [B]."""
    positions = mx.array(positions) if not isinstance(positions, mx.array) else positions
    return (_keys_at_compiled if compiled else _keys_at)(base, positions)


def _keys_at(base: mx.array, positions: mx.array) -> mx.array:
    return _split64(_key_words(base, positions))  # [B, T, 2]


def _key_words(base: mx.array, positions: mx.array) -> mx.array:
    """uint64 [B, T]: the words `_keys_at` splits into uint32 pairs."""
    base = base.reshape(base.shape + (1,) * (positions.ndim - 1))  # [B, 1]
    pos = positions.astype(mx.int64).astype(mx.uint64)  # [B, T]
    # mix64 is a bijection, so distinct positions of one row never collide.
    return _mix64(base ^ _mix64(pos + _mx_u64(_SALT_POS), _mx_u64), _mx_u64)  # [B, T]


_keys_at_compiled = mx.compile(_keys_at)


def _purpose_tag(purpose: Purpose) -> int:
    """The 64-bit word a purpose mixes into keys (host arithmetic, wrapping)."""
    with np.errstate(over="ignore"):
        return int(_mix64(np.array([int(purpose) + _SALT_PURPOSE], dtype=np.uint64), _np_u64)[0])


_PURPOSE_TAGS = {p: _purpose_tag(p) for p in Purpose}


def _purpose_word(keys: mx.array, purpose: Purpose) -> mx.array:
    """uint64 [...]: the word `purpose_keys` splits into uint32 pairs."""
    return _mix64(_join64(keys) ^ _mx_u64(_PURPOSE_TAGS[purpose]), _mx_u64)


def purpose_keys(keys: mx.array, purpose: Purpose) -> mx.array:
    """uint32 [..., 2]: keys with a purpose mixed in (injective in both)."""
    return _split64(_purpose_word(keys, purpose))


def _stream_words(word: mx.array, n: int) -> mx.array:
    """uint64 [..., n]: the first n SplitMix64 stream words of each key word."""
    j = mx.arange(1, n + 1, dtype=mx.uint64)  # [n]
    return _mix64(word[..., None] + j * _mx_u64(_GAMMA), _mx_u64)  # [..., n]


def _uniform_of(words: mx.array) -> mx.array:
    return (words >> _mx_u64(40)).astype(mx.float32) * (2.0**-24)  # the top 24 bits


def _gumbel_of(words: mx.array) -> mx.array:
    u = ((words >> _mx_u64(41)).astype(mx.float32) + 0.5) * (2.0**-23)  # the top 23 bits, a cell's midpoint
    return -mx.log(-mx.log(u))


def uniform_from_keys(keys: mx.array) -> mx.array:
    """float32 [...] uniform on a 2**-24 grid below 1 (a one-hot target always accepts)."""
    return _uniform_of(_stream_words(_join64(keys), 1)[..., 0])  # [...]


def gumbel_from_keys(keys: mx.array, n: int) -> mx.array:
    """float32 [..., n] Gumbel noise from cell midpoints (finite logs), element j from (key, j)."""
    return _gumbel_of(_stream_words(_join64(keys), n))  # [..., n]


# The cycle's draws: the *_from_keys of purpose_keys without the uint32 round trip.


def _uniform_for(keys: mx.array, purpose: Purpose) -> mx.array:
    return _uniform_of(_stream_words(_purpose_word(keys, purpose), 1)[..., 0])  # [...]


def _gumbel_for(keys: mx.array, purpose: Purpose, n: int) -> mx.array:
    return _gumbel_of(_stream_words(_purpose_word(keys, purpose), n))  # [..., n]


# The last axis of `residual_uniforms`.
RESIDUAL_DRAWS = (Purpose.DRAFT, Purpose.ACCEPT, Purpose.RESIDUAL)


def residual_uniforms(base: mx.array, positions: mx.array, compiled: bool = False) -> mx.array:
    """float32 [B, T, 3]: `_uniform_for(keys_from_base(base, positions), p)` for
    each p of RESIDUAL_DRAWS, in one run of hash ops."""
    return (_residual_uniforms_compiled if compiled else _residual_uniforms)(base, positions)


def _residual_uniforms(base: mx.array, positions: mx.array) -> mx.array:
    tags = mx.array(np.array([_PURPOSE_TAGS[p] for p in RESIDUAL_DRAWS], dtype=np.uint64))  # [3]
    # The key's word is what _join64 rebuilds from its uint32 pair.
    words = _mix64(_key_words(base, positions)[..., None] ^ tags, _mx_u64)  # [B, T, 3]
    return _uniform_of(_stream_words(words, 1)[..., 0])  # [B, T, 3]


_residual_uniforms_compiled = mx.compile(_residual_uniforms)


def residual_draw(uniforms: mx.array, purpose: Purpose) -> mx.array:
    """float32 [B, T]: the `purpose` column of `residual_uniforms` [B, T, 3]."""
    return uniforms[..., RESIDUAL_DRAWS.index(purpose)]


def _lowest_argmax(x: mx.array) -> mx.array:
    """int32 [...]: index of the maximum of x [..., V], ties to the lowest."""
    V = x.shape[-1]
    top = mx.max(x, axis=-1, keepdims=True)
    ids = mx.arange(V, dtype=mx.int32)
    return mx.min(mx.where(x == top, ids, V), axis=-1).astype(mx.int32)


def _one_hot(idx: mx.array, V: int) -> mx.array:
    return (mx.arange(V, dtype=mx.int32) == idx[..., None]).astype(mx.float32)


def _filter_logits(z: mx.array, top_k: mx.array, top_p: mx.array, min_p: mx.array) -> mx.array:
    """Top-k, top-p, then min-p on scaled logits z [B, T, V] (params [B, 1, 1]),
    removed tokens -inf. Each keeps a sorted prefix, so together they are a
    logit threshold: ties with the last kept token stay (id order is moot)."""
    V = z.shape[-1]
    s = -mx.sort(-z, axis=-1)  # [B, T, V] descending
    rank = mx.arange(V, dtype=mx.int32)  # [V]
    keep = (top_k == 0) | (rank < top_k)  # [B, 1, V]
    ps = mx.exp(log_softmax_f32(mx.where(keep, s, -mx.inf)))  # [B, T, V], renormalised after top-k
    mass_before = mx.cumsum(ps, axis=-1, inclusive=False)  # [B, T, V]
    # top-p 1 is "off" exactly, not "mass below 1.0", which rounding could break.
    keep = keep & ((top_p >= 1.0) | (mass_before < top_p))
    # min-p is a ratio to the top token, so a logit gap: s - s_0 >= log(min_p).
    keep = keep & (s - s[..., :1] >= mx.log(min_p))
    n_keep = mx.maximum(mx.sum(keep, axis=-1, keepdims=True), 1).astype(mx.int32)  # [B, T, 1]
    threshold = mx.take_along_axis(s, n_keep - 1, axis=-1)  # [B, T, 1]
    return mx.where(z >= threshold, z, -mx.inf)


def target_probs(logits: mx.array, bs: BatchSampling, finite: bool = False) -> mx.array:
    """float32 [B, T, V] (or [B, V]): each row's distribution (temperature,
    filters, renormalise; greedy: the argmax's one-hot). A position with a NaN
    or +inf logit comes out all NaN, unless `finite` says none has one."""
    if logits.ndim == 2:
        return target_probs(logits[:, None, :], bs, finite)[:, 0, :]
    x = logits.astype(mx.float32)  # [B, T, V]
    V = x.shape[-1]
    col = lambda a: a.reshape(-1, 1, 1)  # [B] -> [B, 1, 1]
    greedy = col(bs.greedy)
    # A greedy row's 0 would divide by zero; its one-hot replaces the result.
    temperature = mx.where(greedy, 1.0, col(bs.temperature)) if bs.any_greedy else col(bs.temperature)
    # Shifted first, so the top is exactly 0 at any temperature (x / 1e-40 overflows).
    z = (x - mx.max(x, axis=-1, keepdims=True)) / temperature  # [B, T, V], max 0
    if bs.all_greedy:
        probs = _one_hot(greedy_tokens(logits), V)
    else:
        if bs.any_filter:  # the full-vocabulary sort only when some row filters
            z = _filter_logits(z, col(bs.top_k), col(bs.top_p), col(bs.min_p))  # keeps the top: max 0
        probs = _softmax_of_max_zero(z)  # [B, T, V]
        if bs.any_greedy:  # an argmax, a one-hot and a select over the vocabulary, needless without greedy rows
            probs = mx.where(greedy, _one_hot(greedy_tokens(logits), V), probs)
    if finite:
        return probs
    broken = mx.any(mx.isnan(x) | (x == mx.inf), axis=-1, keepdims=True)  # [B, T, 1]
    return mx.where(broken, mx.nan, probs)


def _softmax_of_max_zero(z: mx.array) -> mx.array:
    """Softmax over the last axis of float32 z (max 0) with the backend's exp (on
    the CPU `pow_exp`, within 3.7e-6, as MLX's exp is); -inf entries give 0."""
    e = backends.probabilities_exp(z)
    return e / mx.sum(e, axis=-1, keepdims=True)


def _per_row(mask, ndim: int) -> mx.array:
    """A scalar or per-row mask ([B] or [B, T]) shaped to broadcast against [..., V]."""
    m = mx.array(mask, dtype=mx.float32) if not isinstance(mask, mx.array) else mask.astype(mx.float32)
    if m.ndim == 0 or m.ndim == ndim:
        return m
    return m.reshape(m.shape + (1,) * (ndim - m.ndim))


def residual_distribution(target: mx.array, draft: mx.array, mask=None) -> mx.array:
    """float32 [..., V]: normalise(max(p - mask * q, 0)), mask None = 1 (the
    correction), 0 = the bonus; a mass <= ZERO_MASS_TOL returns p."""
    p = target.astype(mx.float32)
    q = draft.astype(mx.float32)
    m = 1.0 if mask is None else _per_row(mask, p.ndim)
    r = mx.maximum(p - m * q, 0.0)  # [..., V]
    mass = mx.sum(r, axis=-1, keepdims=True)  # [..., 1]
    empty = mass <= ZERO_MASS_TOL
    r = r / mx.where(empty, 1.0, mass)
    return mx.where(empty, safe_normalize(mx.maximum(p, 0.0)), r)


def _categorical(probs: mx.array, u: mx.array) -> mx.array:
    """int32 [...]: inverse-CDF draw from probs [..., V] (any total), u [...]
    in [0, 1): j where cdf_{j-1} <= u * total < cdf_j, never a zero-probability
    token. `cdf < total` guards u * total rounding up; both conditions hold on
    a prefix (cdf never falls), so one sum counts it."""
    cdf = mx.cumsum(probs, axis=-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    point = u[..., None] * total  # [..., 1]
    return mx.sum((cdf <= point) & (cdf < total), axis=-1).astype(mx.int32)  # [...]


def _gumbel_argmax(probs: mx.array, keys: mx.array) -> mx.array:
    """int32 [...]: argmax(log probs + GUMBEL noise), an exact draw from probs [..., V]."""
    noise = _gumbel_for(keys, Purpose.GUMBEL, probs.shape[-1])  # [..., V]
    return mx.argmax(mx.log(probs.astype(mx.float32)) + noise, axis=-1).astype(mx.int32)


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; expected one of {RULES}")


def draft_tokens(q: mx.array, keys: mx.array, rule: str) -> mx.array:
    """int32 [B, T]: drafts from q [B, T, V], keys [B, T, 2]: residual, a DRAFT
    draw; coupled, the Gumbel-argmax under the target's noise."""
    _check_rule(rule)
    if rule == "coupled":
        return _gumbel_argmax(q, keys)
    return residual_draft(q, _uniform_for(keys, Purpose.DRAFT))


def residual_draft(q: mx.array, u: mx.array) -> mx.array:
    """int32 [B, T]: the residual rule's draft from q [B, T, V], DRAFT uniforms u [B, T]."""
    return _categorical(q, u)


def sample_plain(p: mx.array, keys: mx.array, rule: str) -> mx.array:
    """int32 [B, T]: the keyed sampler each rule reduces to at depth 0
    (coupled: Gumbel-argmax; residual: the bonus's draw, RESIDUAL keys)."""
    _check_rule(rule)
    if rule == "coupled":
        return _gumbel_argmax(p, keys)
    return _plain_residual_draw(p, _uniform_for(keys, Purpose.RESIDUAL))


def _plain_residual_draw(p: mx.array, u: mx.array) -> mx.array:
    """int32 [B, T]: the residual rule's depth-0 draw from p [B, T, V], uniforms u [B, T]."""
    return _categorical(residual_distribution(p, mx.zeros_like(p), 0.0), u)


def _accept_flags(u: mx.array, p_d: mx.array, q_d: mx.array) -> mx.array:
    """u < p(d)/q(d) without division: q(d) = 0 < p(d) accepts, both 0 rejects."""
    return u * q_d < p_d


def _accepted_count(ok: mx.array) -> mx.array:
    """int32 [B]: length of the leading run of True in ok [B, k]."""
    return mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1).astype(mx.int32)


def _at(x: mx.array, idx: mx.array) -> mx.array:
    """x[b, idx[b]] for x [B, T, ...] and idx [B]."""
    idx = idx.reshape((-1,) + (1,) * (x.ndim - 1))  # [B, 1, ...]
    return mx.take_along_axis(x, idx, axis=1)[:, 0]


def speculative_accept(
    draft: mx.array,
    q: mx.array,
    p: mx.array,
    keys: mx.array,
    *,
    num_valid=None,
    rule: str = "residual",
    check_finite: bool = True,
) -> tuple[mx.array, mx.array]:
    """One accept/correct/bonus step (docs/design.md, "Exactness"): draft [B, k],
    q [B, k, V], p [B, k+1, V], keys [B, k+1, 2] (d_{i+1} and p_{i+1} share
    keys[:, i]) -> (accepted [B], next [B]). num_valid [B] (default k) limits
    each row's drafts. check_finite raises NonFiniteError on rows of p or q."""
    _check_rule(rule)
    B, k = draft.shape
    V = p.shape[-1]
    if p.shape != (B, k + 1, V) or q.shape != (B, k, V) or keys.shape != (B, k + 1, 2):
        raise ValueError(
            f"speculative_accept shapes disagree: draft {draft.shape}, q {q.shape}, "
            f"p {p.shape}, keys {keys.shape}; expected q [B, k, V], p [B, k+1, V], keys [B, k+1, 2]"
        )
    if check_finite:
        raise_for_rows(nonfinite_rows(p) | nonfinite_rows(q), what="probabilities")
    if num_valid is None:
        nv = mx.full((B,), k, dtype=mx.int32)
    else:
        nv = mx.clip(mx.array(num_valid).astype(mx.int32).reshape(B), 0, k)  # [B]
    if k == 0:  # no drafts: what each rule reduces to, without the empty [B, 0] ops
        return mx.zeros((B,), dtype=mx.int32), sample_plain(p, keys, rule)[:, 0]
    valid = mx.arange(k, dtype=mx.int32)[None, :] < nv[:, None]  # [B, k]
    draft = draft.astype(mx.int32)

    if rule == "coupled":
        target = _gumbel_argmax(p, keys)  # [B, k+1]
        accepted = _accepted_count((draft == target[:, :k]) & valid)
        return accepted, _at(target, accepted)

    u_accept = _uniform_for(keys[:, :k], Purpose.ACCEPT)  # [B, k]
    u_residual = _uniform_for(keys, Purpose.RESIDUAL)  # [B, k+1]
    return _residual_accept(draft, q, p, u_accept, u_residual, valid, nv)


def residual_accept(
    draft: mx.array, q: mx.array, p: mx.array, uniforms: mx.array, num_valid: mx.array
) -> tuple[mx.array, mx.array]:
    """`speculative_accept`, residual rule, from `residual_uniforms` [B, k+1, 3];
    num_valid [B] in 0..k; no finite check (the cycle's graphs guard)."""
    k = draft.shape[1]
    u_residual = residual_draw(uniforms, Purpose.RESIDUAL)  # [B, k+1]
    if k == 0:  # sample_plain's residual draw
        return mx.zeros((p.shape[0],), dtype=mx.int32), _plain_residual_draw(p, u_residual)[:, 0]
    valid = mx.arange(k, dtype=mx.int32)[None, :] < num_valid[:, None]  # [B, k]
    u_accept = residual_draw(uniforms, Purpose.ACCEPT)[:, :k]  # [B, k]
    return _residual_accept(draft.astype(mx.int32), q, p, u_accept, u_residual, valid, num_valid)


def _residual_accept(draft, q, p, u_accept, u_residual, valid, nv) -> tuple[mx.array, mx.array]:
    """Accept, then correct or bonus: u_accept [B, k], u_residual [B, k+1], valid [B, k], nv [B]."""
    k = draft.shape[1]
    p_d = mx.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]  # [B, k]
    q_d = mx.take_along_axis(q, draft[..., None], axis=-1)[..., 0]  # [B, k]
    accepted = _accepted_count(_accept_flags(u_accept, p_d, q_d) & valid)  # [B]
    # q has no index k: any finite row stands in, the bonus's mask 0 zeroes it.
    q_next = _at(q, mx.minimum(accepted, k - 1))  # [B, V]
    mask = (accepted < nv).astype(mx.float32)  # [B]: 1 = correction, 0 = bonus
    residual = residual_distribution(_at(p, accepted), q_next, mask)  # [B, V]
    return accepted, _categorical(residual, _at(u_residual, accepted))


def greedy_accept(draft: mx.array, logits: mx.array, num_valid=None) -> tuple[mx.array, mx.array]:
    """speculative_accept for all-greedy rows, on argmaxes alone:
    draft [B, k], logits [B, k+1, V] -> (accepted [B], next [B])."""
    B, k = draft.shape
    target = greedy_tokens(logits)  # [B, k+1]
    nv = mx.full((B,), k, dtype=mx.int32) if num_valid is None else mx.clip(num_valid.astype(mx.int32), 0, k)
    valid = mx.arange(k, dtype=mx.int32)[None, :] < nv[:, None]  # [B, k]
    accepted = _accepted_count((draft.astype(mx.int32) == target[:, :k]) & valid)  # [B]
    return accepted, _at(target, accepted)


def greedy_tokens(logits: mx.array) -> mx.array:
    """int32 [...]: mlx-lm's greedy token, the lowest id among the largest
    `logits - logsumexp(logits)` in the logits' dtype. That subtraction can tie
    half-precision logits a step apart; in float32 only ones under ~1e-6 apart
    (below the 1e-4 near-tie bound), so float32 skips it."""
    if logits.dtype != mx.float32:
        logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return _lowest_argmax(logits)
