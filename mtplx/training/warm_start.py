"""A bigram warm start for the embedding, the output projection and the head: a random model spends most of a
short training budget reaching the unigram loss, while bigram counts cost one pass and fitting them is nearly free.
E and the untied lm_head W are fitted so that W . rmsnorm(E[x]) gives log P(next | x) (a fresh trunk, its residual
branches near zero, then predicts bigrams); the head's fc starts by passing x_{t+1}'s embedding through.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from mtplx.training.model import TinyMTP


def bigram_counts(stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """[V, V] float32 counts of (x_t, x_{t+1}) pairs."""
    pairs = stream[:-1].astype(np.int64) * vocab_size + stream[1:]
    return np.bincount(pairs, minlength=vocab_size * vocab_size).reshape(vocab_size, vocab_size).astype(np.float32)


def fit_bigram(counts: np.ndarray, hidden_size: int, steps: int = 400, learning_rate: float = 3e-2, eps: float = 1e-6):
    """E [V, H], W [V, H] minimising the counts-weighted CE of softmax(rmsnorm(E) @ W^T) -> (E, W, nats/token)."""
    C = mx.array(counts)
    total = C.sum()
    V = counts.shape[0]
    params = {"E": 0.02 * mx.random.normal((V, hidden_size)), "W": 0.02 * mx.random.normal((V, hidden_size))}

    def loss_fn(p):
        logits = mx.fast.rms_norm(p["E"], None, eps) @ p["W"].T  # [V, V]
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return -(C * logp).sum() / total

    opt = optim.Adam(learning_rate=learning_rate)
    step = mx.value_and_grad(loss_fn)
    for _ in range(steps):
        loss, grads = step(params)
        opt.update(params, grads)
        mx.eval(params, opt.state)
    E = params["E"] / mx.sqrt(mx.mean(params["E"] ** 2, axis=-1, keepdims=True) + eps)  # unit RMS rows
    return E, params["W"], float(loss_fn(params).item())


def warm_start(model: TinyMTP, stream: np.ndarray, steps: int = 400) -> dict:
    """Load the bigram fit into the model; returns the fit's loss, the unigram entropy and the fit steps."""
    lm = model.trunk.language_model
    if lm.args.tie_word_embeddings:
        raise ValueError("the bigram warm start needs an untied lm_head")
    V, H = lm.model.embed_tokens.weight.shape
    counts = bigram_counts(stream, V)
    E, W, loss = fit_bigram(counts, H, steps)
    lm.model.embed_tokens.weight = E
    lm.lm_head.weight = W
    # Head: fc([e; h]) starts as e (the normalised embedding of x_{t+1}).
    fc = model.head.fc.weight  # [H, 2H]
    model.head.fc.weight = mx.concatenate([mx.eye(H), fc[:, H:]], axis=1)
    p = counts.sum(axis=0) / counts.sum()
    unigram = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    return {"bigram_fit_loss": round(loss, 4), "unigram_entropy": round(unigram, 4), "fit_steps": steps}
