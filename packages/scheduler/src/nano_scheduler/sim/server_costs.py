"""The HTTP server's costs from a profile's served workloads (``server_costs``): the event
loop's work per request, prompt token, pass over the streams and chunk sent (a fit to its
thread's CPU time, or the front process's), the network's latency, a request's hop to the
engine after its handling and the share of a pass that relays the outputs before its first
chunk (fitted to the calmest workload's ways in and out)."""

from __future__ import annotations

import math
from itertools import pairwise

from nano_scheduler.sim.fit import Piecewise, increasing, nnlad, nnls
from nano_scheduler.sim.host import ServerCosts
from nano_scheduler.sim.profile import StepRecord


def server_costs(records: list[StepRecord], server: dict) -> ServerCosts:
    """The server's event-loop costs, from its thread's CPU time in the engine's step log. A
    pass over the streams follows each publication of outputs: its cost by the number of
    streams is the mean over iterations that took no request in, in bins of the number, made
    non-decreasing (it grows faster than linearly: caches). A request's handling: its cost per
    request and per prompt token, fitted to what the passes leave of the event loop's CPU time
    from each iteration to the next, by the requests (and their prompt tokens) accepted in it,
    over the workloads whose requests were sent one by one over time, as a trace sends them.
    A burst sent at once costs less a request (one wake-up of the event loop serves many),
    and mixed in, it made the fit put everything on the tokens: 0 ms + 3.0-3.9 us a token on
    an H200, where the spread-out requests measure 1.1-1.4 ms + 1.2-1.7 us, as replayed
    traces do. (A profile whose workloads do not say how they were sent: all of them but the
    first, a cold start.) The ways in and out of the workload sent at the lowest rate give the
    network's latency, a pass's relay before its first chunk and a request's hop from the
    front to the engine's process (``_way_out``, ``_hop``)."""
    if not any(r.server_cpu_at is not None for r in records):
        raise ValueError(
            "the profile lacks the server's event-loop measurements (profiled with "
            "--no-server?): use --frontend offline, or profile through the server"
        )
    # The pass over an iteration's outputs runs once they are published, mostly before the
    # next iteration begins: the event loop's CPU from one iteration's start to the next's.
    bins: dict[int, list[tuple[int, float]]] = {}
    for a, b in pairwise(records):
        if a.outputs and not a.accepted and not b.accepted and b.server_cpu_at is not None:
            cpu = b.server_cpu_at - a.server_cpu_at
            bins.setdefault(int(math.log2(a.outputs) * 2), []).append((a.outputs, cpu))
    points = [
        (sum(n for n, _ in group) / len(group), sum(c for _, c in group) / len(group), len(group))
        for _, group in sorted(bins.items())
        if len(group) >= 3
    ]
    if not points:
        raise ValueError("the profile's server measurements hold no pass over the streams")
    passes = Piecewise(increasing(points))
    spread = _spread([sample for group in bins.values() for sample in group], passes)
    own = bool(server.get("engine_process", False))
    request, prompt_token, busy = _request_costs(
        records, server.get("workloads", []), passes, shared=not own
    )
    first = float(server.get("first_request_s") or 0.0)
    ingress, egress = _calmest(server)
    latency, relay = _way_out(egress, server.get("egress", []), passes)
    # (an engine in the front's process has a request once the front handled it)
    hop, hop_token = _hop(ingress, latency, request, prompt_token) if own else (0.0, 0.0)
    points = tuple(zip(passes.xs, passes.ys))
    return ServerCosts(
        request,
        prompt_token,
        points,
        latency,
        first,
        busy,
        own,
        hop,
        hop_token,
        relay,
        spread=spread,
    )


SPREAD_QUANTILES = 32  # ratios kept for each octave of streams


def _spread(samples: list[tuple[int, float]], passes: Piecewise) -> tuple:
    """The passes' spread (``ServerCosts.spread``): each measured pass over its mean by the
    number of streams, grouped by octave of that number (20 passes at least), each group as
    ``SPREAD_QUANTILES`` quantiles scaled to a mean of 1 (the mean cost stays the fitted one).
    On an H200 (Qwen3-0.6B) a pass over 128-300 streams took 0.61x / 0.99x / 1.32x / 1.74x
    its mean at p10 / p50 / p90 / p99: one pass in ten outlasts a step of 1.3x its mean."""
    groups: dict[int, list[float]] = {}
    for n, cpu in samples:
        mean = passes(n)
        if mean > 0:
            groups.setdefault(int(math.log2(n)), []).append(cpu / mean)
    spread = []
    for octave, ratios in sorted(groups.items()):
        if len(ratios) < 20:
            continue
        ratios.sort()
        k = SPREAD_QUANTILES
        picked = [ratios[min(len(ratios) - 1, int((i + 0.5) * len(ratios) / k))] for i in range(k)]
        picked = [max(x, 1e-3) for x in picked]
        mean = sum(picked) / len(picked)
        spread.append((octave, tuple(x / mean for x in picked)))
    return tuple(spread)


