"""The measuring half of `make gpu-check` (scripts/gpu_check.sh installs first): the GPU tests, the built-in model
widened to real sizes in bfloat16, greedy output against mlx-lm's on the widened model, and `mtplx bench` at each
(shape, batch size) against mlx_lm.batch_generate in the same run. Every step runs in its own process with a
time limit cut from one deadline, most wanted first, so that what fits is measured and the rest is named as
skipped. Writes under OUT: tests.txt, greedy.json, bench.json (every record), bench.txt (the tables),
summary.json (steps and their seconds); prints a compact table last. docs/gpu.md says how it is run.

`python scripts/gpu_check.py OUT --seconds S [--dry-run]`; `--dry-run`: tiny shapes and short runs on this
machine's default device, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".gpu" / "run"  # widened models and per-cell records (ignored by git; never carried back)


@dataclass(frozen=True)
class Plan:
    shapes: Dict[str, dict]  # name -> widen() arguments
    bench_order: List[tuple]  # (shape name, batch size), most wanted first
    depths: str = "0,1,2,3,auto"
    temperatures: str = "0,1"
    max_tokens: int = 64
    repeats: int = 1
    max_prompt_tokens: int = 128
    greedy_shape: str = "qwen3.5-0.8b"
    greedy_prompts: int = 8
    greedy_tokens: int = 32
    greedy_depths: tuple = (0, 1, 2, 3)
    greedy_batches: tuple = (1, 8)
    tests_s: float = 150.0  # the GPU tests' own limit
    greedy_s: float = 120.0
    min_bench_s: float = 20.0  # a bench cell is not started with less left
    reserve_s: float = 10.0  # kept for writing the results


def real_plan() -> Plan:
    from mtplx.testing import SHAPES

    shapes = {name: SHAPES[name] for name in ("qwen3.5-0.8b", "qwen3.5-4b")}
    # The targets first: 4B at batch 1 and 32; then the other sizes, then 0.8B.
    order = [("qwen3.5-4b", b) for b in (1, 32, 8, 64)] + [("qwen3.5-0.8b", b) for b in (1, 32, 8, 64)]
    return Plan(shapes, order)


def dry_plan() -> Plan:
    tiny = dict(hidden=128, layers=20, intermediate=384, vocab_size=1024)
    return Plan(
        {"tiny-a": tiny, "tiny-b": dict(tiny, hidden=192)},
        [("tiny-b", 1), ("tiny-a", 2)],
        depths="0,1,auto",
        max_tokens=8,
        max_prompt_tokens=32,
        greedy_shape="tiny-a",
        greedy_prompts=3,
        greedy_tokens=8,
        greedy_depths=(0, 2),
        greedy_batches=(1, 2),
        tests_s=120.0,
        min_bench_s=5.0,
    )


@dataclass
class Step:
    name: str
    status: str = "skipped"  # ok, failed (exit code), timed out, skipped
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_step(step: Step, argv: Sequence[str], limit: float, log_to: Optional[Path] = None) -> Step:
    """argv in a child process for at most `limit` seconds; its output to our log (and to `log_to`)."""
    if limit <= 1:
        step.detail["why"] = "no time left"
        return step
    print(f"\n== {step.name} (limit {limit:.0f} s): {' '.join(map(str, argv))}", flush=True)
    start = time.monotonic()
    try:
        out = subprocess.run(
            [str(a) for a in argv], cwd=REPO, timeout=limit, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        text, step.status = out.stdout, "ok" if out.returncode == 0 else f"failed ({out.returncode})"
    except subprocess.TimeoutExpired as e:  # its output so far comes as bytes even in text mode
        text, step.status = _text(e.stdout), "timed out"
    step.seconds = round(time.monotonic() - start, 1)
    print(text, end="" if text.endswith("\n") or not text else "\n", flush=True)
    print(f"== {step.name}: {step.status} in {step.seconds} s", flush=True)
    if log_to is not None:
        with open(log_to, "a") as f:
            f.write(f"== {step.name}: {step.status} in {step.seconds} s\n{text}\n")
    return step


PYTEST_GPU = ["-m", "pytest", "-q", "-rs", "-m", "gpu", "--gpu", "-p", "no:cacheprovider"]


class Background:
    """A step's process started now and waited for later, its output in `log_to`."""

    def __init__(self, step: Step, argv: Sequence[str], log_to: Path):
        print(f"\n== {step.name} (in the background): {' '.join(map(str, argv))}", flush=True)
        self.step, self.log_to, self.start = step, log_to, time.monotonic()
        self.file = open(log_to, "w")
        self.proc = subprocess.Popen([str(a) for a in argv], cwd=REPO, stdout=self.file, stderr=subprocess.STDOUT)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def wait(self, limit: float) -> Step:
        try:
            rc = self.proc.wait(timeout=max(limit, 0.1))
            self.step.status = "ok" if rc == 0 else f"failed ({rc})"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.step.status = "timed out"
        self.file.close()
        self.step.seconds = round(self.elapsed(), 1)
        print(self.log_to.read_text(), flush=True)
        print(f"== {self.step.name}: {self.step.status} in {self.step.seconds} s", flush=True)
        return self.step


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def gpu_test_files() -> List[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--seconds", type=float, default=270.0, help="for everything this script runs")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plan = dry_plan() if args.dry_run else real_plan()
    deadline = Deadline(args.seconds)
    WORK.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    steps: List[Step] = []

    def left(cap: float = float("inf")) -> float:
        return min(cap, deadline.left() - plan.reserve_s)

    # The GPU tests and the greedy check run while the models are widened; nothing is timed until all have ended.
    tests = Background(Step("GPU tests"), [py, *PYTEST_GPU, *gpu_test_files()], out / "tests.txt")
    steps.append(tests.step)

    models = {}
    greedy, greedy_run = out / "greedy.json", None
    greedy.unlink(missing_ok=True)  # a rerun into the same OUT must not report an old check
    for name in sorted(plan.shapes, key=lambda n: n != plan.greedy_shape):  # the greedy check's shape first
        dst = WORK / name
        step = run_step(
            Step(f"widen {name}"), [py, __file__, "widen", name, dst, json.dumps(plan.shapes[name])], left()
        )
        steps.append(step)
        if step.status != "ok":
            continue
        models[name] = dst
        if name == plan.greedy_shape:  # beside the other widening: nothing is timed yet
            g = [py, __file__, "greedy", dst, greedy, json.dumps(_greedy_settings(plan))]
            greedy_run = Background(Step(f"greedy vs mlx-lm on {name}"), g, WORK / "greedy.log")
            steps.append(greedy_run.step)

    tests.wait(left(plan.tests_s - tests.elapsed()))
    if greedy_run is not None:
        greedy_run.wait(left(plan.greedy_s - greedy_run.elapsed()))

    cells = []
    for name, B in plan.bench_order:
        step = Step(f"bench {name} B={B}")
        steps.append(step)
        if name not in models:
            step.detail["why"] = "not widened"
            continue
        if left() < plan.min_bench_s:
            step.detail["why"] = f"under {plan.min_bench_s:.0f} s left"
            continue
        cell = WORK / f"bench-{name}-B{B}.json"
        cell.unlink(missing_ok=True)
        bench = [
            py, "-m", "mtplx.bench", "--model", models[name], "--output", cell, "--batch-sizes", B,
            "--depths", plan.depths, "--temperatures", plan.temperatures, "--max-tokens", plan.max_tokens,
            "--repeats", plan.repeats, "--max-prompt-tokens", plan.max_prompt_tokens,
        ]  # fmt: skip
        run_step(step, bench, left(), out / "bench.txt")
        if cell.exists():
            cells.append({"shape": name, "batch_size": B, "records": json.loads(cell.read_text())})

    (out / "bench.json").write_text(json.dumps({"shapes": plan.shapes, "cells": cells}, indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps([asdict(s) for s in steps], indent=1) + "\n")
    print("\n" + "\n".join(summary_lines(steps, cells, greedy)), flush=True)
    return 0 if all(s.status == "ok" for s in steps) else 1


def _greedy_settings(plan: Plan) -> dict:
    return dict(
        prompts=plan.greedy_prompts,
        tokens=plan.greedy_tokens,
        depths=list(plan.greedy_depths),
        batches=list(plan.greedy_batches),
        max_prompt_tokens=plan.max_prompt_tokens,
    )


def summary_lines(steps: Sequence[Step], cells: Sequence[dict], greedy: Path) -> List[str]:
    lines = ["steps:"]
    for s in steps:
        why = f" ({s.detail['why']})" if s.detail.get("why") else ""
        lines.append(f"  {s.name}: {s.status}{why}, {s.seconds} s")
    if greedy.exists():
        g = json.loads(greedy.read_text())
        lines.append(f"greedy vs mlx-lm ({g['shape']}): {g['verdict']}")
    lines.append("tokens/s (ratio vs mlx_lm.batch_generate, same run):")
    depths = ("0", "1", "2", "3", "auto")
    lines.append(
        "  "
        + "shape".ljust(13)
        + " B".rjust(3)
        + " T"
        + "mlx-lm".rjust(9)
        + "".join(f"depth {d}".rjust(14) for d in depths)
    )
    for c in cells:
        header = c["records"][0]
        device = header.get("device", {}).get("device_name", "?")
        for t in header["settings"]["temperatures"]:
            rows = [r for r in c["records"][1:] if r.get("temperature") == t]
            base = next((r for r in rows if r["engine"] != "mtplx"), None)
            by_depth = {str(r["depth"]): r for r in rows if r["engine"] == "mtplx"}
            cols = [(f"{base['tokens_per_s']:.1f}" if base else "-").rjust(9)]
            for d in depths:
                r = by_depth.get(d)
                ratio = r.get("ratio_vs_mlx_lm") if r else None
                cols.append((f"{r['tokens_per_s']:.1f} x{ratio:.2f}" if ratio is not None else "-").rjust(14))
            lines.append(f"  {c['shape']:13}{c['batch_size']:3} {t:g}" + "".join(cols) + f"  [{device}]")
    return lines


# -- the steps' own processes


def widen_step(name: str, dst: str, shape_json: str) -> int:
    import mlx.core as mx

    import mtplx
    from mtplx.testing import widen, widened_config

    shape = json.loads(shape_json)
    done = Path(dst) / "config.json"
    if done.exists() and json.loads(done.read_text()) == widened_config(mtplx.default_model_path(), **shape):
        print(f"{name}: already widened in {dst} (a rerun on the same machine)")
        return 0
    start = time.monotonic()
    widen(mtplx.default_model_path(), dst, **shape, dtype=mx.bfloat16)
    size = sum(f.stat().st_size for f in Path(dst).iterdir())
    print(f"{name}: widened in {time.monotonic() - start:.1f} s on {mx.default_device()}, {size / 1e9:.2f} GB")
    return 0


def greedy_step(model_dir: str, out: str, settings_json: str) -> int:
    """MTPLX's greedy tokens at each depth and batch size against mlx-lm's greedy decoding of the same weights
    (with the padded vocabulary cut, as `mtplx bench` cuts it); each divergence with its top-2 gap."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import mtplx
    from mtplx.bench.run import baseline_logits_processors, default_prompts, encode_prompts
    from mtplx.testing import near_tie, tie_rule

    s = json.loads(settings_json)
    gpu = mx.default_device().type == mx.gpu
    model, reference = mtplx.load(model_dir), mtplx.load(model_dir)
    texts, _ = default_prompts()
    prompts = encode_prompts(model.tokenizer, texts[: s["prompts"]], s["max_prompt_tokens"])
    cut = baseline_logits_processors(reference)

    def logits_at(tokens):
        logits = reference.trunk(mx.array([tokens]))[:, -1]
        for f in cut:
            logits = f(None, logits)
        return logits[0].astype(mx.float32)

    def mlx_lm_greedy(prompt):
        toks = []
        steps = generate_step(mx.array(prompt), reference.trunk, max_tokens=s["tokens"], logits_processors=cut)
        for tok, _ in steps:
            if int(tok) in reference.eos_token_ids:
                break
            toks.append(int(tok))
        return toks

    refs = [mlx_lm_greedy(p) for p in prompts]
    runs, divergences = [], []
    for depth in s["depths"]:
        for B in s["batches"]:
            rt = mtplx.MTPLXRuntime(model, mtplx.MTPContract(depth=depth), max_batch=B)
            got = [c.tokens for c in rt.generate(prompts, max_tokens=s["tokens"])]
            equal = 0
            for i, (g, r) in enumerate(zip(got, refs)):
                j = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), None)
                if j is None and len(g) == len(r):
                    equal += 1
                    continue
                j = min(len(g), len(r)) if j is None else j
                top = mx.sort(logits_at(prompts[i] + r[:j]))[-2:]
                gap, big = float(top[1] - top[0]), float(top[1])
                tie = near_tie(gap, big, gpu)
                divergences.append(dict(depth=depth, batch=B, prompt=i, position=j, gap=gap, top=big, near_tie=tie))
            runs.append(dict(depth=depth, batch=B, equal=equal, of=len(prompts)))
    bad = [d for d in divergences if not d["near_tie"]]
    verdict = (
        f"{sum(r['equal'] for r in runs)} of {sum(r['of'] for r in runs)} completions equal; "
        f"{len(divergences) - len(bad)} diverged at near-ties, {len(bad)} elsewhere (near-tie: {tie_rule(gpu)})"
    )
    record = dict(
        shape=Path(model_dir).name, device=str(mx.default_device()), settings=s, runs=runs,
        divergences=divergences, verdict=verdict,
    )  # fmt: skip
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    print(verdict)
    return 0 if not bad else 1


if __name__ == "__main__":
    commands = {"widen": widen_step, "greedy": greedy_step}
    if len(sys.argv) > 1 and sys.argv[1] in commands:
        sys.exit(commands[sys.argv[1]](*sys.argv[2:]))
    sys.exit(main())
