"""`mtplx train-tiny`: train the built-in default model from the stdlib's source.

The exported checkpoint is re-opened through `mtplx.load` and `mlx_lm.load`, checked against the in-memory
model and measured on the held-out modules; everything is recorded in training.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

from mtplx.training.corpus import HELD_OUT_MODULES, held_out_examples, split_corpus, stdlib_root, stdlib_sources
from mtplx.training.evaluate import held_out_loss, runtime_acceptance, step_costs, teacher_forced_acceptance
from mtplx.training.export import export_checkpoint
from mtplx.training.model import ModelShape, TinyMTP, count_parameters, initialize, release_config
from mtplx.training.tokenizer import check_round_trip, encode_documents, save_tokenizer, train_bpe
from mtplx.training.train import TrainSettings, train
from mtplx.training.warm_start import warm_start

DEFAULT_SHAPE = ModelShape()
DEFAULT_STEPS = 800
METADATA = "training.json"


def train_tiny(
    out_dir,
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    shape: ModelShape = DEFAULT_SHAPE,
    settings: Optional[TrainSettings] = None,
    corpus_files: Optional[int] = None,
    eval_prompts: int = 128,
    eval_new_tokens: int = 64,
    measure_costs: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Train, export to `out_dir`, verify and measure; returns the metadata also written to training.json.
    corpus_files: only the first N training files (quick tests); eval_prompts / eval_new_tokens: size of
    the held-out acceptance measurement; measure_costs: time the trunk, verify and head passes."""
    started = time.perf_counter()
    load_before = os.getloadavg()
    out = Path(out_dir)
    settings = replace(settings or TrainSettings(), steps=steps, seed=seed)
    mx.random.seed(seed)

    data = _prepare_data(out, shape.vocab_size, corpus_files, log)
    model, meta = _train_model(shape, settings, data, log)
    config = release_config(shape)
    meta["artifact"] = export_checkpoint(model, config, out)
    meta["load_checks"] = _check_loaded(out, model, data)
    meta.update(_measure(_load(out), data, settings, eval_prompts, eval_new_tokens, measure_costs, log))
    meta["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "mlx": mx.__version__,
    }
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    (out / METADATA).write_text(json.dumps(meta, indent=2))
    log(f"done in {meta['wall_s']} s: {out}")
    return meta


def _train_model(shape: ModelShape, settings: TrainSettings, data: dict, log):
    """Initialise, warm-start and train; -> (model, metadata so far)."""
    model = TinyMTP(release_config(shape))
    initialize(model)
    warm = warm_start(model, data["train_stream"])
    mx.eval(model.parameters())
    log(f"bigram warm start: {warm}")
    log(f"model: trunk {count_parameters(model.trunk):,} params, head {count_parameters(model.head):,}")
    t0 = time.perf_counter()
    curve = train(model, data["train_stream"], settings, log=lambda e: log(json.dumps(e)))
    return model, {
        "seed": settings.seed,
        "steps": settings.steps,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
        "settings": settings.to_dict(),
        "shape": shape.to_dict(),
        "config": release_config(shape),
        "parameters": {"trunk": count_parameters(model.trunk), "head": count_parameters(model.head)},
        "corpus": data["corpus"],
        "tokenizer": data["tokenizer"],
        "warm_start": warm,
        "loss_curve": curve,
        "train_wall_s": round(time.perf_counter() - t0, 1),
    }


def _measure(loaded, data, settings, eval_prompts, eval_new_tokens, measure_costs, log) -> dict:
    """Held-out loss, acceptance, samples and step costs of the checkpoint as `mtplx.load` reads it."""
    found = {"held_out": held_out_loss(loaded, data["held_stream"], seq_len=settings.seq_len)}
    prompts = [data["tokenize"](e.prompt) for e in data["examples"]][:eval_prompts]
    found["acceptance_teacher_forced"] = teacher_forced_acceptance(loaded, prompts, new_tokens=eval_new_tokens)
    found["acceptance_runtime"] = {
        name: runtime_acceptance(loaded, prompts, temperature=t, max_tokens=eval_new_tokens)
        for name, t in (("greedy", 0.0), ("temperature_1", 1.0))
    }
    log(
        f"held-out: {found['held_out']}; acceptance: {found['acceptance_teacher_forced']}, "
        f"runtime {found['acceptance_runtime']}"
    )
    found["samples"] = _samples(loaded, data["examples"][:2])
    if measure_costs:
        found["step_costs_ms"] = step_costs(loaded)
    return found


