"""depth="auto": pick the speculation depth from a cost model calibrated on
this machine.

The expected speed-up of depth k over plain decoding is
    (1 + sum_{i<=k} alpha_i) * step_time / (verify_time(k) + k * head_time)
with alpha_i the cumulative acceptance at depth i. The bare times are measured
here, at the runtime's batch size; alpha comes from the model's own recorded
evaluation when it ships one (the built-in model does), else a cautious prior.
Depth 0 wins whenever no depth is predicted to beat plain decoding, which is
what happens on compute-bound hardware at large batches.

The depth is fixed for the whole job. Under sampling with the residual rule a
row's draws depend on the depth it was produced at, so a depth that moved
with other rows or with timing would make a row's output depend on them; one
depth per job keeps every row reproducible. The choice and its inputs are in
`runtime.stats["auto_depth"]`.
"""

from __future__ import annotations

import json
from typing import List, Sequence

from .costs import measure_bare_costs, predicted_speedup

DEFAULT_ACCEPTANCE = (0.5, 0.3, 0.18, 0.1)  # cautious prior, cumulative by depth


def acceptance_prior(model) -> List[float]:
    """Cumulative acceptance by depth recorded with the checkpoint, if any."""
    meta = model.path / "training.json"
    if meta.exists():
        try:
            rates = json.loads(meta.read_text())["eval"]["acceptance_by_depth"]
            return [float(x) for x in rates]
        except (ValueError, KeyError, TypeError):
            pass
    return list(DEFAULT_ACCEPTANCE)


def best_depth(costs, acceptance: Sequence[float], max_depth: int) -> int:
    depths = [k for k in range(1, max_depth + 1) if k in costs.verify_s and k <= len(acceptance)]
    scores = {k: predicted_speedup(costs, acceptance, k) for k in depths}
    scores[0] = 1.0
    return max(scores, key=lambda k: (scores[k], -k))


def choose_depth(model, contract, max_batch: int):
    """(depth, record) for a job on this machine at this batch size."""
    if model.head is None:
        return 0, {"reason": "no MTP head"}
    acceptance = acceptance_prior(model)
    depths = range(1, contract.max_depth_auto + 1)
    costs = measure_bare_costs(model, max_batch, depths=depths, compiled=contract.compile)
    k = best_depth(costs, acceptance, contract.max_depth_auto)
    record = {
        "depth": k,
        "acceptance_prior": acceptance,
        "bare_costs": costs.as_dict(),
        "predicted_speedup": {str(d): predicted_speedup(costs, acceptance, d) for d in [0, *depths]},
        "policy": "one depth for the whole job (reproducible under sampling)",
    }
    return k, record
