"""``nano-engine profile``: measure the engine once, so that nano-sim predicts any workload.

A profile holds the engine's resolved settings, the device's time of steps over a grid of batch
shapes (``device``), the loop's host time on real workloads, offline and through the HTTP
server (``loop``), and the server's per-request costs; ``nano_scheduler.sim.profile`` defines
the file and ``nano_scheduler.sim.profiled`` the model nano-sim builds from it.
"""

from __future__ import annotations

import datetime
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from nano_engine import __version__
from nano_engine.config import EngineConfig
from nano_engine.engine import LLMEngine
from nano_engine.profiler import loop
from nano_engine.profiler.device import DeviceClock, measure_forwards, measure_sampling
from nano_engine.step_log import describe_device
from nano_scheduler.sim.grid import Grid
from nano_scheduler.sim.profile import MODEL_FIELDS, EngineSettings, Profile

Progress = Callable[[str, int, int], None]  # (phase, done, total)


def profile_engine(
    config: EngineConfig,
    quick: bool = False,
    server: bool = True,
    progress: Progress | None = None,
    engine_process: bool = True,
) -> Profile:
    """Start an engine with ``config``, measure it, shut it down; ``quick``: a small grid and
    short workloads (a CPU, a test); ``server``: also through the HTTP server (needs
    nano-engine[serve]), which runs its engine in a process of its own unless not
    ``engine_process`` (``serve --disable-frontend-multiprocessing``)."""
    report = progress or (lambda phase, done, total: None)
    timings: dict[str, float] = {}
    engine = LLMEngine(config)
    try:
        runner, sched = engine.runner, engine.scheduler.config
        graph_sizes = list(runner.graphs.sizes) if runner.graphs is not None else []
        grid = Grid(
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            engine.max_model_len,
            runner.num_blocks * runner.block_size,
            graph_sizes,
            quick,
        )
        clock = DeviceClock(runner.device, repeat=3 if quick else 5)

        def phase(name: str, fn, *args):
            start = time.perf_counter()
            result = _in_a_thread(fn, *args, lambda done, total: report(name, done, total))
            timings[name] = time.perf_counter() - start
            return result

        decode = phase(
            "decode graphs",
            measure_forwards,
            engine,
            [((), b, c) for b, c in grid.decode_graphs()],
            clock,
        )
        shapes = grid.eager()
        if graph_sizes:  # (every decode-only batch runs in a graph)
            shapes = [s for s in shapes if s[0]]
        eager = phase("eager steps", measure_forwards, engine, shapes, clock)
        sampling = phase("sampling", measure_sampling, engine, grid.sampling_rows(), clock)
        engine.reset_prefix_cache()  # (the grid wrote garbage into cached blocks)
        work = loop.Workloads(
            sched.max_num_seqs, engine.max_model_len, engine.model_config.vocab_size, quick
        )
        host = {"offline": phase("offline loop", loop.offline, engine, work)}
        mc = engine.model_config
        settings = EngineSettings(
            block_size=runner.block_size,
            num_kv_blocks=runner.num_blocks,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            policy=sched.policy,
            admission_lookahead=sched.admission_lookahead,
            watermark=sched.watermark,
            async_scheduling=engine.async_scheduling,
            cuda_graph_sizes=tuple(graph_sizes),
            piecewise_graphs=runner.pieces is not None,
            tensor_parallel_size=config.tensor_parallel_size,
            dtype=str(runner.dtype).removeprefix("torch."),
            attention_backend=runner.backend.name,
            kv_cache_dtype="fp8" if config.fp8_kv_cache else "auto",
            quantization=config.quantization or ("fp8" if "quantization_config" in mc.raw else ""),
            quantize_lm_head=config.quantize_lm_head,
        )
        device = describe_device(runner.device)
    finally:
        engine.shutdown()
    costs: dict = {}
    if server:  # (once this engine has given the device back)
        host["server"], costs = phase("server loop", loop.server, config, work, engine_process)
    return Profile(
        model={name: getattr(mc, name) for name in MODEL_FIELDS},
        device={**device, "count": config.tensor_parallel_size},
        engine=settings,
        decode_graphs=decode,
        eager=eager,
        sampling=sampling,
        host=host,
        server=costs,
        meta={
            "model_name": Path(config.model).name,
            "architecture": mc.architecture,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "nano_engine": __version__,
            "python": platform.python_version(),
            "command": " ".join(sys.argv),
            "quick": quick,
            "seconds": timings,
        },
    )


