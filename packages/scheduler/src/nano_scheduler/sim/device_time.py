"""Device time of a step from the profile's grid (``ProfiledCostModel``'s parts): CUDA-graph
decode forwards interpolated over the batch's total context and the graph size
(``DecodeGraphModel``), eager steps fitted with non-negative coefficients over the batch's
features (``EagerModel``)."""

from __future__ import annotations

import math
from bisect import bisect_left

from nano_scheduler.sim.fit import Piecewise, log_hats, nnls
from nano_scheduler.sim.profile import GridPoint


class DecodeGraphModel:
    """CUDA-graph decode forwards: per captured size, interpolated over the batch's total
    context; between profiled sizes, interpolated over the size."""

    def __init__(self, points: list[GridPoint]) -> None:
        by_size: dict[int, list[tuple[float, float]]] = {}
        for p in points:
            by_size.setdefault(p.num_decodes, []).append(
                (p.num_decodes * p.decode_context, p.seconds)
            )
        self.sizes = sorted(by_size)
        self.curves = {s: Piecewise(_distinct(by_size[s])) for s in self.sizes}
        self.max_context = max(p.decode_context for p in points)

    def __call__(self, size: int, context: int) -> float:
        curve = self.curves.get(size)
        if curve is not None:
            return curve(context)
        sizes = self.sizes
        i = bisect_left(sizes, size)
        if i == 0 or len(sizes) == 1:
            return self.curves[sizes[0 if i == 0 else -1]](context)
        lo, hi = (sizes[-2], sizes[-1]) if i == len(sizes) else (sizes[i - 1], sizes[i])
        a, b = self.curves[lo](context), self.curves[hi](context)
        return max(a, a + (b - a) * (size - lo) / (hi - lo))  # (past the last: its trend)


def _distinct(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """One point per x (the mean of repeated measurements)."""
    groups: dict[float, list[float]] = {}
    for x, y in points:
        groups.setdefault(x, []).append(y)
    return [(x, sum(ys) / len(ys)) for x, ys in groups.items()]


class EagerModel:
    """Eager forwards: t = sum_k c_k f_k(batch) with every c_k >= 0, fitted on relative error.

    Features: a constant; the step's tokens and ramps max(0, tokens - knot) at the profiled
    token counts (a convex piecewise-linear matmul cost; with piecewise CUDA graphs, ``sizes``,
    the tokens padded to the graph that runs them); each chunk's attention pairs weighted
    by hat functions of log(chunk length) (short chunks use the tensor cores worse); keys read
    by chunks; chunks; decodes; decode context.
    """

    def __init__(self, points: list[GridPoint], sizes: list[int] = ()) -> None:
        self.sizes = list(sizes)
        tokens = sorted({self.padded(p.num_tokens) for p in points})
        self.token_knots = _thin(tokens[:-1], 12)
        lengths = sorted({n for p in points for n, _ in p.prefills}) or [1]
        self.length_knots = _geometric(lengths[0], lengths[-1], 8.0)
        self.max_tokens = tokens[-1]
        self.max_cached = max((c for p in points for _, c in p.prefills), default=0) or 1
        rows = [
            self.features(p.prefills, p.num_decodes, p.num_decodes * p.decode_context)
            for p in points
        ]
        times = [p.seconds for p in points]
        self.coef = nnls(rows, times, [1 / t**2 for t in times])
        self.floor = min(times) / 2

    def padded(self, tokens: int) -> int:
        """The tokens a step's matmuls compute: padded to its piecewise graph's size."""
        if not self.sizes or tokens > self.sizes[-1]:
            return tokens
        return self.sizes[bisect_left(self.sizes, tokens)]

    def features(self, prefills, num_decodes: int, decode_context: int) -> list[float]:
        t = self.padded(sum(n for n, _ in prefills) + num_decodes)
        f = [1.0, t]
        f += [t - k if t > k else 0.0 for k in self.token_knots]
        pairs = [0.0] * len(self.length_knots)
        keys = 0
        for n, cached in prefills:
            p = n * cached + n * (n + 1) / 2
            for j, w in enumerate(log_hats(n, self.length_knots)):
                if w:
                    pairs[j] += w * p
            keys += cached + n
        f += pairs
        f += [keys, len(prefills), num_decodes, decode_context]
        return f

    def __call__(self, prefills, num_decodes: int, decode_context: int) -> float:
        f = self.features(prefills, num_decodes, decode_context)
        return max(self.floor, sum(c * x for c, x in zip(self.coef, f)))


def _thin(values: list[int], most: int) -> list[int]:
    """At most ``most`` of ascending values, spread evenly in log scale."""
    if len(values) <= most:
        return values
    lo, hi = math.log(values[0]), math.log(values[-1])
    picked = []
    for k in range(most):
        target = math.exp(lo + (hi - lo) * k / (most - 1))
        best = min(values, key=lambda v: abs(math.log(v) - math.log(target)))
        if best not in picked:
            picked.append(best)
    return sorted(picked)


def _geometric(lo: float, hi: float, ratio: float) -> list[float]:
    knots = [float(lo)]
    while knots[-1] * ratio < hi:
        knots.append(knots[-1] * ratio)
    if hi > knots[-1]:
        knots.append(float(hi))
    return knots
