"""The benchmark issue's speed requirements (the bars below), checked on its records. A cell reads "missed"
only when the whole confidence interval of its median of paired ratios (`bench.run.median_interval`) lies
below the bar: on a shared machine, a median under the bar alone is not yet a finding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

DEPTH0_VS_MLX_LM = 0.95
DECODE_OVER_PREDICTED = 0.9
DECODE_OVER_PREDICTED_BATCH_SIZES = (1, 4)
AUTO_VS_BEST = 0.95


@dataclass
class Cell:
    label: str  # which setting, e.g. "B=4 T=1 depth 3"
    value: float
    ci: Optional[Sequence[float]]  # [low, high] of the median, or None (too few rounds)
    bar: float

    @property
    def status(self) -> str:
        if self.value >= self.bar:
            return "met"
        if self.ci is None or self.ci[1] >= self.bar:
            return "within noise"
        return "missed"


@dataclass
class Requirement:
    title: str
    cells: List[Cell]


def check_requirements(records: Sequence[dict]) -> List[Requirement]:
    mtplx = [r for r in records if r.get("engine") == "mtplx"]
    return [
        Requirement(f"depth 0 >= {DEPTH0_VS_MLX_LM} of mlx-lm", _depth0_cells(mtplx)),
        Requirement(
            f"decode speed-up >= {DECODE_OVER_PREDICTED} of predicted at batch "
            + ", ".join(map(str, DECODE_OVER_PREDICTED_BATCH_SIZES)),
            _decode_cells(mtplx),
        ),
        Requirement(f"auto >= {AUTO_VS_BEST} of the best fixed depth", _auto_cells(mtplx)),
    ]


def requirement_lines(records: Sequence[dict]) -> List[str]:
    """One line per requirement (cells met / checked), then each cell not met."""
    lines = ["requirements (median [90% confidence interval of it]):"]
    for req in check_requirements(records):
        if not req.cells:
            continue
        met = sum(c.status == "met" for c in req.cells)
        lines.append(f"  {req.title}: {met} of {len(req.cells)} met")
        for c in req.cells:
            if c.status != "met":
                lines.append(f"    {c.label}: {c.value:.3f}{_interval(c.ci)} ({c.status})")
    return lines if len(lines) > 1 else []


def _depth0_cells(mtplx: Sequence[dict]) -> List[Cell]:
    return [
        Cell(_setting(r), r["ratio_vs_mlx_lm"], r.get("ratio_ci"), DEPTH0_VS_MLX_LM)
        for r in mtplx
        if r["depth"] == 0 and r.get("ratio_vs_mlx_lm") is not None
    ]


def _decode_cells(mtplx: Sequence[dict]) -> List[Cell]:
    cells = []
    for r in mtplx:
        if r["depth"] in (0, "auto") or r["batch_size"] not in DECODE_OVER_PREDICTED_BATCH_SIZES:
            continue
        share = decode_over_predicted(r)
        if share is not None:
            cells.append(Cell(f"{_setting(r)} depth {r['depth']}", *share, DECODE_OVER_PREDICTED))
    return cells


def decode_over_predicted(r: dict) -> Optional[Tuple[float, Optional[List[float]]]]:
    """(measured decode speed-up over the predicted one, its interval): the record's per-round figure
    (mtplx.bench.run.add_measured_speedups), or in older records the median over the pooled prediction."""
    if r.get("decode_over_predicted") is not None:
        return r["decode_over_predicted"], r.get("decode_over_predicted_ci")
    pred, meas = r.get("predicted_speedup"), r.get("measured_decode_speedup")
    if not pred or meas is None:
        return None
    ci = r.get("measured_decode_speedup_ci")
    return meas / pred, None if ci is None else [x / pred for x in ci]


def _auto_cells(mtplx: Sequence[dict]) -> List[Cell]:
    return [
        Cell(
            f"{_setting(r)} (against depth {r['best_fixed_depth']})",
            r["auto_vs_best"],
            r.get("auto_vs_best_ci"),
            AUTO_VS_BEST,
        )
        for r in mtplx
        if r["depth"] == "auto" and r.get("auto_vs_best") is not None
    ]


def _setting(r: dict) -> str:
    return f"B={r['batch_size']} T={r['temperature']:g}"


def _interval(ci: Optional[Sequence[float]]) -> str:
    return "" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"