def _in_a_thread(fn, *args):
    """Run ``fn`` in a thread of its own, as the engine's loop runs: on a CPU, torch's kernels
    called from a thread other than the main one run up to 2x slower (seen on our 2-core
    machine), and the profile must time what the loop sees."""
    result: list = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=target, name="nano-engine-profile")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def report(profile: Profile) -> str:
    """What was measured, and how well nano-sim's model built from it reproduces the
    measurements: the eager fit on its own grid points, the device time of the loop's real
    steps (measured in the loop, predicted from the grid), and the loop's host time."""
    from nano_scheduler.sim.cost_model import BatchShape
    from nano_scheduler.sim.profiled import ProfiledCostModel

    eng, meta = profile.engine, profile.meta
    graphs = (
        f"CUDA graphs for {len(eng.cuda_graph_sizes)} batch sizes up to {eng.cuda_graph_sizes[-1]}"
        if eng.cuda_graph_sizes
        else "no CUDA graphs"
    )
    if eng.piecewise_graphs:
        graphs += ", piecewise CUDA graphs for the other steps"
    lines = [
        f"{meta.get('model_name')} on {profile.device.get('name')}: {eng.num_kv_blocks} KV blocks "
        f"of {eng.block_size} tokens, {graphs}, async scheduling {eng.async_scheduling}",
        f"measured: {len(profile.decode_graphs)} CUDA-graph decode steps, {len(profile.eager)} "
        f"eager steps, {sum(len(v) for v in profile.sampling.values())} sampling points; "
        + ", ".join(f"{len(v)} {k} loop iterations" for k, v in profile.host.items())
        + " in "
        + ", ".join(f"{k} {v:.0f} s" for k, v in meta.get("seconds", {}).items()),
    ]
    for frontend, records in profile.host.items():
        model = ProfiledCostModel(profile, frontend)
        if frontend == next(iter(profile.host)):
            fit = [
                model._eager(p.prefills, p.num_decodes, p.num_decodes * p.decode_context)
                / p.seconds
                - 1
                for p in profile.eager
            ]
            lines.append(f"eager model on its grid: {_errors(fit)}")
        steps = [r for r in records if r.num_tokens and r.forward]
        device = [model.forward_time(BatchShape.of_record(r)) / r.forward - 1 for r in steps]
        if model._host.cpu:  # (the server's fit is to the loop thread's CPU time)
            records = [r for r in records if r.cpu is not None]
        host_measured = sum(sum(r.cpu) if model._host.cpu else r.host for r in records)
        host_model = 0.0
        for r in records:
            if r.num_tokens:
                cost = model.step_cost(BatchShape.of_record(r))
                host_model += cost.schedule + cost.launch + cost.sample_host
            post, publish = model.resolve_cost(r.resolved, r.finished, r.outputs)
            host_model += (post if r.resolved else 0.0) + publish
        lines.append(
            f"{frontend}: the loop's forwards against the model (the grid's, times what served "
            f"steps took over it): {_errors(device)}; "
            f"host {'CPU ' if model._host.cpu else ''}time {host_measured:.3f} s measured, "
            f"{host_model:.3f} s fitted"
        )
    return "\n".join(lines)


def _errors(relative: list[float]) -> str:
    if not relative:
        return "no data"
    ordered = sorted(abs(e) for e in relative)
    median, p90 = ordered[len(ordered) // 2], ordered[int(0.9 * (len(ordered) - 1))]
    mean = sum(relative) / len(relative)
    return f"median |error| {median:.1%}, p90 {p90:.1%}, mean {mean:+.1%} ({len(relative)} steps)"
