"""`mtplx.load`: an mlx-lm trunk plus the MTP head mlx-lm drops on load."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from mtplx import backends
from mtplx.assets import default_model_path
from mtplx.models.adapter import CheckpointError, FamilyAdapter
from mtplx.models.checkpoint import SIDECAR, load_tensors, read_config, shard_files, shard_shapes
from mtplx.models.families import family_for
from mtplx.models.fp8 import dequantize_fp8_weights, dequantizing_trunk_class, fp8_block_size


@dataclass
class MTPModel:
    trunk: nn.Module
    head: Optional[nn.Module]
    tokenizer: Any
    config: dict
    family: FamilyAdapter
    path: Path
    info: dict = field(default_factory=dict)
    # The ids the head's logits index, where it scores a reduced draft vocabulary (`models.draft_vocab`);
    # None: the tokenizer's whole vocabulary, as the trunk's logits.
    draft_ids: Optional[mx.array] = None

    @property
    def text_model(self):
        return self.family.text_model(self.trunk)

    @property
    def layer_kinds(self) -> List[str]:
        if self.family.layer_kinds is not None:
            return self.family.layer_kinds(self.trunk)
        return ["attn"] * len(self.text_model.layers)

    @property
    def num_head_layers(self) -> int:
        return 0 if self.head is None else len(self.head.layers)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary: the config's `tokenizer_vocab_size` where the output layer is padded
        past it (as releases pad it to a round size), else the embedding's rows."""
        cfg = self.config.get("text_config", self.config)
        return int(cfg.get("tokenizer_vocab_size") or self.text_model.embed_tokens.weight.shape[0])

    @property
    def eos_token_ids(self) -> set:
        ids = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def max_context(self) -> Optional[int]:
        cfg = self.config.get("text_config", self.config)
        return cfg.get("max_position_embeddings")

    def forward(self, tokens: mx.array, cache=None) -> Tuple[mx.array, mx.array]:
        """Trunk logits [B, T, V] and, per position, the hidden state [B, T, H] the family's head reads."""
        return self.logits_and_hidden(self.run_layers(self.embed(tokens), cache))

    # The forward in three parts, so a decode pass can run it as a chain of graphs (decode.passes.StagedPass).
    def embed(self, tokens: mx.array) -> mx.array:
        return self.text_model.embed_tokens(tokens)  # [B, T, H]

    def run_layers(self, x: mx.array, cache=None, start: int = 0, stop: Optional[int] = None) -> mx.array:
        """Trunk layers start..stop over x [B, T, H]; `cache` holds theirs (None: no caches)."""
        stop = len(self.text_model.layers) if stop is None else stop
        layers = self.text_model.layers[start:stop]
        kinds = self.layer_kinds[start:stop]
        cache = cache if cache is not None else [None] * len(layers)
        attn_mask = ssm_mask = None
        if "attn" in kinds:
            attn_mask = create_attention_mask(x, cache[kinds.index("attn")], return_array=True)
        if "linear" in kinds:
            ssm_mask = create_ssm_mask(x, cache[kinds.index("linear")])
        run = self.family.run_layer or (lambda layer, h, m, c: layer(h, m, c))
        for layer, kind, c in zip(layers, kinds, cache):
            x = run(layer, x, ssm_mask if kind == "linear" else attn_mask, c)
        return x

    def logits_and_hidden(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        normed = self.text_model.norm(x)
        logits = self.family.lm_head(self.trunk)(normed)  # [B, T, V_padded]
        return cut_to_vocab(logits, self.vocab_size), (normed if self.family.hidden_after_norm else x)

    def make_cache(self):
        """Plain mlx-lm caches (batch 1 prefill, reference decoding)."""
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.trunk)

    def make_head_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in range(self.num_head_layers)]


def open_checkpoint(path):
    """(path, config, family, shard files, {tensor: shape}) of a checkpoint directory, shards checked."""
    path = Path(path)
    config = read_config(path)
    family = family_for(config)
    files = shard_files(path)
    if not files:
        raise CheckpointError(f"no model*.safetensors shards in {path}")
    return path, config, family, files, shard_shapes(files)


def load(path=None, *, lazy: bool = False) -> MTPModel:
    """Load a checkpoint (HF layout or converted by `mtplx convert`) with its MTP head;
    no path, or "default", is the built-in model."""
    if path is None or path == "default":
        path = default_model_path()
    path, config, family, files, shapes = open_checkpoint(path)
    trunk = _load_trunk(path, family, config)
    tokenizer = _load_tokenizer(path, config)
    head, info = _load_head(path, config, family, trunk, files, shapes)
    model = MTPModel(trunk, head, tokenizer, config, family, path, info)
    if head is not None and hasattr(head, "lm_head"):  # the head scores the tokenizer's ids alone, as the trunk
        full, vocab = head.lm_head, model.vocab_size
        object.__setattr__(head, "lm_head", lambda x: cut_to_vocab(full(x), vocab))
    backends.prepare_loaded(model)  # else a half-precision MoE cannot run a forward on the CPU at all
    if not lazy:
        mx.eval(trunk.parameters())
        if head is not None:
            mx.eval(head.parameters())
    return model


