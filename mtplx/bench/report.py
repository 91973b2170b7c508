"""The bench's records as a text table and as a plot of tokens/s against batch size."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

from mtplx.bench.requirements import decode_over_predicted, requirement_lines

COLUMNS = (
    # (title, width, how to show a record)
    ("B", 4, lambda r: str(r["batch_size"])),
    ("temp", 5, lambda r: f"{r['temperature']:g}"),
    ("engine", 7, lambda r: r["engine"]),
    ("depth", 7, lambda r: _depth(r)),
    ("tok/s", 8, lambda r: _num(r["tokens_per_s"], ".1f")),
    ("vs mlx-lm [min, max]", 22, lambda r: _num(r["ratio_vs_mlx_lm"], ".3f") + _spread(r)),
    ("decode vs", 9, lambda r: _num(r.get("decode_ratio_vs_mlx_lm"), ".3f")),
    ("prefill", 7, lambda r: _num(r.get("prefill_fraction"), ".0%")),
    ("accept by depth", 17, lambda r: _rates(r["acceptance_by_depth"])),
    ("mean len", 8, lambda r: _num(r["mean_accepted_length"], ".2f")),
    ("ideal", 6, lambda r: _num(r["ideal_tokens_per_cycle"], ".2f")),
    ("pred", 6, lambda r: _num(r["predicted_speedup"], ".2f")),
    ("meas", 6, lambda r: _num(r["measured_speedup"], ".2f")),
    ("meas dec", 8, lambda r: _num(r.get("measured_decode_speedup"), ".2f")),
    ("dec/pred", 8, lambda r: _num(_efficiency(r), ".2f")),
    ("rows/cyc", 8, lambda r: _num(r.get("rows_per_cycle"), ".2f")),
    ("auto/best", 9, lambda r: _auto_vs_best(r)),
)


def format_table(records: Sequence[dict]) -> str:
    """A header paragraph, one line per measured record, then the bare costs."""
    header = next((r for r in records if r["engine"] == "header"), None)
    rows = [r for r in records if r["engine"] != "header"]
    lines = _describe(header) if header else []
    lines.append("  ".join(title.rjust(w) for title, w, _ in COLUMNS))
    for r in rows:
        lines.append("  ".join(show(r).rjust(w) for _, w, show in COLUMNS))
    lines += [""] + _cost_lines(rows)
    cycles = _cycle_lines(rows)
    lines += [""] + cycles if cycles else []
    checks = requirement_lines(rows)
    lines += [""] + checks if checks else []
    lines += [
        "",
        "tok/s: generated tokens / wall seconds of the generate call, prefill included (median of runs).",
        "vs mlx-lm: median of paired ratios (engine tok/s / the mlx-lm run of its round) [min, max of them]; "
        "decode vs: the same outside prompt processing; prefill: its share of the wall time.",
        "ideal: 1 + accepted drafts per cycle; pred: ideal x step / (verify + k head), from the bare costs; "
        "meas / meas dec: tok/s over MTPLX depth 0, wall / decode only; "
        "dec/pred: a round's meas dec over its own pred (from its own acceptance), median over rounds; "
        "rows/cyc: rows decoded per cycle (B while the batch is full); auto=k: the depth most of auto's cycles ran at; "
        "auto/best: auto's run over the run of its round at the fixed depth best on the other rounds "
        "(named: the best on all rounds), median.",
    ]
    return "\n".join(lines)


def write_plot(records: Sequence[dict], path) -> None:
    """Tokens/s against batch size, a line per depth and mlx-lm, a panel per temperature (needs matplotlib)."""
    plt = require_matplotlib()
    rows = [r for r in records if r["engine"] != "header"]
    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, max(len(temps), 1), figsize=(5 * max(len(temps), 1), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for label, series in _series(rows, t):
            xs, ys = zip(*series)
            style = dict(color="black", linestyle="--") if label == "mlx-lm" else {}
            ax.plot(xs, ys, marker="o", label=label, **style)
        ax.set_xscale("log", base=2)
        sizes = sorted({r["batch_size"] for r in rows})
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"temperature {t:g}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_writable(path, what: str) -> None:
    """Fail before a run of minutes: a ValueError unless this process can create or replace `path`."""
    p = Path(path)
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise ValueError(f"cannot write {what} {p}: {e.strerror or e}") from None
    if not existed:
        p.unlink()


def check_output_paths(output, plot=None) -> None:
    """Before the run: `output` writable; `plot` a writable path in a format the installed matplotlib writes."""
    check_writable(output, "--output")
    if plot:
        require_matplotlib()
        check_plot_format(plot)
        check_writable(plot, "--plot")


def check_plot_format(path) -> None:
    """A --plot file matplotlib can write, judged by its extension."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix and suffix not in formats:  # none: matplotlib's default format
        raise ValueError(f"cannot draw --plot {path}: its extension must be one of {', '.join(sorted(formats))}")


