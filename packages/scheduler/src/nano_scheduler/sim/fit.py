"""Fits for the step-time models, in plain Python (the simulator imports no numpy or torch).

``nnls``: least squares with every coefficient >= 0 (Lawson and Hanson's active-set method), so
that no fitted cost is negative; ``nnlad``: least absolute deviations, the same way (a median's
fit: samples that queued behind other work move it little). ``Piecewise``: linear
interpolation through measured points.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence


def nnls(
    rows: Sequence[Sequence[float]],
    targets: Sequence[float],
    weights: Sequence[float] | None = None,
) -> list[float]:
    """Coefficients x >= 0 minimizing sum_i w_i (rows[i] . x - targets[i])^2.

    Columns are scaled to a largest magnitude of 1 before solving (the features span many
    orders of magnitude); a column that is zero everywhere gets coefficient 0.
    """
    if not rows:
        raise ValueError("nothing to fit: no measurements")
    n = len(rows[0])
    if any(len(r) != n for r in rows) or len(targets) != len(rows):
        raise ValueError("every measurement needs one value per feature and one target")
    w = [1.0] * len(rows) if weights is None else list(weights)
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    ata = [[0.0] * n for _ in range(n)]
    atb = [0.0] * n
    for r, t, wi in zip(rows, targets, w):
        x = [v / s for v, s in zip(r, scale)]
        for i in range(n):
            if x[i]:
                xi = wi * x[i]
                atb[i] += xi * t
                row = ata[i]
                for j in range(n):
                    row[j] += xi * x[j]
    coef = _active_set(ata, atb)
    return [c / s for c, s in zip(coef, scale)]


def nnlad(
    rows: Sequence[Sequence[float]], targets: Sequence[float], rounds: int = 60
) -> list[float]:
    """Coefficients x >= 0 minimizing sum_i |rows[i] . x - targets[i]|: iteratively reweighted
    least squares (weights 1 / |residual|, floored so that an exact sample cannot take all
    the weight)."""
    coef = nnls(rows, targets)
    spread = sorted(abs(t) for t in targets)[len(targets) // 2] or 1.0
    floor = 1e-6 * spread
    for _ in range(rounds):
        residual = [abs(sum(c * v for c, v in zip(coef, r)) - t) for r, t in zip(rows, targets)]
        new = nnls(rows, targets, [1.0 / max(e, floor) for e in residual])
        if all(abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-12) for a, b in zip(coef, new)):
            return new
        coef = new
    return coef


def _active_set(ata: list[list[float]], atb: list[float]) -> list[float]:
    """Lawson-Hanson NNLS on the normal equations (n is small: tens of features)."""
    n = len(atb)
    tol = 1e-12 * max(1.0, max(abs(v) for v in atb))
    x = [0.0] * n
    passive: list[int] = []
    for _ in range(3 * n + 10):
        grad = [atb[i] - sum(ata[i][j] * x[j] for j in range(n)) for i in range(n)]
        candidates = [i for i in range(n) if i not in passive and grad[i] > tol]
        if not candidates:
            break
        passive.append(max(candidates, key=lambda i: grad[i]))
        while True:
            z = _solve_subset(ata, atb, passive)
            if all(z[i] > 0 for i in passive):
                x = z
                break
            # Step from x towards z until the first coefficient reaches zero; drop those at zero.
            alpha = min(x[i] / (x[i] - z[i]) for i in passive if z[i] <= 0)
            x = [xi + alpha * (zi - xi) for xi, zi in zip(x, z)]
            passive = [i for i in passive if x[i] > tol]
            for i in range(n):
                if i not in passive:
                    x[i] = 0.0
            if not passive:
                break
    return [max(0.0, v) for v in x]


def _solve_subset(ata: list[list[float]], atb: list[float], cols: list[int]) -> list[float]:
    """The unconstrained least-squares solution on ``cols`` (zero elsewhere), by Gaussian
    elimination with partial pivoting and a tiny ridge for columns that barely vary."""
    k = len(cols)
    diag = max(ata[c][c] for c in cols) or 1.0
    m = [[ata[r][c] for c in cols] + [atb[r]] for r in cols]
    for i in range(k):
        m[i][i] += 1e-10 * diag
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            continue
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, k + 1):
                    m[r][c] -= f * m[col][c]
    sol = [0.0] * k
    for r in range(k - 1, -1, -1):
        if m[r][r] != 0:
            sol[r] = (m[r][k] - sum(m[r][c] * sol[c] for c in range(r + 1, k))) / m[r][r]
    out = [0.0] * len(atb)
    for c, v in zip(cols, sol):
        out[c] = v
    return out


def increasing(points: Sequence[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """The non-decreasing fit (least squares, weighted) to (x, y, weight) points, x ascending:
    pool adjacent violators. Each pooled run becomes one point at its weighted mean x."""
    runs: list[list[float]] = []  # [sum w*x, sum w*y, sum w]
    for x, y, w in points:
        runs.append([w * x, w * y, w])
        while len(runs) > 1 and runs[-2][1] / runs[-2][2] > runs[-1][1] / runs[-1][2]:
            last = runs.pop()
            for i in range(3):
                runs[-1][i] += last[i]
    return [(wx / w, wy / w) for wx, wy, w in runs]


class Piecewise:
    """y(x) through measured points, linear in between; flat below the first point and, past
    the last, the last segment's slope (never decreasing) or ``tail``, whichever is lower.
    ``x`` must be distinct."""

    def __init__(self, points: Sequence[tuple[float, float]], tail: float | None = None) -> None:
        if not points:
            raise ValueError("a piecewise-linear curve needs at least one point")
        pts = sorted(points)
        self.xs = [float(x) for x, _ in pts]
        self.ys = [float(y) for _, y in pts]
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ValueError(f"the points' x must be distinct, got {self.xs}")
        if len(pts) > 1:
            slope = (self.ys[-1] - self.ys[-2]) / (self.xs[-1] - self.xs[-2])
            self.tail = max(0.0, slope)
        else:
            self.tail = 0.0
        if tail is not None:
            self.tail = min(self.tail, max(0.0, tail))

    def __call__(self, x: float) -> float:
        xs = self.xs
        if x <= xs[0]:
            return self.ys[0]
        if x >= xs[-1]:
            return self.ys[-1] + self.tail * (x - xs[-1])
        i = bisect_right(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], self.ys[i - 1], self.ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    @property
    def span(self) -> tuple[float, float]:
        return self.xs[0], self.xs[-1]


def log_hats(x: float, knots: Sequence[float]) -> list[float]:
    """Weights of ``x`` on knots (ascending, > 0) that are hat functions of log(x): they are
    >= 0 and sum to 1, so a cost per unit interpolated between knots stays positive."""
    out = [0.0] * len(knots)
    if x <= knots[0]:
        out[0] = 1.0
    elif x >= knots[-1]:
        out[-1] = 1.0
    else:
        i = bisect_right(knots, x)
        lo, hi = math.log(knots[i - 1]), math.log(knots[i])
        f = (math.log(x) - lo) / (hi - lo)
        out[i - 1], out[i] = 1.0 - f, f
    return out
