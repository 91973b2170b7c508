"""A reduced draft vocabulary: the MTP head scores only a chosen set of ids.

With a real vocabulary the output layer dominates a head pass (at width 1024
and 248k ids it is about 250M parameters, read by every draft). Scoring N
frequent ids instead (FR-Spec; EAGLE-3's draft vocabulary) cuts that read by
V / N. Speculation stays exact under every acceptance rule, because any
proposal q is allowed: q is zero outside the set, and acceptance falls only by
the target's mass outside it.

The set is kept sorted, so that the ids the tokenizer has (below
`model.vocab_size`) come first and the padded rows of a padded output layer
(never sampled) last: the head's logits are cut after the tokenizer's ids, as
the full layer's are.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mtplx.models.adapter import CheckpointError


def output_rows(model) -> int:
    """Rows of the trunk's output layer (a padded layer has more than the tokenizer's ids)."""
    return int(_output_layer(model).weight.shape[0])


def merge_order_ids(model, size: int) -> np.ndarray:
    """The first `size` rows of the output layer, plus the end-of-sequence ids: a BPE tokenizer numbers its
    tokens in merge order, so low ids are the frequent ones (bytes, then the earliest merges)."""
    ids = set(range(min(size, output_rows(model))))
    ids |= {i for i in model.eos_token_ids if i < model.vocab_size}
    return np.array(sorted(ids), dtype=np.int32)


def ids_from_counts(prompts: Iterable[Sequence[int]], size: int, model) -> np.ndarray:
    """The `size` ids seen most often in `prompts` (token lists), plus the end-of-sequence ids; ties go to
    the lower id, and too few distinct ids are filled in merge order."""
    counts = Counter(t for p in prompts for t in p if 0 <= t < model.vocab_size)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    chosen = set(ranked) | {i for i in model.eos_token_ids if i < model.vocab_size}
    for t in range(model.vocab_size):
        if len(chosen) >= size:
            break
        chosen.add(t)
    return np.array(sorted(chosen), dtype=np.int32)


def with_draft_vocab(model, ids: Optional[np.ndarray]):
    """A view of `model` whose head scores only `ids` (sorted): its head logits index `draft_ids`, the ids below
    the tokenizer's vocabulary. The trunk, the head's layers and every weight are shared. None: `model`."""
    if ids is None or model.head is None:
        return model
    ids = np.asarray(ids, dtype=np.int32)
    if ids.ndim != 1 or len(ids) == 0 or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= output_rows(model):
        raise ValueError("draft vocabulary ids must be sorted, distinct, and rows of the output layer")
    n_real = int(np.sum(ids < model.vocab_size))
    if n_real == 0:
        raise ValueError("the draft vocabulary holds none of the tokenizer's ids")
    head = _scoring_head(model, mx.array(ids), n_real)
    return dataclasses.replace(model, head=head, draft_ids=mx.array(ids[:n_real]))


def _scoring_head(model, ids: mx.array, n_real: int):
    """A shallow copy of the head whose output layer is the rows `ids` of its own, cut to `n_real` columns."""
    head = copy.copy(model.head)
    if hasattr(head, "lm_head"):  # the head scores with the trunk's output layer (Qwen, MiMo)
        rows = _rows_of(_output_layer(model), ids)
        object.__setattr__(head, "lm_head", lambda x: rows(x)[..., :n_real])
        return head
    if all(hasattr(layer, "shared_head") for layer in head.layers):  # DeepSeek: an output layer per head layer
        layers = []
        for layer in head.layers:
            shared = copy.copy(layer.shared_head)
            shared.head = _CutLinear(_rows_of(layer.shared_head.head, ids), n_real)
            layer = copy.copy(layer)
            layer.shared_head = shared
            layers.append(layer)
        head.layers = layers
        return head
    raise CheckpointError(f"{model.path}: no known output layer in this MTP head; draft_vocab cannot apply")


class _CutLinear(nn.Module):
    def __init__(self, rows, n_real: int):
        super().__init__()
        self.rows, self.n_real = rows, n_real

    def __call__(self, x):
        return self.rows(x)[..., : self.n_real]


def _output_layer(model) -> nn.Module:
    """The trunk's output layer: its `lm_head`, or with tied embeddings the embedding read as a linear map."""
    lm = model.trunk.language_model if hasattr(model.trunk, "language_model") else model.trunk
    layer = getattr(lm, "lm_head", None)
    return layer if isinstance(layer, nn.Module) else model.text_model.embed_tokens


def _rows_of(layer: nn.Module, ids: mx.array):
    """x -> logits [..., N] over the output rows `ids` of a linear or embedding layer, plain or quantised."""
    if "scales" in layer:  # quantised: groups run along the input dimension, so rows gather whole
        rows = copy.copy(layer)
        for name in ("weight", "scales", "biases", "bias"):
            if name in layer:
                rows[name] = mx.take(layer[name], ids, axis=0)  # [N, ...]
        mx.eval(rows.parameters())
        return rows.as_linear if hasattr(rows, "as_linear") else rows
    # A new matrix, stored [in, N] so that a draft is a plain GEMM on every backend.
    w = mx.contiguous(mx.take(layer.weight, ids, axis=0).T)  # [H, N]
    bias = mx.take(layer.bias, ids) if "bias" in layer else None  # [N]
    mx.eval(w, bias) if bias is not None else mx.eval(w)
    return (lambda x: x @ w) if bias is None else (lambda x: mx.addmm(bias, x, w))