def require_matplotlib():
    """matplotlib.pyplot on a file-only backend, or a clear error naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "plotting needs matplotlib, which is not installed: pip install 'mtplx[plot]' (or matplotlib)"
        ) from None
    return plt


def _series(rows: Sequence[dict], temperature: float):
    """(label, [(batch size, tokens/s), ...]) per engine/depth at one temperature."""
    groups = {}
    for r in rows:
        if r["temperature"] != temperature:
            continue
        label = "mlx-lm" if r["engine"] == "mlx_lm" else f"depth {r['depth']}"
        groups.setdefault(label, []).append((r["batch_size"], r["tokens_per_s"]))
    order = sorted(groups, key=lambda s: (s != "mlx-lm", s))
    return [(label, sorted(groups[label])) for label in order]


def _per_run(per_run) -> str:
    """'16 at B=4, ...' from the header's prompts per run by batch size."""
    if not isinstance(per_run, dict):  # older records: one count, or "batch size"
        return str(per_run)
    return ", ".join(f"{n} at B={B}" for B, n in per_run.items())


def _describe(h: dict) -> List[str]:
    m, v, p = h["machine"], h["versions"], h["prompts"]
    s = h["settings"]
    return [
        f"model: {h['model']}",
        f"prompts: {p['count']} from {p['source']}, {_per_run(p['per_run'])} per run, "
        f"clipped to {p.get('max_prompt_tokens') or 'no'} tokens; max_tokens {h['max_tokens']}; "
        f"repeats {s['repeats']}{_rounds(s)}; seed {s['seed']}",
        f"machine: {m['processor']}, {m['cpu_count']} CPUs, {m['platform']}",
        f"device: {_device(h.get('device'))}",
        "versions: "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f"; BLAS: {h['blas']['name']}{_thread_timeout(h['blas'])}; malloc: {h.get('allocator', '-')}",
        *_memory(h.get("memory")),
        "",
    ]


def _memory(m: Optional[dict]) -> List[str]:
    if not m:
        return []  # older records
    c = m["cache_bytes_per_row"]
    rss = m.get("peak_rss_bytes")
    return [
        f"memory: peak RSS {_mib(rss)} (both engines); caches per row at context {c['context']}: "
        f"{_mib(c['total'])} (trunk KV {_mib(c['trunk_kv'])}, "
        f"gated-delta state {_mib(c['gated_delta_state'])}, head KV {_mib(c['head_kv'])})"
    ]


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def _device(d: Optional[dict]) -> str:
    if not d:
        return "-"  # older records
    return f"{d.get('device_name', '?')} (MLX {d.get('mlx_device', '?')})"