def _prepare_data(out: Path, vocab_size: int, corpus_files: Optional[int], log) -> dict:
    train_files, held_files = split_corpus(stdlib_sources())
    train_files = train_files[:corpus_files] if corpus_files else train_files
    texts = [f.text for f in train_files]
    tok = train_bpe(texts, vocab_size)
    save_tokenizer(tok, out)
    stream = encode_documents(tok, texts)
    held_stream = encode_documents(tok, [f.text for f in held_files])
    examples = held_out_examples(held_files)
    chars = sum(len(t) for t in texts)
    log(f"corpus: {len(train_files)} train files, {len(stream):,} tokens; {len(held_files)} held-out files")
    return {
        "train_stream": stream,
        "held_stream": held_stream,
        "examples": examples,
        "held_texts": [f.text for f in held_files],
        "tokenize": lambda text: tok.encode(text).ids,
        "corpus": {
            "source": "python stdlib",
            "stdlib_root": str(stdlib_root()),
            "python": platform.python_version(),
            "train_files": len(train_files),
            "train_chars": chars,
            "train_tokens": int(len(stream)),
            "held_out_modules": list(HELD_OUT_MODULES),
            "held_out_files": [f.module for f in held_files],
            "held_out_tokens": int(len(held_stream)),
            "held_out_prompts": len(examples),
        },
        "tokenizer": {
            "kind": "byte-level BPE, Qwen3.5 pipeline",
            "vocab_size": tok.get_vocab_size(),
            "chars_per_token": round(chars / max(1, len(stream)), 3),
        },
    }


def _load(out: Path):
    from mtplx.models.loader import load

    return load(out)


def _check_loaded(out: Path, model: TinyMTP, data: dict) -> dict:
    """The checkpoint, read back by mtplx.load and mlx_lm.load, must compute what the trained model does."""
    import mlx_lm

    loaded = _load(out)
    if loaded.head is None:
        raise RuntimeError(f"{out}: the exported checkpoint has no MTP head")
    tokens = mx.array(data["held_stream"][None, :128])  # [1, 128]
    want_hidden = model.hidden(tokens)
    want = {"trunk": model.lm_head(want_hidden)}
    want["head_d1"], out1 = model.head(want_hidden[:, :-1], tokens[:, 1:])
    want["head_d2"], _ = model.head(out1[:, :-1], tokens[:, 2:], depth=2)
    got = {}
    got["trunk"], hidden = loaded.forward(tokens)
    got["head_d1"], lout1 = loaded.head(hidden[:, :-1], tokens[:, 1:])
    got["head_d2"], _ = loaded.head(lout1[:, :-1], tokens[:, 2:], depth=2)
    got["mlx_lm_trunk"] = mlx_lm.load(str(out))[0](tokens)
    want["mlx_lm_trunk"] = want["trunk"]
    want["chunked_trunk"] = want["trunk"]
    got["chunked_trunk"] = model.lm_head(model.hidden_chunked(tokens))
    diffs = {k: float(mx.abs(got[k] - want[k]).max().item()) for k in want}
    bad = {k: v for k, v in diffs.items() if not v < 1e-3}
    if bad:
        raise RuntimeError(f"{out}: the loaded checkpoint does not match the trained model: {bad}")
    samples = [t[:2000] for t in data["held_texts"][:8]]
    return {"max_abs_logit_diff": diffs, "tokenizer_round_trip": check_round_trip(out, samples)}


def _samples(model, examples, new_tokens: int = 96) -> list:
    """Greedy trunk continuations of a few held-out prompts (stop at EOS)."""
    out = []
    for ex in examples:
        ids = list(model.tokenizer.encode(ex.prompt))
        cache = model.make_cache()
        logits, _ = model.forward(mx.array([ids]), cache)
        gen = []
        for _ in range(new_tokens):
            nxt = int(mx.argmax(logits[0, -1]).item())
            if nxt in model.eos_token_ids:
                break
            gen.append(nxt)
            logits, _ = model.forward(mx.array([[nxt]]), cache)
        out.append({"id": ex.id, "prompt": ex.prompt, "completion": model.tokenizer.decode(gen)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtplx.training.tiny", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-costs", action="store_true", help="skip the step-cost timing")
    args = p.parse_args(argv)
    meta = train_tiny(args.out, steps=args.steps, seed=args.seed, measure_costs=not args.no_costs)
    print(json.dumps({k: meta[k] for k in ("held_out", "acceptance_teacher_forced", "wall_s")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