def trunk_classes(family: FamilyAdapter, config: dict) -> Callable:
    """`get_model_classes` for mlx-lm's load_model: the family's, dequantising block fp8 first if present."""
    from mlx_lm.utils import _get_classes

    classes = family.model_classes or _get_classes
    block = fp8_block_size(config)
    if block is None:
        return classes

    def dequantizing(config):  # mlx-lm passes it by this name
        model_cls, args_cls = classes(config)
        return dequantizing_trunk_class(model_cls, block), args_cls

    return dequantizing


def _load_trunk(path: Path, family: FamilyAdapter, config: dict) -> nn.Module:
    from mlx_lm.utils import load_model

    classes = trunk_classes(family, config)
    try:
        trunk, _ = load_model(path, lazy=True, strict=True, get_model_classes=classes)
    except CheckpointError:
        raise
    except KeyError as e:  # a family's sanitize looking up a tensor the checkpoint lacks
        raise CheckpointError(f"cannot load the trunk from {path}: missing tensor {e.args[0]!r}") from None
    except Exception as e:  # mlx-lm's messages run over lines ("Missing 1 parameters: \n name.")
        raise CheckpointError(f"cannot load the trunk from {path}: {' '.join(str(e).split())}") from None
    return trunk


def _load_tokenizer(path: Path, config: dict):
    try:
        return load_tokenizer(path, config)
    except Exception as e:
        raise CheckpointError(f"cannot load the tokenizer from {path}: {e}") from None


# A tokenizer's vocabulary lives in one of these (fast, SentencePiece, BPE, WordPiece, tiktoken).
VOCABULARY_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
    "qwen.tiktoken",
)


def load_tokenizer(path: Path, config: dict):
    """The checkpoint's tokenizer as mlx-lm loads it, never running code shipped with it (an `auto_map`
    release would make transformers ask on a terminal and wait), with `eos_token_ids(path, config)`."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    if not any((Path(path) / name).is_file() for name in VOCABULARY_FILES):
        # transformers would build a tokenizer of its special tokens alone, encoding every text as [].
        raise CheckpointError(f"no vocabulary file (one of {', '.join(VOCABULARY_FILES)})")
    return mlx_load_tokenizer(path, {"trust_remote_code": False}, eos_token_ids=eos_token_ids(path, config))


def cut_to_vocab(logits: mx.array, vocab: int) -> mx.array:
    """Logits [..., V_padded] of ids the tokenizer has: the padded rows are computed (their cost is the
    output layer's) and never sampled, as vLLM trims logits to the tokenizer's vocabulary."""
    return logits if logits.shape[-1] == vocab else logits[..., :vocab]


def encode_text(tokenizer, text: str) -> List[int]:
    """A str prompt as token ids, as mlx-lm's `generate` encodes it: BOS added unless the text starts with it."""
    bos = getattr(tokenizer, "bos_token", None)
    add = not (isinstance(bos, str) and bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add))


def eos_token_ids(path: Path, config: dict):
    """generation_config.json's eos_token_id where it has one, else config.json's."""
    try:
        generation = json.loads((Path(path) / "generation_config.json").read_text())
    except (OSError, ValueError):
        generation = {}
    found = generation.get("eos_token_id") if isinstance(generation, dict) else None
    return found if found not in (None, False, []) else config.get("eos_token_id")


def _load_head(path, config, family, trunk, files, shapes):
    sidecar = path / SIDECAR
    # Only a head `mtplx convert` marked in config.json is MLX layout: a release's mtp.safetensors is HF's.
    converted = (config.get("mtplx") or {}).get("mtp_format") == "mlx"
    if sidecar.exists() and converted:
        from mtplx.models.checkpoint import read_header

        read_header(sidecar)
        tensors = dict(mx.load(str(sidecar)))
        quant = config.get("mtplx", {}).get("head_quantization")
        head = family.build_head(trunk, config, tensors, shapes, quantization=quant, mlx_layout=True)
        return head, {"source": SIDECAR, "quantization": quant}
    if sidecar.exists() and sidecar not in files:  # an HF-layout head shard no index names
        files = files + [sidecar]
    tensors = load_tensors(files, lambda k: family.is_mtp_key(k, config))
    block = fp8_block_size(config)
    if block is not None:  # the trunk's sanitize dequantises its own (trunk_classes)
        tensors = dequantize_fp8_weights(tensors, block)
    if not tensors:
        if family.num_mtp_layers(config) > 0:
            warnings.warn(
                f"{path}: config declares {family.num_mtp_layers(config)} MTP layer(s) "
                "but the checkpoint holds no MTP tensors (dropped by a conversion?); "
                "loading the trunk alone, speculation is unavailable"
            )
        return None, {"source": None}
    head = family.build_head(trunk, config, tensors, shapes)
    return head, {"source": "shards", "tensors": len(tensors)}