def _calmest(server: dict) -> tuple[list, list]:
    """The ingress and egress samples of the workload sent at the lowest rate over time (of
    10 requests at least), where a request seldom waits behind others: the samples follow
    the workloads' order. None ([], []) where the profile cannot say which workload a sample
    is from, or sent every workload at once: a burst's samples queued, and the simulation
    queues its requests itself."""
    ingress, egress = server.get("ingress", []), server.get("egress", [])
    workloads = server.get("workloads", [])
    if any(len(w) < 6 for w in workloads) or sum(int(w[2]) for w in workloads) != len(ingress):
        return [], []
    spans, start = [], 0
    for w in workloads:
        if w[5] > 0 and w[2] >= 10:
            spans.append((w[2] / w[5], start, start + int(w[2])))
        start += int(w[2])
    if not spans:
        return [], []
    _, first, end = min(spans)
    # (a sample for each request with a first token: aligned where every request has one)
    return ingress[first:end], egress[first:end] if len(egress) == len(ingress) else []


def _hop(ingress: list, latency: float, request: float, prompt_token: float) -> tuple[float, float]:
    """The way in that the front's handling and the network leave: seconds and seconds per
    prompt token, a median's fit (least absolute deviations) of each request's way in (sent
    -> the engine has it) less the network's latency and its handling."""
    if len(ingress) < 10:
        return 0.0, 0.0
    rows = [[1.0, float(tokens)] for tokens, _ in ingress]
    left = [s - latency - request - prompt_token * tokens for tokens, s in ingress]
    hop, per_token = nnlad(rows, left)
    return hop, per_token


def _way_out(calm: list, egress: list, passes: Piecewise) -> tuple[float, float]:
    """The network's latency, and the share of a pass over n streams spent before its first
    chunk goes out (the relay), from the first tokens' way out (published -> received) in the
    calmest workload: a median's fit of way out - one stream's chunk = latency + relay x the
    rest of the pass (latency + relay x pass(n) + (1 - relay) x pass(n) / n for a stream
    first in its pass, as a new one is), where 10 of them at least came with other streams;
    else the latency alone, from the lone first tokens (their median less a pass over one
    stream: the calmest workload's, else all of them), and no relay."""
    calm = [(n, seconds) for n, seconds in calm if n >= 1]
    if sum(n >= 2 for n, _ in calm) >= 10:  # (relay: CPU time, the way out: wall; at most 1)
        rows = [[1.0, passes(n) - passes(n) / n] for n, _ in calm]
        left = [seconds - passes(n) / n for n, seconds in calm]
        latency, relay = nnlad(rows, left)
        return latency, min(1.0, relay)
    lone = sorted(seconds for n, seconds in calm if n == 1) or sorted(
        seconds for n, seconds in egress if n == 1
    )
    return (max(0.0, lone[len(lone) // 2] - passes(1)) if lone else 0.0), 0.0


def _request_costs(
    records: list[StepRecord], workloads: list, passes, shared: bool = True
) -> tuple[float, float, float]:
    """The event loop's handling of a request: seconds per request and per prompt token, and
    how much more it costs while the loop thread computes (``ServerCosts.busy``). Fitted on
    the event loop's CPU seconds of each iteration less its passes, as (requests, prompt
    tokens) times 1 + busy x the share of the iteration the loop thread computed (its CPU
    seconds over the iteration's; 0 where the log has none), ``busy`` the best of a grid
    (0 where the two do not share an interpreter: not ``shared``)."""
    spread = [w for w in workloads if len(w) > 5 and w[5] > 0]
    rows, residual, shares = [], [], []
    for first, end, *_ in spread or workloads[1:]:
        first, end = int(first), min(int(end), len(records) - 1)
        for a, b in pairwise(records[first : end + 1]):
            if a.server_cpu_at is None or b.server_cpu_at is None:
                continue
            cpu = b.server_cpu_at - a.server_cpu_at - (passes(a.outputs) if a.outputs else 0.0)
            rows.append((b.accepted, b.accepted_tokens or 0))
            residual.append(cpu)
            shares.append(min(1.0, sum(a.cpu) / (b.t - a.t)) if a.cpu and b.t > a.t else 0.0)
    if not any(accepted for accepted, _ in rows):
        return 0.0, 0.0, 0.0
    best = None
    for busy in [i / 20 for i in range(41)] if shared and any(shares) else [0.0]:
        scaled = [[n * (1 + busy * s), t * (1 + busy * s)] for (n, t), s in zip(rows, shares)]
        coef = nnls(scaled, residual)
        error = sum((coef[0] * x + coef[1] * y - r) ** 2 for (x, y), r in zip(scaled, residual))
        if best is None or error < best[0]:
            best = (error, coef[0], coef[1], busy)
    return best[1], best[2], best[3]
