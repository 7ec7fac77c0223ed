"""Warm-standby sizing (ByteRobust §6): spares = P99 of a binomial model of simultaneous failures.

With N machines that each fail on a given day with probability p, the number failing is
X ~ Binomial(N, p); the standby pool is the smallest s with P(X <= s) >= quantile. The probabilities
are summed exactly from the binomial terms (no normal or Poisson approximation), in log space so that
large N does not underflow (1 - p)^N. A sum within a relative 1e-12 of the quantile counts as reaching
it, so that decimal ties (N = 1, p = 0.01: P(X <= 0) = 0.99) are not lost to rounding.
"""

from __future__ import annotations

import math

_TIE = 1e-12  # relative slack on the quantile, for decimal ties


def spares(machines: int, failure_prob: float, quantile: float = 0.99) -> int:
    """The smallest s with P(X <= s) >= quantile for X ~ Binomial(machines, failure_prob)."""
    if isinstance(machines, bool) or not isinstance(machines, int) or machines < 1:
        raise ValueError(f"machines must be a whole number of at least 1, not {machines!r}")
    p, q = float(failure_prob), float(quantile)
    if not 0.0 <= p <= 1.0:  # also refuses NaN
        raise ValueError(f"failure probability must be between 0 and 1, not {failure_prob!r}")
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be more than 0 and less than 1, not {quantile!r}")
    if p == 0.0:
        return 0
    if p == 1.0:
        return machines
    log_ratio = math.log(p) - math.log1p(-p)
    log_term = machines * math.log1p(-p)  # log P(X = 0)
    log_cdf = log_term
    log_q = math.log(q) - _TIE
    for k in range(machines):
        if log_cdf >= log_q:
            return k
        # P(X = k+1) / P(X = k) = (N - k) / (k + 1) * p / (1 - p)
        log_term += math.log(machines - k) - math.log(k + 1) + log_ratio
        hi, lo = max(log_cdf, log_term), min(log_cdf, log_term)
        log_cdf = hi + math.log1p(math.exp(lo - hi))
    return machines