def _cost_lines(rows: Sequence[dict]) -> List[str]:
    seen = {}
    for r in rows:
        if r.get("bare_costs") and r["batch_size"] not in seen:
            seen[r["batch_size"]] = r["bare_costs"]
    if not seen:
        return []
    ks = sorted({int(k) for c in seen.values() for k in c["verify_s"]})
    lines = ["bare costs (ms): one-token step, verify over k+1 tokens, one head pass"]
    lines.append(
        "  ".join(
            ["B".rjust(4), "context".rjust(7), "step".rjust(7)]
            + [f"verify{k}".rjust(8) for k in ks]
            + ["head".rjust(7)]
        )
    )
    for B, c in sorted(seen.items()):
        verify = [_num(_ms(c["verify_s"].get(str(k))), ".2f").rjust(8) for k in ks]
        lines.append(
            "  ".join(
                [str(B).rjust(4), str(c["context"]).rjust(7), _num(_ms(c["step_s"]), ".2f").rjust(7)]
                + verify
                + [_num(_ms(c["head_s"]), ".2f").rjust(7)]
            )
        )
    return lines


def _cycle_lines(rows: Sequence[dict]) -> List[str]:
    """Where a cycle's time goes, per fixed-depth record (`run.cycle_time`)."""
    timed = [r for r in rows if r.get("cycle_time")]
    if not timed:
        return []
    lines = ["one cycle (ms, share): bare verify (the step at depth 0), k head passes, the rest (accept, commit, host)"]
    lines.append("  ".join(t.rjust(w) for t, w in (("B", 4), ("temp", 5), ("depth", 5), ("cycle", 8))) + "   parts")
    for r in timed:
        t = r["cycle_time"]
        parts = ", ".join(
            f"{name} {_ms(t[key]):.1f} ({t[key] / t['cycle_s']:.0%})"
            for name, key in (("verify", "verify_s"), ("heads", "heads_s"), ("rest", "rest_s"))
        )
        head = [str(r["batch_size"]).rjust(4), f"{r['temperature']:g}".rjust(5), str(r["depth"]).rjust(5)]
        lines.append("  ".join(head + [f"{_ms(t['cycle_s']):.1f}".rjust(8)]) + "   " + parts)
    return lines


def _depth(r: dict) -> str:
    if r["engine"] == "mlx_lm":
        return "-"
    if r["depth"] == "auto":
        return f"auto={_depth_run_most(r)}"
    return str(r["depth"])


def _depth_run_most(r: dict) -> int:
    """The depth most of an "auto" record's timed cycles ran at (its depth_used, the job depth, is what
    sampled rows run at; greedy rows follow the running controller)."""
    cycles = {int(k): n for k, n in (r.get("cycles_by_depth") or {}).items() if n}
    return max(cycles, key=lambda k: (cycles[k], -k)) if cycles else r["depth_used"]


def _auto_vs_best(r: dict) -> str:
    if r.get("auto_vs_best") is None:
        return "-"
    return f"{r['auto_vs_best']:.2f} d{r['best_fixed_depth']}"


def _spread(r: dict) -> str:
    s = r.get("ratio_spread")
    if not s or not r.get("paired_ratios"):
        return ""
    return f" [{s[0]:.2f}, {s[1]:.2f}]"


def _rates(rates: Optional[Sequence[Optional[float]]]) -> str:
    if not rates:
        return "-"
    return " ".join("-" if x is None else f"{x:.2f}" for x in rates)


def _efficiency(r: dict) -> Optional[float]:
    """Measured decode speed-up over the predicted one: the share of the possible gain delivered."""
    share = decode_over_predicted(r)
    return None if share is None else share[0]


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1000.0


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _thread_timeout(blas: dict) -> str:
    if blas.get("name") != "OpenBLAS":
        return ""
    t, core = blas.get("openblas_thread_timeout"), blas.get("openblas_core")
    parts = ([f"{core} kernels"] if core else []) + ([f"thread timeout 2^{t} cycles"] if t else [])
    return f" ({', '.join(parts)})" if parts else ""


def _rounds(settings: dict) -> str:
    """The rounds where short runs got more of them (mtplx.bench.run.BenchPlan.rounds)."""
    by_b = settings.get("rounds_by_batch_size") or {}
    more = {b: n for b, n in by_b.items() if n != settings["repeats"]}
    return " (" + ", ".join(f"{n} rounds at B={b}" for b, n in more.items()) + ")" if more else ""
