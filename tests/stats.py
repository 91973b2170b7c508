"""Chi-square machinery shared by the distribution tests (no scipy here).

The tail is the exact regularised upper incomplete gamma Q(df/2, x/2): a power
series below df/2 + 1, a Lentz continued fraction above; thresholds come from
bisection; power from Patnaik's approximation of the noncentral chi-square.
"""

import math

import numpy as np


def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for X ~ chi-square(df): Q(df/2, x/2)."""
    if x <= 0:
        return 1.0
    a, y = df / 2.0, x / 2.0
    log_prefactor = -y + a * math.log(y) - math.lgamma(a)
    if y < a + 1.0:
        # P(a, y) = e^-y y^a / Gamma(a) * sum_n y^n / (a (a+1) ... (a+n))
        term = total = 1.0 / a
        n = 0
        while term > total * 1e-17:
            n += 1
            term *= y / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    # Q(a, y) by its continued fraction, evaluated with the modified Lentz method.
    tiny = 1e-300
    b = y + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi2_threshold(alpha: float, df: float) -> float:
    """x with chi2_sf(x, df) == alpha, by bisection."""
    lo, hi = 0.0, df + 10.0
    while chi2_sf(hi, df) > alpha:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def noncentral_power(threshold: float, df: int, lam: float) -> float:
    """Approximate P(noncentral chi2(df, lam) > threshold) (Patnaik's
    scaled central chi-square), to report the power of the planted test."""
    c = (df + 2 * lam) / (df + lam)
    h = (df + lam) ** 2 / (df + 2 * lam)
    return chi2_sf(threshold / c, h)


def chisq(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom for observed counts against
    cell probabilities. A sample in a zero-probability cell is an outright
    failure (inf); cells expecting fewer than 5 are pooled."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    impossible = probs == 0
    if counts[impossible].sum() > 0:
        return math.inf, max(int((~impossible).sum()) - 1, 0)
    n = counts.sum()
    expected, observed = n * probs[~impossible], counts[~impossible]
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    stat = float(np.sum((observed - expected) ** 2 / expected))
    return stat, len(expected) - 1
