"""Shared fixtures: a tiny qwen3_5 checkpoint, Parquet writers, CLI runners,
and a fake engine for pipeline tests that do not need a real model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.preload import with_preloads

REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption(
        "--gpu",
        action="store_true",
        help="run on MLX's GPU device (`make test-gpu -m gpu`); every test skips where MLX has none. "
        "Without it the suite runs on the CPU device, whichever backend is installed.",
    )


def pytest_configure(config):
    import mlx.core as mx

    gpu = config.getoption("--gpu") and mx.is_available(mx.gpu)
    mx.set_default_device(mx.gpu if gpu else mx.cpu)


def pytest_collection_modifyitems(config, items):
    import mlx.core as mx

    if not config.getoption("--gpu") or mx.is_available(mx.gpu):
        return
    from mtplx.install_check import installed_backends

    backends = ", ".join(installed_backends()) or "none installed"
    skip = pytest.mark.skip(reason=f"--gpu: MLX has no GPU device here (backend: {backends})")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random tiny qwen3_5 checkpoint (with MTP head) in the HF layout."""
    from mtplx.testing import tiny_checkpoint

    return tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("tiny_qwen3_5"), vocab_size=64)


def write_parquet(path: Path, **columns) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def cli_env() -> dict:
    env = with_preloads(dict(os.environ))  # as `mtplx` would re-execute itself
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cli(*args, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    """`mtplx ARGS` in a fresh process (`python -m pipeline.cli`)."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=cwd or REPO,
    )


def invoke(*args):
    """`mtplx ARGS` in this process (fast); result has exit_code, stdout, stderr."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def write_job(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------ fake engine


class FakeTokenizer:
    """Characters -> ids 1..50; no BOS; a plain chat template."""

    bos_token = None
    has_chat_template = True

    def encode(self, text, add_special_tokens=True):
        return [b % 50 + 1 for b in text.encode()]

    def decode(self, tokens):
        return "".join(chr(ord("a") + t % 26) for t in tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class FakeRuntime:
    """Completions that depend only on (seed, row id, sample, prompt), returned
    in a scrambled order, with requests pulled lazily like the real runtime."""

    def __init__(self, max_batch=4, max_context=None, depth=2):
        self.max_batch = max_batch
        self.max_context = max_context
        self.depth = depth
        self.stats = {
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "prefill_seconds": 0.0,
            "decode_seconds": 0.0,
            "depth_used": depth,
        }

    def stream(self, requests, seed=0):
        import heapq

        from mtplx.decode.requests import error_completion

        live = []  # heap of (order hash, request index, sample, request): any order, deterministic
        it = iter(requests)
        exhausted = False
        while live or not exhausted:
            while not exhausted and len(live) < self.max_batch:
                req = next(it, None)
                if req is None:
                    exhausted = True
                    break
                for s in range(req.n):
                    heapq.heappush(live, (_h(req.row_id, s, seed), req.index, s, req))
            if not live:
                break
            _, _, s, req = heapq.heappop(live)
            if not req.prompt:
                yield error_completion(req, s, "empty prompt")
            elif self.max_context and len(req.prompt) + req.max_tokens > self.max_context:
                yield error_completion(req, s, "prompt over the context")
            else:
                yield self._complete(req, s, seed)

    def _complete(self, req, s, seed):
        from mtplx.decode.requests import Completion

        base = _h(req.row_id, s, seed, tuple(req.prompt))
        n = 1 + base % req.max_tokens
        tokens = [(base >> (5 * i)) % 26 for i in range(n)]
        steps = max(1, n - 1)
        self.stats["prefill_tokens"] += len(req.prompt)
        self.stats["decode_tokens"] += n
        return Completion(
            index=req.index,
            sample_index=s,
            row_id=req.row_id,
            tokens=tokens,
            text=FakeTokenizer().decode(tokens),
            finish_reason="length" if n == req.max_tokens else "stop",
            drafted_by_depth=[steps] * self.depth,
            accepted_by_depth=[steps // 2, steps // 4][: self.depth],
            steps=steps,
            prompt_tokens=len(req.prompt),
            logprobs=[-0.5] * n if req.logprobs else None,
        )


def _h(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def fake_engine_factory(max_context=None):
    """An engine_factory for pipeline.runner.run_job that loads no model."""
    from mtplx.decode.requests import Request
    from pipeline.engine import Engine

    def open_fake(ref, spec, max_memory, sampled_depth=None):
        rt = FakeRuntime(
            max_batch=spec.batch.max_batch,
            max_context=max_context,
            depth=spec.model.depth if isinstance(spec.model.depth, int) else 2,
        )
        return Engine(FakeTokenizer(), max_context, Request, rt, {"depth": rt.depth, "max_batch": rt.max_batch})

    return open_fake
