"""Joint training of the trunk and its MTP head (DeepSeek-V3 style).

Loss = CE(trunk) + w1 * L(head, depth 1) + w2 * L(head, depth 2); the head's loss mixes cross-entropy on the
data with cross-entropy against the trunk's own (stop-gradient) distribution, since acceptance is agreement
with the trunk. Depth 2 feeds the head's output back with x_{t+2}, as the runtime drafts.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mtplx.training.model import TinyMTP


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 800
    seed: int = 0
    # Small batches: early in training more updates beat bigger ones per token.
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_steps: int = 40
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    depth1_weight: float = 0.5
    depth2_weight: float = 0.25
    # Share of each head loss taken against the trunk's distribution.
    distill: float = 0.5
    # The embedding and lm_head start from the bigram fit; full-rate updates would undo it early.
    embedding_lr_scale: float = 0.1
    log_every: int = 25

    def to_dict(self) -> dict:
        return asdict(self)


def _cross_entropy(logits, targets):  # logits [B, T, V], targets [B, T] -> scalar
    return nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="mean")


def _soft_cross_entropy(logits, teacher_logits):  # both [B, T, V]; teacher already stop-gradient
    p = mx.softmax(teacher_logits.astype(mx.float32), axis=-1)
    logq = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    return -(p * logq).sum(axis=-1).mean()


def _head_loss(logits, targets, teacher, distill: float):
    hard = _cross_entropy(logits, targets)
    if distill <= 0:
        return hard, hard
    return (1 - distill) * hard + distill * _soft_cross_entropy(logits, teacher), hard


def mtp_losses(model: TinyMTP, tokens: mx.array, settings: TrainSettings):
    """tokens [B, N] -> (total, trunk CE, depth-1 CE, depth-2 CE) on the data."""
    hidden = model.hidden_chunked(tokens)  # [B, N, H]
    logits = model.lm_head(hidden)  # [B, N, V]
    trunk = _cross_entropy(logits[:, :-1], tokens[:, 1:])
    teacher = mx.stop_gradient(logits)
    # depth 1: (h_t, x_{t+1}) -> x_{t+2}
    l1, out1 = model.head(hidden[:, :-1], tokens[:, 1:])  # [B, N-1, V], [B, N-1, H]
    d1, d1_ce = _head_loss(l1[:, :-1], tokens[:, 2:], teacher[:, 1:-1], settings.distill)
    # depth 2: (head output at t, x_{t+2}) -> x_{t+3}
    l2, _ = model.head(out1[:, :-1], tokens[:, 2:], depth=2)  # [B, N-2, V]
    d2, d2_ce = _head_loss(l2[:, :-1], tokens[:, 3:], teacher[:, 2:-1], settings.distill)
    total = trunk + settings.depth1_weight * d1 + settings.depth2_weight * d2
    return total, trunk, d1_ce, d2_ce


def learning_rate_schedule(settings: TrainSettings, scale: float = 1.0):
    top, low = scale * settings.learning_rate, scale * settings.min_learning_rate
    warm = max(1, min(settings.warmup_steps, settings.steps - 1))
    warmup = optim.linear_schedule(top / warm, top, warm)
    decay = optim.cosine_decay(top, max(1, settings.steps - warm), low)
    return optim.join_schedules([warmup, decay], [warm])


def _is_embedding_or_output(path: str, _weight) -> bool:
    return path.endswith(("embed_tokens.weight", "lm_head.weight"))


def make_optimizer(settings: TrainSettings):
    """AdamW; the embedding and lm_head at `embedding_lr_scale` of the rate."""

    def adamw(scale):
        return optim.AdamW(learning_rate=learning_rate_schedule(settings, scale), weight_decay=settings.weight_decay)

    return optim.MultiOptimizer([adamw(settings.embedding_lr_scale), adamw(1.0)], [_is_embedding_or_output])


class BatchSampler:
    """Random windows of seq_len + 1 tokens from one token stream, by seed."""

    def __init__(self, stream: np.ndarray, settings: TrainSettings):
        n = settings.seq_len + 1
        if len(stream) <= n:
            raise ValueError(f"corpus of {len(stream)} tokens is shorter than one window ({n})")
        self.stream = stream
        self.offsets = np.arange(n)
        self.high = len(stream) - n
        self.batch = settings.batch_size
        self.rng = np.random.default_rng(settings.seed)

    def next(self) -> mx.array:
        starts = self.rng.integers(0, self.high + 1, size=self.batch)
        return mx.array(self.stream[starts[:, None] + self.offsets])  # [B, seq_len + 1]


def make_train_step(model: TinyMTP, optimizer, settings: TrainSettings):
    def loss_fn(m, tokens):
        total, trunk, d1, d2 = mtp_losses(m, tokens, settings)
        return total, (trunk, d1, d2)

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(tokens):
        (total, parts), grads = grad_fn(model, tokens)
        grads, _ = optim.clip_grad_norm(grads, settings.grad_clip)
        optimizer.update(model, grads)
        return mx.stack([total, *parts])

    return step


def train(
    model: TinyMTP,
    stream: np.ndarray,
    settings: TrainSettings,
    log: Optional[Callable[[dict], None]] = None,
) -> List[dict]:
    """Runs `settings.steps` steps; returns the loss curve (one entry per log_every)."""
    optimizer = make_optimizer(settings)
    sampler = BatchSampler(stream, settings)
    step = make_train_step(model, optimizer, settings)
    model.train()
    curve, acc, n_acc = [], np.zeros(4), 0
    start = time.perf_counter()
    for i in range(1, settings.steps + 1):
        losses = step(sampler.next())
        mx.eval(losses, model.state, optimizer.state)
        acc += np.array(losses.tolist())
        n_acc += 1
        if i % settings.log_every == 0 or i == settings.steps:
            mean = acc / n_acc
            entry = {
                "step": i,
                "loss": round(float(mean[0]), 4),
                "trunk": round(float(mean[1]), 4),
                "head_d1": round(float(mean[2]), 4),
                "head_d2": round(float(mean[3]), 4),
                "lr": float(optimizer.optimizers[-1].learning_rate.item()),
                "elapsed_s": round(time.perf_counter() - start, 1),
                "tokens_per_s": round(i * settings.batch_size * settings.seq_len / (time.perf_counter() - start), 1),
            }
            if not all(math.isfinite(x) for x in mean):
                raise FloatingPointError(f"non-finite loss at step {i}: {entry}")
            curve.append(entry)
            if log is not None:
                log(entry)
            acc, n_acc = np.zeros(4), 0
    model.eval()
    return curve
