"""The calibrated model (a profile of the engine): predictions at shapes it was not measured at,
no time <= 0, warnings far outside the profile, profiles refused for what they are not; and the
simulated loop's order (a request that arrives while a step runs)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys
import warnings
from itertools import pairwise

import pytest
from profile_helpers import (
    BUDGET,
    MAX_SEQS,
    eager_seconds,
    graph_seconds,
    host_record,
    host_sample,
    sample_seconds,
    synthetic_profile,
)

from nano_scheduler import SchedulerConfig, cuda_graph_sizes, piecewise_graph_sizes
from nano_scheduler.sim import BatchShape, DeviceOnlyModel, Request, Simulator
from nano_scheduler.sim.cost_model import StepCost
from nano_scheduler.sim.fit import Piecewise, increasing, nnlad, nnls
from nano_scheduler.sim.host import ServerCosts, ServerHost
from nano_scheduler.sim.host_time import HostModel
from nano_scheduler.sim.metrics import summarize
from nano_scheduler.sim.profile import Profile, StepRecord
from nano_scheduler.sim.profiled import ProfiledCostModel
from nano_scheduler.sim.server_costs import server_costs


@pytest.fixture(scope="module")
def model() -> ProfiledCostModel:
    return ProfiledCostModel(synthetic_profile(), frontend="offline")


def test_eager_steps_at_held_out_shapes_within_3_percent(model):
    """Mixed batches of several chunks over cached prefixes beside decodes: none of them is
    a grid point."""
    rng = random.Random(1)
    errors = []
    for _ in range(400):
        chunks = []
        for _ in range(rng.randint(1, 4)):
            chunks.append((rng.randint(16, BUDGET // 8), rng.choice((0, rng.randint(1, 6000)))))
        decodes = rng.randint(0, MAX_SEQS)
        context = decodes * rng.randint(64, 4000)
        batch = BatchShape(chunks, [context // max(decodes, 1)] * decodes, len(chunks) + decodes)
        truth = eager_seconds(chunks, decodes, batch.decode_context)
        errors.append(model.forward_time(batch) / truth - 1)
    worst = max(abs(e) for e in errors)
    assert worst < 0.03, f"worst relative error {worst:.1%}"


def test_piecewise_graphs_pad_an_eager_step_to_the_graph_that_runs_it():
    """With piecewise CUDA graphs an eager step's matmuls run over its tokens padded to the
    next captured size: held-out steps within 3% of that, and a what-if token budget pads to
    the sizes that budget captures (its own largest one included)."""
    profile = synthetic_profile(piecewise=True)
    assert profile.engine.piecewise_graphs
    model = ProfiledCostModel(profile, frontend="offline")
    sizes = piecewise_graph_sizes(BUDGET)
    rng = random.Random(4)
    for _ in range(300):
        chunks = [(rng.randint(16, BUDGET // 4), rng.choice((0, rng.randint(1, 4000))))]
        decodes = rng.randint(0, MAX_SEQS)
        batch = BatchShape(chunks, [700] * decodes, 1 + decodes)
        truth = eager_seconds(chunks, decodes, batch.decode_context, sizes)
        assert model.forward_time(batch) == pytest.approx(truth, rel=0.03)
    # 4,200 tokens run in the graphs of 4,608; a budget of 4,200 captures 4,200 itself
    batch, chunk = BatchShape([(4200, 0)], [], 1), [(4200, 0)]
    what_if = ProfiledCostModel(profile, frontend="offline", max_num_batched_tokens=4200)
    padded, exact = model.forward_time(batch), what_if.forward_time(batch)
    assert padded == pytest.approx(eager_seconds(chunk, 0, 0, sizes), rel=0.03)
    assert exact == pytest.approx(eager_seconds(chunk, 0, 0), rel=0.03)
    assert padded > 1.04 * exact


def test_graph_decodes_and_sampling_at_held_out_shapes_within_3_percent(model):
    """Decode batches of any size (padded to the graph that holds them) and context."""
    rng = random.Random(2)
    sizes = cuda_graph_sizes(MAX_SEQS)
    for _ in range(300):
        n = rng.randint(1, MAX_SEQS)
        contexts = [rng.randint(20, 8000) for _ in range(n)]
        padded = next(s for s in sizes if s >= n)
        truth = graph_seconds(padded, sum(contexts))
        assert model.forward_time(BatchShape([], contexts, n)) == pytest.approx(truth, rel=0.03)
        assert model.sample_time(n) == pytest.approx(sample_seconds(n), rel=0.03)


def test_a_graph_decode_of_fused_rows_pays_no_separate_sampling():
    """The engine's decode graphs draw greedy and plain random rows themselves (the profiled
    graph time includes it); top-p and the like, and every eager step, sample after."""
    profile = synthetic_profile()
    profile.sampling["top_p"] = [(r, 3 * s) for r, s in profile.sampling["greedy"]]
    decode = BatchShape([], [500] * 8, 8)
    mixed = BatchShape([(64, 0)], [500] * 8, 9)
    fused = ProfiledCostModel(profile, frontend="offline", sampling="greedy")
    filtered = ProfiledCostModel(profile, frontend="offline", sampling="top_p")
    assert fused.step_cost(decode).sample == 0
    assert fused.step_cost(mixed).sample == pytest.approx(sample_seconds(9), rel=0.03)
    assert filtered.step_cost(decode).sample == pytest.approx(3 * sample_seconds(8), rel=0.03)
    assert fused.step_cost(decode).forward == filtered.step_cost(decode).forward


def test_the_sampler_host_work_is_fitted_apart_after_graphs_and_eager_steps(model):
    """After a decode graph that drew its tokens the sampler's host work is a fraction of what
    it is after an eager step; one fit over both got the eager steps' 3x too low."""
    decode, mixed = BatchShape([], [500] * 40, 40), BatchShape([(64, 0)], [500] * 40, 41)
    assert model.step_cost(decode).sample_host == pytest.approx(host_sample(40, False), rel=0.05)
    assert model.step_cost(mixed).sample_host == pytest.approx(host_sample(41, True), rel=0.05)


def test_a_what_if_graph_size_between_profiled_ones(model):
    """max_num_seqs 40 captures a graph of 40 rows, which the profile (64) never ran: its time
    lies between the neighbouring sizes'."""
    what_if = ProfiledCostModel(synthetic_profile(), frontend="offline", max_num_seqs=40)
    assert what_if.graph_sizes == cuda_graph_sizes(40) and 40 in what_if.graph_sizes
    batch = BatchShape([], [1000] * 40, 40)
    assert what_if.forward_time(batch) == pytest.approx(graph_seconds(40, 40_000), rel=0.03)


def test_no_time_is_zero_or_negative(model):
    tiny = [
        BatchShape([(1, 0)], [], 1),
        BatchShape([], [1], 1),
        BatchShape([(1, 0)], [1], 2),
        BatchShape([(16, 0)], [], 0),
    ]
    for batch in tiny:
        cost = model.step_cost(batch)
        assert model.forward_time(batch) > 0 and sum(cost) > 0
        assert all(part >= 0 for part in cost)
    assert min(model.resolve_cost(0, 0, 0)) >= 0


def test_far_outside_the_profile_warns_once(model):
    huge = BatchShape([(BUDGET * 4, 0)], [], 1)
    with pytest.warns(RuntimeWarning, match="tokens in a step .* far beyond"):
        assert model.forward_time(huge) > model.forward_time(BatchShape([(BUDGET, 0)], [], 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.forward_time(huge)  # (warned once already)
        model.forward_time(BatchShape([(BUDGET, 0)], [], 1))  # within the profile: no warning


def test_nnls_meets_its_optimality_conditions():
    """Non-negative least squares (the KKT conditions): every coefficient >= 0, the gradient
    of the squared error zero where a coefficient is positive and >= 0 where it is zero."""
    rng = random.Random(3)
    for _ in range(50):
        cols = rng.randint(1, 6)
        rows = [[rng.uniform(0, 2) for _ in range(cols)] for _ in range(rng.randint(cols, 30))]
        targets = [rng.uniform(-1, 3) for _ in rows]
        x = nnls(rows, targets)
        residual = [sum(a * b for a, b in zip(r, x)) - t for r, t in zip(rows, targets)]
        for j in range(cols):
            gradient = sum(r[j] * e for r, e in zip(rows, residual))
            assert x[j] >= 0 and gradient >= -1e-6
            assert x[j] == 0 or abs(gradient) < 1e-6


def test_monotone_fit_and_interpolation():
    assert increasing([(1, 1.0, 1), (2, 2.0, 1), (3, 5.0, 1)]) == [(1, 1.0), (2, 2.0), (3, 5.0)]
    # A dip pools with its neighbour into their weighted mean, at their weighted mean x.
    assert increasing([(1, 1.0, 1), (2, 4.0, 3), (3, 2.0, 1)]) == [(1, 1.0), (2.25, 3.5)]
    rng = random.Random(4)
    fit = increasing([(x, rng.uniform(0, 10), rng.randint(1, 5)) for x in range(40)])
    assert all(b[1] >= a[1] and b[0] > a[0] for a, b in pairwise(fit))
    curve = Piecewise([(1, 2.0), (3, 4.0)])
    assert (curve(0), curve(2), curve(5)) == (2.0, 3.0, 6.0)  # flat below, the trend above
    assert Piecewise([(1, 2.0)])(9) == 2.0


# ---- the loop's order --------------------------------------------------------------------------


class FixedSteps(DeviceOnlyModel):
    """Every step takes 10 ms of the device, nothing of the host."""

    def __init__(self, synchronous: bool) -> None:
        self.synchronous = synchronous

    def step_time(self, batch: BatchShape) -> float:
        return 0.010


def run_two(synchronous: bool):
    """A request at t=0, another at 15 ms: while the device runs step 1 ([10, 20] ms)."""
    requests = [Request(0.0, 32, 30), Request(0.015, 32, 5)]
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    sim = Simulator(requests, FixedSteps(synchronous), config, num_blocks=64)
    return {r.request: r for r in sim.run().requests}


def test_async_scheduling_admits_a_request_two_steps_after_the_one_running():
    """Iteration k (from k=1) starts at 10 (k - 1) ms, when step k - 1 starts on the device,
    and schedules step k: a request arriving while the device runs step 1 is first scheduled
    by iteration 3 (at 20 ms), and its token, from step 3 ([30, 40] ms), is out at 40 ms."""
    second = run_two(synchronous=False)[1]
    assert second.first_scheduled == pytest.approx(0.020)
    assert second.first_token == pytest.approx(0.040)


def test_a_synchronous_device_admits_it_one_step_later():
    """On a synchronous device (the CPU) iteration k computes step k itself, [10 k, 10 k + 10]:
    arriving during step 1, the request is in step 2; with async scheduling that step's token
    is read by iteration 3, out at its end (40 ms)."""
    second = run_two(synchronous=True)[1]
    assert second.first_scheduled == pytest.approx(0.020)
    assert second.first_token == pytest.approx(0.040)


def test_a_request_s_way_in_and_out_through_the_server():
    """A lone request through a server of known costs (the engine in its own process): the
    way in is the network's latency and its handling, the way out the latency and a pass over
    one stream; offline, both are nothing."""
    latency, handling, one_pass = 0.002, 0.001, 0.0003
    costs = ServerCosts(handling, 0.0, ((1, one_pass), (64, 0.002)), latency, own_process=True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    served = Simulator([Request(0.0, 32, 5)], FixedSteps(False), config, 64, server=costs)
    (record,) = served.run().requests
    assert record.ingress == pytest.approx(latency + handling)
    assert record.egress == pytest.approx(latency + one_pass)
    assert record.first_token - record.arrival > record.ingress + record.egress
    (offline,) = Simulator([Request(0.0, 32, 5)], FixedSteps(False), config, 64).run().requests
    assert offline.ingress == 0.0 and offline.egress == 0.0
    summary = summarize([record], [])
    assert summary["ingress_s"]["p50"] == pytest.approx(latency + handling)
    assert summary["egress_s"]["p50"] == pytest.approx(latency + one_pass)


# ---- bad profiles ------------------------------------------------------------------------------


@pytest.fixture()
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    return path


def test_a_saved_profile_loads_back(profile_file, tmp_path):
    loaded = Profile.load(profile_file)
    assert loaded.engine == synthetic_profile().engine
    assert len(loaded.eager) == len(synthetic_profile().eager)
    # (the weights' and the cache's formats too, not only what times steps)
    profile = synthetic_profile()
    profile.engine = dataclasses.replace(
        profile.engine, kv_cache_dtype="fp8", quantization="fp8", quantize_lm_head=True
    )
    profile.save(tmp_path / "fp8.json")
    assert Profile.load(tmp_path / "fp8.json").engine == profile.engine


def test_a_truncated_profile_is_refused(profile_file):
    text = profile_file.read_text()
    profile_file.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="not a complete JSON profile"):
        Profile.load(profile_file)


def test_a_hand_edited_profile_is_refused(profile_file):
    data = json.loads(profile_file.read_text())
    data["engine"]["num_kv_blocks"] = 10
    profile_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="checksum does not match"):
        Profile.load(profile_file)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["eager"][0].update(seconds=-1.0), r"eager\[0\].seconds must be > 0"),
        (lambda d: d["eager"][3].update(seconds="fast"), r"eager\[3\].seconds must be a finite"),
        (lambda d: d["engine"].pop("block_size"), r"engine lacks \['block_size'\]"),
        (lambda d: d["decode_graphs"][0].update(decodes=[3, 100]), "not a decode batch of"),
        (lambda d: d["host"]["offline"][2].update(schedule=float("nan")), "must be a finite"),
        (lambda d: d.update(format="something-else"), "not a nano-engine-profile"),
        (
            lambda d: d["server"].update(workloads=[[0, 9, 1, 128]]),
            r"server.workloads\[0\] must be a list of 5 or 6 numbers",
        ),
        (lambda d: d["server"].update(workloads=[[0, 9, 1, 128, 0.1, -2]]), r"must be >= 0"),
    ],
)
def test_a_profile_with_bad_values_names_them(profile_file, edit, message):
    """Even with a checksum that matches (written by other code than nano-engine profile)."""
    from nano_scheduler.sim.profile import _checksum

    data = json.loads(profile_file.read_text())
    edit(data)
    data["checksum"] = _checksum(data)
    profile_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        Profile.load(profile_file)


def test_a_profile_of_another_model_is_refused(profile_file):
    other = dict(synthetic_profile().model, hidden_size=4096, num_hidden_layers=36)
    with pytest.raises(ValueError, match=r"another model: num_hidden_layers 36 .*hidden_size"):
        Profile.load(profile_file).check_model(other)


# ---- nano-sim with a profile -------------------------------------------------------------------


def nano_sim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nano_scheduler.sim.cli", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_nano_sim_predicts_from_a_profile_with_the_profiles_settings(profile_file, tmp_path):
    out = tmp_path / "sim.json"
    workload = ("--synthetic", "40", "--input-len", "10", "300", "--output-len", "5", "40")
    proc = nano_sim(*workload, "--rate", "50", "--profile", str(profile_file))
    assert proc.returncode == 2 and "no 'server' host measurements" in proc.stderr
    proc = nano_sim(
        *workload,
        "--rate",
        "50",
        "--profile",
        str(profile_file),
        "--frontend",
        "offline",
        "--max-num-seqs",
        "16",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "with the profile of synthetic" in proc.stdout
    assert "60000 KV blocks of 16 tokens" in proc.stdout  # (the profile's)
    data = json.loads(out.read_text())
    assert data["summary"]["requests"] == 40 and data["summary"]["batch_size"]["max"] <= 16
    records = data["requests"]
    assert [r["request"] for r in records] == list(range(40))
    assert all(0 < r["ttft"] <= r["e2e"] and r["queueing"] >= 0 for r in records)
    # a host three times as slow as the profiled one: the same steps, each longer
    slow = tmp_path / "slow.json"
    options = ("--profile", str(profile_file), "--frontend", "offline", "--max-num-seqs", "16")
    proc = nano_sim(*workload, "--rate", "50", *options, "--host-scale", "3", "--json", str(slow))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(slow.read_text())["summary"]
    assert summary["tpot_s"]["mean"] > 1.5 * data["summary"]["tpot_s"]["mean"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--block-size", "32"), "measured with KV blocks of 16 tokens, not 32"),
        (("--gpu", "h100"), "--gpu would be ignored with --profile"),
        (("--step-overhead-ms", "1"), "--step-overhead-ms would be ignored with --profile"),
        (("--sampling", "top_p"), "no 'top_p' sampling costs"),
        (("--host-scale", "0"), "--host-scale must be > 0 and finite, got 0.0"),
        (("--host-scale", "inf"), "--host-scale must be > 0 and finite, got inf"),
    ],
)
def test_nano_sim_refuses_what_a_profile_cannot_answer(profile_file, args, message):
    workload = ("--synthetic", "5", "--frontend", "offline")
    proc = nano_sim(*workload, "--profile", str(profile_file), *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_nano_sim_checks_the_model_against_the_profile(profile_file, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(synthetic_profile().model, intermediate_size=4096)))
    proc = nano_sim(
        "--synthetic", "5", "--profile", str(profile_file), "--model-config", str(config)
    )
    assert proc.returncode == 2 and "intermediate_size 4096 (profiled: 3072)" in proc.stderr
    proc = nano_sim("--synthetic", "5", "--frontend", "offline", "--model-config", str(config))
    assert proc.returncode == 2 and "--frontend needs --profile" in proc.stderr
    proc = nano_sim("--synthetic", "5", "--host-scale", "2", "--model-config", str(config))
    assert proc.returncode == 2 and "--host-scale needs --profile" in proc.stderr


@pytest.mark.parametrize("num_blocks", [20_000, 400])
def test_steady_decode_runs_simulated_without_the_scheduler_match_the_loop(monkeypatch, num_blocks):
    """The fast path (runs of decode steps across block boundaries, the scheduler called
    once after) gives what stepping through the scheduler gives, within the context's growth
    over a block's worth of steps: in a roomy pool, and in one so tight that sequences are
    preempted (a run stops before the step that would find no free block), with the same
    blocks taken, shared and evicted."""
    from nano_scheduler.sim import synthetic

    profile = synthetic_profile()
    config = SchedulerConfig(
        max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, max_model_len=4096
    )
    server = ServerCosts(3e-4, 1e-7, ((1, 1e-4), (64, 2e-3)), 1e-4)

    def simulate():
        model = ProfiledCostModel(profile, frontend="offline")
        model._host.between = [5e-4, 8e-4]  # (the loop's time between iterations counts too)
        requests = synthetic(
            120, (80, 600), (20, 300), rate=40, seed=5, num_prefixes=4, prefix_len=64
        )
        sim = Simulator(requests, model, config, num_blocks=num_blocks, server=server)
        return sim, sim.run()

    runs = []  # (steps each fast run covered)
    real = Simulator._steady_decodes

    def counted(*args):
        clocks = real(*args)
        if clocks is not None:
            runs.append(clocks[3])
        return clocks

    monkeypatch.setattr(Simulator, "_steady_decodes", counted)
    fast_sim, fast = simulate()
    monkeypatch.setattr(Simulator, "_steady_decodes", lambda *a: None)
    slow_sim, slow = simulate()
    assert sum(runs) > slow.num_steps / 10  # (the fast path did run, often)
    assert max(runs) > fast_sim.block_manager.block_size  # (across block boundaries)
    assert fast.num_steps == pytest.approx(slow.num_steps, rel=0.01)
    assert fast.num_preemptions == pytest.approx(slow.num_preemptions, rel=0.1)
    if num_blocks < 1000:
        assert slow.num_preemptions > 0
    a, b = fast.summary(), slow.summary()
    assert a["requests"] == b["requests"] == 120
    for key in ("output_tok_per_s", "duration_s"):
        assert a[key] == pytest.approx(b[key], rel=0.01)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert a[key]["p50"] == pytest.approx(b[key]["p50"], rel=0.02), key
    for stat in ("mean", "max"):  # (the blocks the runs grew into, step by step)
        assert a["kv_usage"][stat] == pytest.approx(b["kv_usage"][stat], rel=1e-3)
    fast_bm, slow_bm = fast_sim.block_manager.stats(), slow_sim.block_manager.stats()
    assert fast_bm.free_blocks == slow_bm.free_blocks == num_blocks  # (every block back)
    assert fast_bm.hit_rate == pytest.approx(slow_bm.hit_rate, abs=0.02)
    assert fast_bm.hit_rate > 0  # (the shared prefixes were found)
    # (the blocks the runs filled were shared as the steps would have: they stay cached)
    assert fast_bm.cached_free_blocks == pytest.approx(slow_bm.cached_free_blocks, rel=0.02)
    if num_blocks < 1000:
        assert fast_bm.evictions == pytest.approx(slow_bm.evictions, rel=0.1)
        assert slow_bm.evictions > 0


class _ContextCost:
    """Step costs that grow with the decodes' contexts (``per_token`` seconds a token of
    context) or not at all (0): with 0 the fast path must give what stepping gives, exactly."""

    synchronous = False

    def __init__(self, per_token: float = 0.0) -> None:
        self.per_token = per_token

    def step_cost(self, batch: BatchShape) -> StepCost:
        forward = 5e-3 + 1e-5 * len(batch.decodes) + self.per_token * sum(batch.decodes)
        return StepCost(1e-4, 1e-4, forward, 1e-4, 1e-4, 2e-4)

    def resolve_cost(self, resolved: int, finished: int, outputs: int) -> tuple[float, float]:
        return 1e-5 * resolved, 1e-5 * outputs

    def is_eager(self, batch: BatchShape) -> bool:
        return False

    def intake_cost(self, prompt_tokens: int) -> float:
        return 1e-5


@pytest.mark.parametrize("block_size", [4, 16])
def test_steady_decode_runs_leave_the_block_manager_as_stepping_does(block_size):
    """Step costs that do not depend on the contexts: the fast path's results equal
    stepping's exactly, and so do the block manager's (blocks taken, shared, evicted, keyed),
    also where prompts repeat and the pool is so tight that a run's new blocks evict cached
    ones whose keys the blocks it fills take over (the run's calls replayed in the loop's
    order)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    requests, t = [], 0.0
    for _ in range(40):
        t += rng.expovariate(20)
        prompt = rng.choice(prompts)
        requests.append(Request(t, len(prompt), rng.randint(10, 200), prompt_token_ids=prompt))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024)

    def simulate(fast: bool):
        sim = Simulator(
            requests,
            _ContextCost(),
            config,
            num_blocks=60 * 16 // block_size,
            block_size=block_size,
        )
        if not fast:
            sim._steady_decodes = lambda *a: None
        result = sim.run()
        bm = sim.block_manager
        return (
            result.summary(),
            [sorted(vars(r).items()) for r in result.requests],
            list(result.timeline.time),
            list(result.timeline.kv_usage),
            bm.stats(),
            len(bm.hash_to_block),
            result.num_steps,
        )

    fast, slow = simulate(True), simulate(False)
    assert fast[4].evictions > 0 and fast[4].hit_rate > 0  # (evicted, shared)
    for a, b in zip(fast, slow):
        assert a == b


def test_a_steady_decode_run_takes_its_step_cost_again_as_the_contexts_grow():
    """One long decode alone, its step's cost growing with its context: the fast path, which
    takes the cost again every block's worth of steps, ends within 0.2% of stepping."""
    requests = [Request(0.0, 100, 3000)]
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096)

    def duration(fast: bool) -> float:
        sim = Simulator(requests, _ContextCost(1e-6), config, num_blocks=1000)
        if not fast:
            sim._steady_decodes = lambda *a: None
        return sim.run().summary()["duration_s"]

    assert duration(True) == pytest.approx(duration(False), rel=2e-3)


def test_an_eager_launchs_drawn_spread_keeps_the_fitted_mean():
    """An eager launch is its fit times a ratio drawn from the profile's: the draw adds the
    spread, not a bias (a tail of slow launches made the draws 12% slower on average than the
    fit, and than the scenarios measured)."""
    rng = random.Random(3)
    records = [host_record(rng, 0.01 * i) for i in range(600)]
    for r in records:
        if r.eager and rng.random() < 0.2:
            r.launch *= 3  # (a step launched while the event loop parsed a burst)
    host = HostModel(records, 16)
    assert sum(host._spread) / len(host._spread) == pytest.approx(1.0)
    batch = BatchShape([(256, 0)], [500] * 20, 21)
    fitted = HostModel._dot(host.launch_eager, host._launch_row(20, 1, 500, 276))
    drawn = [host.step(batch, True, False)[1] for _ in range(4000)]
    assert sum(drawn) / len(drawn) == pytest.approx(fitted, rel=0.03)
    assert max(drawn) > 1.5 * fitted  # (the slow tail is still drawn)


def test_requests_received_during_a_launch_stay_out_of_the_launchs_fit():
    """A launch during which the engine received requests (taken in at the next iteration)
    took 0.3 ms more a request (their thread held the interpreter lock): fitted apart, the
    launch of a step predicts its shape's cost alone, in graphs and eagerly; left in, a
    profile's bursts would put their cost on every launch of a trace whose requests come
    apart."""
    rng = random.Random(7)
    records = [host_record(rng, 0.01 * i) for i in range(800)]
    for a, b in pairwise(records):
        b.accepted = rng.choice((0, 0, 1, 2, 3))
        a.launch += 3e-4 * b.accepted
    host = HostModel(records, 16)
    for eager, base, coef in ((True, 3e-3, host.launch_eager), (False, 4e-4, host.launch_graph)):
        assert coef[-1] == pytest.approx(3e-4, rel=0.05)  # (a request received meanwhile)
        chunks = [(256, 0)] if eager else []
        launch = host.step(BatchShape(chunks, [500] * 20, 21), eager, not eager, spread=False)[1]
        assert launch == pytest.approx(base + 2e-7 * (20 + eager), rel=0.03)


def test_the_waiting_queue_s_cost_is_held_at_the_profile_s_edge():
    """A profile sees tens of requests waiting behind its bursts, where admissions come with
    them; its fit per waiting request, multiplied by a saturated trace's hundreds, put
    milliseconds on every step. Beyond the profile's largest queue the term holds (with one
    warning), within it the fit stands."""
    rng = random.Random(5)
    records = [host_record(rng, 0.01 * i) for i in range(400)]
    for r in records:
        r.waiting = rng.randint(0, 20)
        r.schedule += 1e-5 * r.waiting  # (what came with a queue there: 10 us a request)
    host = HostModel(records, 16)
    assert host.max_waiting == 20 and host.schedule[5] == pytest.approx(1e-5, rel=0.05)

    def schedule(waiting):
        return host.step(BatchShape([], [500] * 8, 8, num_waiting=waiting), False, True)[0]

    assert schedule(20) - schedule(10) == pytest.approx(1e-4, rel=0.05)
    assert schedule(600) == schedule(20)

    profile = synthetic_profile()
    for r in profile.host["offline"]:
        r.waiting = rng.randint(0, 20)
    model = ProfiledCostModel(profile, frontend="offline")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.step_cost(BatchShape([], [500] * 8, 8, num_waiting=25))  # (near the edge)
    queued = BatchShape([], [500] * 8, 8, num_waiting=600)
    held = "requests waiting 600 is far beyond the profile's 20; the scheduler's time is held"
    with pytest.warns(RuntimeWarning, match=held):
        model.step_cost(queued)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.step_cost(queued)  # (warned once already)


def _served(workloads, seed=0):
    """Server step records from known event-loop costs: a pass over n streams costs 40 us a
    stream; a request 1.4 ms and 1.6 us a prompt token when requests come one by one, 0.4 ms
    when a burst comes at once. ``workloads``: (requests, sent over seconds) each."""
    rng = random.Random(seed)
    records, rows, cpu = [], [], 0.0
    for requests, sent_over in workloads:
        first = len(records)
        left, prompt = requests, 0
        while left or len(records) - first < 40:
            accepted = left if sent_over == 0 else min(left, int(rng.random() < 0.3))
            left -= accepted
            tokens = sum(rng.randint(16, 2048) for _ in range(accepted))
            prompt += tokens
            r = StepRecord(t=len(records) * 0.01, prefills=[], decodes=[8, 800, 100])
            r.accepted, r.accepted_tokens, r.outputs = accepted, tokens, rng.randint(1, 64)
            if records:  # (the previous iteration's pass; the requests this one takes in)
                cpu += 4e-5 * records[-1].outputs
            cpu += (1.4e-3 if sent_over else 4e-4) * accepted + 1.6e-6 * tokens
            r.server_cpu_at = cpu
            records.append(r)
        rows.append([first, len(records), requests, prompt, 0.0, sent_over])
    return records, rows


def test_a_requests_cost_is_fitted_on_requests_sent_one_by_one():
    records, workloads = _served([(1, 0.0), (64, 0.0), (256, 0.0), (120, 3.0), (120, 1.5)])
    costs = server_costs(records, {"workloads": workloads})
    assert costs.pass_seconds(32) == pytest.approx(32 * 4e-5, rel=0.05)
    assert costs.request == pytest.approx(1.4e-3, rel=0.05)
    assert costs.prompt_token == pytest.approx(1.6e-6, rel=0.05)
    # A profile from before workloads said how they were sent: fitted over all of them.
    old = server_costs(records, {"workloads": [w[:5] for w in workloads]})
    assert old.request < 1.2e-3


def test_a_requests_extra_cost_beside_a_computing_loop_thread_is_fitted():
    """Requests that cost 1.6 times as much while the loop thread computes: the fit finds the
    factor from the share of each iteration the loop thread computed; a log without the loop
    thread's CPU seconds gives no such term."""
    rng = random.Random(4)
    records, cpu, share = [], 0.0, 0.0
    for i in range(2000):
        accepted = int(rng.random() < 0.4)
        tokens = rng.randint(16, 2048) * accepted
        r = StepRecord(t=i * 0.01, prefills=[], decodes=[8, 800, 100])
        r.accepted, r.accepted_tokens, r.outputs = accepted, tokens, 8
        if records:  # (the previous iteration's pass, its requests' handling beside its share)
            cpu += 4e-5 * 8 + (1.4e-3 * accepted + 1.6e-6 * tokens) * (1 + 0.6 * share)
        r.server_cpu_at = cpu
        share = rng.choice([0.05, 0.3, 0.9])  # (waits for the device ... an eager launch)
        r.cpu = [0.0, share * 0.01, 0.0, 0.0, 0.0]  # (the loop thread's CPU of the iteration)
        records.append(r)
    records = records[:-1]  # (the last iteration's requests were never handled)
    workloads = [[0, len(records), 0, 0, 0.0, 20.0]]
    costs = server_costs(records, {"workloads": workloads})
    assert costs.busy == pytest.approx(0.6, abs=0.051)
    assert costs.request == pytest.approx(1.4e-3, rel=0.05)
    assert costs.prompt_token == pytest.approx(1.6e-6, rel=0.05)
    for r in records:
        r.cpu = None
    assert server_costs(records, {"workloads": workloads}).busy == 0.0


def test_a_request_handled_beside_the_computing_loop_thread_costs_more():
    """The event loop's handling of a request: its cost while the loop thread waits for the
    device, 1 + busy times it while the loop thread computes (and the loop thread waits)."""
    costs = ServerCosts(1e-3, 0.0, ((1, 1e-4), (64, 2e-3)), busy=0.5)
    host = ServerHost(costs, lambda *a: None)
    host.send(0.0, 0, 10)
    assert host.free(0.0, 0.004) == 0.004  # (the loop thread waits: the request costs 1 ms)
    assert [position for _, position in host.accepted(0.004)] == [0]
    host.send(0.0051, 1, 10)
    end = host.cpu(0.005, 0.002)  # (computing from 5 ms: the request comes in at 5.1 ms)
    assert end == pytest.approx(0.005 + 0.002 + 1.5e-3)
    assert [position for _, position in host.accepted(end)] == [1]
    assert host.busy_until == pytest.approx(0.0051 + 1.5e-3)


def test_an_engine_in_its_own_process_computes_beside_the_event_loop():
    """The same work as above with the engine in a process of its own: the loop thread is
    never held up by the event loop, whose work still queues (requests, then passes)."""
    received = []
    costs = ServerCosts(1e-3, 0.0, ((1, 1e-4), (64, 2e-3)), own_process=True)
    host = ServerHost(costs, lambda seq, t, done: received.append((seq, t)))
    host.send(0.0, 0, 10)
    host.send(0.0001, 1, 10)
    assert host.cpu(0.0, 0.002) == 0.002  # (in-process, it would wait for both requests)
    assert [position for _, position in host.accepted(0.002)] == [0, 1]
    host.publish(0.0025, [(7, False)])
    host.send(0.0026, 2, 10)  # (arrives during the pass: handled after it)
    assert host.cpu(0.0025, 0.001) == pytest.approx(0.0035)
    assert host.next_accept(0.0035) == pytest.approx(0.0025 + 1e-4 + 1e-3)
    assert received == [(7, pytest.approx(0.0025 + 1e-4))]


def test_the_event_loop_accepts_one_connection_an_iteration():
    """uvloop's poll accepts one new connection an iteration, and a request is handled two
    iterations after its connection is accepted: with passes over the streams filling the
    iterations back to back (outputs published faster than a pass takes), one request gets in
    a pass and the rest wait, though the work of handling them is small; without the passes,
    each is handled when it comes."""
    costs = ServerCosts(1e-4, 0.0, ((1, 1e-4), (100, 9e-3)), own_process=True)
    host = ServerHost(costs, lambda *a: None)
    for i in range(500):  # (one every 2 ms)
        host.send(i * 2e-3, i, 10)
    for k in range(200):  # (100 streams every 5 ms, a pass of 9 ms each time)
        host.publish(k * 5e-3, [(seq, False) for seq in range(100)])
    accepted = host.accepted(1.0)
    assert [position for _, position in accepted] == list(range(len(accepted)))
    assert len(accepted) == pytest.approx(1.0 / (9e-3 + 1e-4), abs=5)
    # (the first waits for the pass the first output woke: 9 ms, then its handling)
    assert accepted[0][0] == pytest.approx(9e-3 + 1e-4)
    assert accepted[-1][0] - accepted[-1][1] * 2e-3 > 0.5  # (the queue grew all along)
    calm = ServerHost(costs, lambda *a: None)
    for i in range(500):
        calm.send(i * 2e-3, i, 10)
    assert [when for when, _ in calm.accepted(1.0)] == [
        pytest.approx(i * 2e-3 + 1e-4) for i in range(500)
    ]


def test_a_kept_alive_connection_takes_the_clients_next_request_past_the_backlog():
    """A finished request's connection stays open (HTTP keep-alive) and the client's next
    request on it is read by the next poll, handled the iteration after: ahead of the new
    connections waiting to be accepted, one an iteration. Not once the connection has been
    idle longer than ``keep_alive``, nor with ``keep_alive`` 0 (every request on a new
    connection)."""

    def served(keep_alive: float, second_request_at: float) -> dict[int, float]:
        costs = ServerCosts(
            1e-4, 0.0, ((1, 1e-4), (100, 9e-3)), own_process=True, keep_alive=keep_alive
        )
        host = ServerHost(costs, lambda *a: None)
        for i in range(100):  # (a burst of new connections: a backlog of ~1 s)
            host.send(i * 1e-4, i, 10)
        host.send(second_request_at, 100, 10)
        for k in range(200):  # (passes of 9 ms back to back; a stream ends at 10 ms)
            streams = [(seq, False) for seq in range(100)]
            host.publish(k * 5e-3, [*streams, (1007, True)] if k == 2 else streams)
        return {position: when for when, position in host.accepted(2.0)}

    reused = served(5.0, 0.05)
    assert len(reused) == 101
    assert 0.05 < reused[100] < 0.05 + 3 * (9e-3 + 1e-4)  # (two iterations at most, handled)
    assert sum(when < reused[100] for when in reused.values()) < 10  # (the backlog waits)
    for new in (served(0.0, 0.05), served(0.01, 0.05)):  # (no keep-alive; closed at 30 ms)
        assert max(new, key=new.get) == 100  # (behind every connection that came before)
    with pytest.raises(ValueError, match="keep_alive"):
        ServerCosts(1e-4, 0.0, ((1, 1e-4),), keep_alive=-1.0)


def test_the_passes_spread_is_measured_by_octave_around_the_fitted_mean():
    """Each pass over the streams as measured over its mean by the number of streams, by
    octave of that number: few streams' passes spread 0.5-1.5x, many streams' 0.9-1.1x; the
    ratios' mean is 1, so the mean cost stays the fitted one."""
    rng = random.Random(3)
    records, cpu = [], 0.0
    for i in range(2000):
        r = StepRecord(t=i * 0.01, prefills=[], decodes=[8, 800, 100])
        r.outputs = rng.choice([4, 5, 6, 7, 100, 110, 120])
        if records:
            wide = records[-1].outputs < 32
            factor = rng.choice([0.5, 1.5]) if wide else rng.choice([0.9, 1.1])
            cpu += 4e-5 * records[-1].outputs * factor
        r.server_cpu_at = cpu
        records.append(r)
    costs = server_costs(records, {"workloads": [[0, len(records), 0, 0, 0.0, 0.0]]})
    spread = dict(costs.spread)
    assert sorted(spread) == [2, 6]  # (4-7 streams, 100-120)
    for octave, (lo, hi) in ((2, (0.5, 1.5)), (6, (0.9, 1.1))):
        ratios = spread[octave]
        assert sum(ratios) / len(ratios) == pytest.approx(1.0)
        assert min(ratios) == pytest.approx(lo, abs=0.1)
        assert max(ratios) == pytest.approx(hi, abs=0.1)
    assert costs.pass_ratios(1) == spread[2]  # (the nearest octave measured)
    assert costs.pass_ratios(300) == spread[6]
    assert ServerCosts(1e-4, 0.0, ((1, 1e-4),)).pass_ratios(64) == (1.0,)
    with pytest.raises(ValueError, match="spread of octave 3"):
        ServerCosts(1e-4, 0.0, ((1, 1e-4),), spread=((3, (1.0, 0.0)),))


def test_a_pass_that_outlasts_the_next_step_merges_its_streams_tokens():
    """Outputs published every 10 ms to 100 streams, a pass over them 9 ms on average: with
    every pass at its mean, each stream gets a chunk a step; with passes spread around the
    mean, the front now and then falls a step behind and sends two steps' tokens in one chunk
    (fewer chunks than tokens, as a busy front's streams get), the same way every run."""

    def chunks(spread: tuple) -> int:
        received = []
        costs = ServerCosts(1e-4, 0.0, ((1, 9e-5), (100, 9e-3)), own_process=True, spread=spread)
        host = ServerHost(costs, lambda seq, t, done: received.append(seq))
        for k in range(200):
            host.publish(k * 0.01, [(seq, False) for seq in range(100)])
        host.drain(2.0)
        return len(received)

    assert chunks(()) == 200 * 100
    spread = ((6, (0.7, 1.3)),)
    merged = chunks(spread)
    assert 100 * 100 < merged < 200 * 100
    assert chunks(spread) == merged


def test_a_profile_from_before_the_workloads_sending_time_loads(profile_file):
    from nano_scheduler.sim.profile import _checksum

    data = json.loads(profile_file.read_text())
    data["server"]["workloads"] = [[0, 40, 4, 4000, 0.1], [40, 90, 30, 9000, 0.5]]
    data["checksum"] = _checksum(data)
    profile_file.write_text(json.dumps(data))
    assert Profile.load(profile_file).server["workloads"][1] == [40, 90, 30, 9000, 0.5]


def test_the_device_ratio_of_a_step_log_says_how_fast_its_device_ran():
    """(graphs, eager steps): 1 on steps like the profile's, 1.3 where the device took 1.3
    times as long; eager steps whose launch bounded them (the device waited) are left out."""
    from dataclasses import replace

    model = ProfiledCostModel(synthetic_profile(), frontend="offline")
    rng = random.Random(12)
    steps = [replace(host_record(rng, 0.01 * i), launch=1e-5) for i in range(300)]
    assert sum(r.eager for r in steps) > 50 and sum(not r.eager for r in steps) > 50
    assert model.device_ratio(steps) == pytest.approx((1.0, 1.0), rel=0.03)
    slow = [replace(r, forward=1.3 * r.forward) for r in steps]
    assert model.device_ratio(slow) == pytest.approx((1.3, 1.3), rel=0.03)
    waited = [replace(r, launch=1.0) if r.eager else r for r in slow]
    graphs, eager = model.device_ratio(waited)
    assert graphs == pytest.approx(1.3, rel=0.03) and math.isnan(eager)
    assert all(math.isnan(x) for x in model.device_ratio([]))


def test_the_host_ratio_of_a_step_log_says_how_fast_its_host_ran():
    """1 on steps like the profile's; 2 where each phase took twice as long."""
    from dataclasses import replace

    from nano_scheduler.sim.profile import HOST_PHASES

    model = ProfiledCostModel(synthetic_profile(), frontend="offline")
    rng = random.Random(11)
    steps = [host_record(rng, 0.01 * i) for i in range(300)]
    assert model.host_ratio(steps) == pytest.approx(1.0, rel=0.05)
    slow = [replace(r, **{p: 2 * getattr(r, p) for p in HOST_PHASES}) for r in steps]
    assert model.host_ratio(slow) == pytest.approx(2.0, rel=0.05)
    assert math.isnan(model.host_ratio([]))


BETWEEN, INTAKE, PER_TOKEN = {False: 3e-4, True: 6e-4}, 4e-4, 5e-7


def _loop(seed: int, compute: dict | None = None) -> list[StepRecord]:
    """Iterations that start when the one before ended: its phases, its wait for the device,
    the loop's time between iterations (``BETWEEN``), then what the requests taken in before
    the next one cost the loop; ``compute``: a synchronous device's time of a step (graph,
    eager), on the loop's thread."""
    rng = random.Random(seed)
    records, t, taken = [], 0.0, (0, 0)
    for _ in range(800):
        t += INTAKE * taken[0] + PER_TOKEN * taken[1]
        r = host_record(rng, t)
        r.accepted, r.accepted_tokens = taken
        r.wait = rng.choice((0.0, 2e-3))  # (the device's time the loop waited for)
        t += r.host + r.wait + BETWEEN[r.eager]
        if compute is not None:
            r.forward, r.sample_device = compute[r.eager], 1e-4
            t += r.forward + r.sample_device
        taken = (rng.randint(1, 3), rng.randint(100, 3000)) if rng.random() < 0.3 else (0, 0)
        records.append(r)
    return records


def test_the_loop_s_time_between_iterations_and_a_request_s_intake_are_fitted():
    """The loop's time that no phase counts (between one iteration's publish and the next:
    statistics, the step log, the inbox) and what a request taken in costs the loop: fitted
    from when iterations start, beside their waits and modelled phases."""
    records = _loop(7)
    host = HostModel(records, 16)
    assert host.rest(False) == pytest.approx(BETWEEN[False], rel=0.05)
    assert host.rest(True) == pytest.approx(BETWEEN[True], rel=0.05)
    assert host.intake_cost(0) == pytest.approx(INTAKE, rel=0.05)
    assert host.intake_cost(2000) - host.intake_cost(0) == pytest.approx(2000 * PER_TOKEN, rel=0.05)
    # a profile's model hands them to the simulation
    profile = synthetic_profile()
    profile.host["offline"] = records
    model = ProfiledCostModel(profile, frontend="offline")
    assert model.step_cost(BatchShape([(256, 0)], [], 1)).between == host.rest(True)
    assert model.intake_cost(1000) == host.intake_cost(1000)
    # on a synchronous device (a CPU) the step's compute runs on the loop's thread, outside
    # its phases: it is no time between iterations
    computed = _loop(7, compute={False: 2e-3, True: 5e-3})
    synchronous = HostModel(computed, 16, synchronous=True)
    assert synchronous.rest(False) == pytest.approx(BETWEEN[False], rel=0.05)
    assert synchronous.rest(True) == pytest.approx(BETWEEN[True], rel=0.05)
    assert HostModel(computed, 16).rest(True) > BETWEEN[True] + 4e-3  # (counted, unasked)
    # in CPU seconds (an engine sharing the server's process) the simulation charges the lock
    # itself: nothing is fitted
    for r in records:
        r.cpu = [r.schedule, r.launch, r.post, r.sample, r.publish]
    cpu = HostModel(records, 16, cpu=True)
    assert cpu.rest(True) == cpu.rest(False) == cpu.intake_cost(1000) == 0.0


def test_a_ragged_decode_graph_costs_as_its_longest_sequence_says():
    """The grid's decode graphs have equal contexts; a served batch's are ragged, and the
    longest sequence's attention ends last. The floor (an equal batch of a share of the
    longest context) is fitted on the profile's served graph steps; equal batches keep their
    interpolation."""
    rng = random.Random(11)
    sizes = cuda_graph_sizes(MAX_SEQS)
    floor = 0.3

    def served_graph_time(contexts):
        size = next(s for s in sizes if s >= len(contexts))
        return graph_seconds(size, max(sum(contexts), floor * size * max(contexts)))

    profile = synthetic_profile()
    records = profile.host["offline"]
    for r in records[::2]:  # ragged graph steps, each with its device time
        n = rng.randint(1, MAX_SEQS)
        contexts = [rng.randint(20, 400) for _ in range(n - 1)] + [rng.randint(2000, 8000)]
        r.prefills, r.eager = [], False
        r.decodes = [n, sum(contexts), max(contexts)]
        r.forward = served_graph_time(contexts)
    model = ProfiledCostModel(profile, frontend="offline")
    assert model._ragged == pytest.approx(floor)
    for _ in range(100):
        n = rng.randint(1, MAX_SEQS)
        ragged = [rng.randint(20, 300) for _ in range(n - 1)] + [rng.randint(3000, 8000)]
        got = model.forward_time(BatchShape([], ragged, n))
        assert got == pytest.approx(served_graph_time(ragged), rel=0.03)
        equal = [rng.randint(20, 8000)] * n
        padded = next(s for s in sizes if s >= n)
        assert model.forward_time(BatchShape([], equal, n)) == pytest.approx(
            graph_seconds(padded, sum(equal)), rel=0.03
        )
    # the profiled engine's graphs pad the served steps, whatever a what-if captures
    what_if = ProfiledCostModel(profile, frontend="offline", max_num_seqs=24)
    assert what_if._ragged == pytest.approx(floor)
    # equal batches say nothing of a floor; too few served graph steps: none
    assert ProfiledCostModel(synthetic_profile(), frontend="offline")._ragged == 0.0
    for r in records[40:]:  # (40 steps of a device time left)
        r.forward = None
    assert ProfiledCostModel(profile, frontend="offline")._ragged == 0.0


class HostBound(DeviceOnlyModel):
    """1 ms of device a step, launched in 4 ms; ``between`` after each publish, ``intake``
    for each request taken in."""

    def __init__(self, between: float, intake: float) -> None:
        self.between, self.intake = between, intake

    def step_cost(self, batch: BatchShape):
        from nano_scheduler.sim.cost_model import StepCost

        return StepCost(launch=0.004, forward=0.001, between=self.between)

    def intake_cost(self, prompt_tokens: int) -> float:
        return self.intake


def test_the_simulated_loop_spends_the_time_between_iterations_and_the_intake():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)

    def lone(between, intake):
        sim = Simulator([Request(0.0, 32, 50)], HostBound(between, intake), config, 64)
        (record,) = sim.run().requests
        return record

    base, spaced, taken = lone(0, 0), lone(0.002, 0), lone(0, 0.003)
    # (every iteration is host-bound: 2 ms more an iteration, over its ~50)
    per_token = (spaced.finish - spaced.first_token) - (base.finish - base.first_token)
    assert per_token == pytest.approx(49 * 0.002, rel=0.05)
    assert taken.first_scheduled - base.first_scheduled == pytest.approx(0.003)
    assert taken.finish - base.finish == pytest.approx(0.003)


def test_a_ragged_decode_graph_served_slower_than_the_grid_is_scaled():
    """Served graph steps that take 6% more than the grid's replays of the same batch (equal
    contexts, so no floor): the ratio is fitted on them and applied to every graph decode."""
    profile = synthetic_profile()
    sizes = cuda_graph_sizes(MAX_SEQS)
    rng = random.Random(5)
    for r in profile.host["offline"][::2]:
        n = rng.randint(1, MAX_SEQS)
        context = rng.randint(100, 4000)
        r.prefills, r.eager, r.decodes = [], False, [n, n * context, context]
        r.forward = 1.06 * graph_seconds(next(s for s in sizes if s >= n), n * context)
    for r in profile.host["offline"][1::2]:
        r.forward = None
    model = ProfiledCostModel(profile, frontend="offline")
    assert model._served == pytest.approx(1.06, rel=0.01) and model._ragged == 0.0
    padded = next(s for s in sizes if s >= 24)
    expected = 1.06 * graph_seconds(padded, 24 * 700)
    assert model.forward_time(BatchShape([], [700] * 24, 24)) == pytest.approx(expected, rel=0.03)


def test_steps_outside_the_graphs_served_slower_than_the_grid_are_scaled():
    """Served eager steps that the device bounded take 20% more than the grid's (a GPU at its
    power limit clocks down under sustained compute; the grid times each shape from idle):
    the ratio is fitted on them and applied to every eager forward. Steps whose launch took
    longer than half their grid time (the device waited for the host) say nothing of it."""
    profile = synthetic_profile()
    records = profile.host["offline"]
    for i, r in enumerate(records):
        r.prefills, r.eager = [[256 + 37 * i % 2048, 0]], True
        grid = eager_seconds(r.prefills, r.decodes[0], r.decodes[1])
        r.launch = 0.2 * grid if i % 2 else 2.0 * grid
        r.forward = (1.2 if i % 2 else 3.0) * grid
    model = ProfiledCostModel(profile, frontend="offline")
    assert model._eager_served == pytest.approx(1.2, rel=0.02)
    batch = BatchShape([(700, 300), (64, 0)], [900] * 12, 14)
    expected = 1.2 * eager_seconds(batch.prefills, 12, batch.decode_context)
    assert model.forward_time(batch) == pytest.approx(expected, rel=0.03)
    # graph decodes keep the grid's time (their own served ratio: none here)
    graph_batch = BatchShape([], [700] * 24, 24)
    assert model.forward_time(graph_batch) == pytest.approx(
        ProfiledCostModel(synthetic_profile(), frontend="offline").forward_time(graph_batch)
    )
    # fewer than 20 device-bound eager steps: no scale
    for r in records[1::2][19:]:
        r.forward = None
    assert ProfiledCostModel(profile, frontend="offline")._eager_served == 1.0


def test_each_host_phase_sums_to_what_it_was_fitted_to():
    """Right-skewed noise on the phases (a slow tail, as a shared host has): a fit weighted
    towards the fast records would fall short of their sum, and a simulation adds the phases
    up; each fit sums to its records' time."""
    rng = random.Random(3)
    records = [host_record(rng, 0.01 * i) for i in range(600)]
    for r in records:
        for phase in ("schedule", "launch", "post", "sample", "publish"):
            setattr(r, phase, getattr(r, phase) * rng.lognormvariate(0, 0.4))
    host = HostModel(records, 16)
    steps = [r for r in records if r.num_tokens]
    fitted = {"schedule": 0.0, "launch": 0.0, "sample": 0.0, "post": 0.0, "publish": 0.0}
    for r in steps:
        shape = BatchShape.of_record(r)
        schedule, launch, sample = host.step(shape, r.eager, not r.eager, spread=False)
        fitted["schedule"] += schedule
        fitted["launch"] += launch
        fitted["sample"] += sample
    for r in records:
        post, publish = host.resolve(r.resolved, r.finished, r.outputs)
        fitted["post"] += post if r.resolved else 0.0
        fitted["publish"] += publish
    resolving = [r for r in records if r.resolved] or steps
    measured = {
        "schedule": sum(r.schedule for r in steps),
        "launch": sum(r.launch for r in steps),
        "sample": sum(r.sample for r in steps),
        "post": sum(r.post for r in resolving),
        "publish": sum(r.publish for r in records),
    }
    for phase in ("schedule", "post"):
        assert fitted[phase] == pytest.approx(measured[phase], rel=1e-6), phase
    # (launch and sample: fitted apart for graphs and eager steps, each summing to its own)
    assert fitted["launch"] == pytest.approx(measured["launch"], rel=1e-6)
    assert fitted["sample"] == pytest.approx(measured["sample"], rel=1e-6)
    # (publish: the mean of each bin of outputs, interpolated: close to the sum, not exact)
    assert fitted["publish"] == pytest.approx(measured["publish"], rel=0.05)


def test_the_publish_phase_follows_its_outputs_past_a_knee():
    """A publish phase of 5 us an output up to 128 outputs and 12 us beyond (as the GPU host's
    caches give out): interpolated by the number of outputs, on both sides of the knee."""

    def publish(n: int) -> float:
        return 2e-5 + 5e-6 * n + 7e-6 * max(0, n - 128)

    rng = random.Random(9)
    records = [host_record(rng, 0.01 * i) for i in range(800)]
    for r in records:
        r.outputs = rng.randint(0, 256)
        r.publish = publish(r.outputs) * rng.uniform(0.9, 1.1)
    host = HostModel(records, 16)
    for n in (3, 40, 100, 180, 250):
        assert host.resolve(n, 0, n)[1] == pytest.approx(publish(n), rel=0.06), n
    # past the largest bin: its cost an output at most, not the last two bins' steeper slope
    last_n, last_t = host.publish.xs[-1], host.publish.ys[-1]
    assert host.resolve(0, 0, 2 * last_n)[1] == pytest.approx(2 * last_t)
    assert Piecewise([(1, 1.0), (2, 3.0)], tail=0.5)(4) == pytest.approx(4.0)
    assert Piecewise([(1, 1.0), (2, 3.0)], tail=-1.0)(4) == 3.0
    # a simulation asking far beyond the profiled outputs is warned, once
    profile = synthetic_profile()
    model = ProfiledCostModel(profile, frontend="offline")
    beyond = int(3 * model._host.publish.span[1])
    with pytest.warns(RuntimeWarning, match="outputs published at once"):
        model.resolve_cost(beyond, 0, beyond)


def test_a_median_s_fit_ignores_what_queued():
    """Samples of a line, a third of them delayed by queueing (tens of times the line): least
    absolute deviations recover the line, least squares does not."""
    rng = random.Random(2)
    rows, targets = [], []
    for _ in range(300):
        tokens = rng.randint(16, 4000)
        late = rng.uniform(5e-3, 5e-2) if rng.random() < 0.3 else 0.0
        rows.append([1.0, tokens])
        targets.append(1e-3 + 4e-7 * tokens + rng.uniform(-5e-5, 5e-5) + late)
    a, b = nnlad(rows, targets)
    assert a == pytest.approx(1e-3, rel=0.05) and b == pytest.approx(4e-7, rel=0.05)
    assert nnls(rows, targets)[0] > 3e-3


def test_the_hop_to_the_engine_and_the_relay_of_a_pass():
    """A request handled by the front then takes ``hop`` + ``hop_token`` a prompt token to
    reach the engine, in the order handled (a short prompt handled after a long one does not
    pass it); a pass over n streams spends ``relay`` of itself before its first chunk."""
    passes = ((1, 1e-4), (100, 1e-2))
    costs = ServerCosts(1e-3, 0.0, passes, 5e-4, own_process=True, hop=1e-3, hop_token=1e-6)
    got = []
    host = ServerHost(costs, lambda seq, when, done: got.append((seq, when)))
    host.send(0.0, 0, 4000)  # (handled 0.5-1.5 ms; at the engine 1.5 + 1 + 4 ms)
    host.send(0.0, 1, 10)  # (handled 1.5-2.5 ms; would be at the engine at 3.51 ms)
    assert host.accepted(10.0) == [(pytest.approx(6.5e-3), 0), (pytest.approx(6.5e-3), 1)]
    with pytest.raises(ValueError, match="relay"):
        ServerCosts(1e-3, 0.0, passes, relay=1.5)
    relayed = ServerHost(ServerCosts(0.0, 0.0, passes, 5e-4, relay=0.4), lambda *a: got.append(a))
    got.clear()
    relayed.publish(1.0, [(seq, False) for seq in range(100)])
    relayed.drain(1.0)
    whole = 1e-2
    assert got[0][1] == pytest.approx(1.0 + 5e-4 + 0.4 * whole + 0.6 * whole / 100)
    assert got[-1][1] == pytest.approx(1.0 + 5e-4 + whole)


def test_the_hop_and_the_relay_are_fitted_on_the_calmest_workload():
    """Ways in and out (client's times) of workloads of known costs: the one sent at the
    lowest rate, whose requests seldom queue (a third of them still wait a little), gives the
    hop and the relay; bursts, whose requests queue for tens of milliseconds, do not."""
    shape = [(1, 0.0), (64, 0.0), (256, 0.0), (240, 24.0), (120, 1.5)]
    records, workloads = _served(shape)
    latency, hop, hop_token, relay = 4e-4, 9e-4, 4e-7, 0.35
    rng = random.Random(4)
    ingress, egress = [], []
    for requests, sent_over in shape:
        calm = sent_over == 24.0
        for _ in range(requests):
            tokens = rng.randint(16, 4000)
            way_in = latency + 1.4e-3 + 1.6e-6 * tokens + hop + hop_token * tokens
            if not calm or rng.random() < 0.3:
                way_in += rng.uniform(2e-3, 5e-2)  # (queued behind other work)
            ingress.append([tokens, way_in])
            n = rng.randint(2, 64) if requests > 1 else 1
            whole = n * 4e-5
            way_out = latency + (relay * whole + (1 - relay) * whole / n if n > 1 else whole)
            late = 0.0 if calm or requests == 1 else rng.uniform(1e-3, 1e-2)
            egress.append([n, way_out + late])
    server = {"workloads": workloads, "ingress": ingress, "egress": egress}
    server["engine_process"] = True
    costs = server_costs(records, server)
    assert costs.latency == pytest.approx(latency, rel=0.1)
    assert costs.hop == pytest.approx(hop, rel=0.1)
    assert costs.hop_token == pytest.approx(hop_token, rel=0.1)
    assert costs.relay == pytest.approx(relay, abs=0.05)
    # ways that do not say which workload they are from, or workloads all sent at once: no
    # hop, no relay (the bursts' samples queued); the latency of the lone first tokens
    for rows in ([w[:5] for w in workloads], [[*w[:5], 0.0] for w in workloads]):
        blind = server_costs(records, {**server, "workloads": rows})
        assert blind.hop == blind.hop_token == blind.relay == 0.0
        assert blind.latency == pytest.approx(latency, rel=0.1)
    # (a way out with no output counted, as a hand-edited profile may hold: left out)
    zero = server_costs(records, {**server, "egress": [[0, 1e-3]] * len(egress)})
    assert zero.relay == 0.0
    # an engine in the front's process has a request once the front handled it
    shared = server_costs(records, {**server, "engine_process": False})
    assert shared.hop == shared.hop_token == 0.0 and shared.relay == costs.relay


def test_a_host_scale_slows_every_host_cost_and_no_device_time():
    """``host_scale``: a host that many times as slow as the profiled one."""
    profile = synthetic_profile()
    costs = ServerCosts(1e-3, 1e-6, ((1, 1e-4), (64, 2e-3)), 5e-4, 0.03, hop=1e-3, relay=0.3)
    base = ProfiledCostModel(profile, frontend="offline")
    slow = ProfiledCostModel(profile, frontend="offline", host_scale=2.0)
    batch = BatchShape([(512, 0)], [300] * 8, 9)
    a, b = base.step_cost(batch), slow.step_cost(batch)
    for phase in ("schedule", "launch", "sample_host", "between"):
        assert getattr(b, phase) == pytest.approx(2 * getattr(a, phase)), phase
    assert (b.forward, b.sample) == (a.forward, a.sample)
    assert slow.resolve_cost(8, 1, 9) == pytest.approx([2 * x for x in base.resolve_cost(8, 1, 9)])
    assert slow.intake_cost(500) == pytest.approx(2 * base.intake_cost(500))
    scaled = costs.scaled(2.0)
    assert (scaled.request, scaled.hop, scaled.latency, scaled.relay) == (2e-3, 2e-3, 1e-3, 0.3)
    assert scaled.pass_seconds(32) == pytest.approx(2 * costs.pass_seconds(32))
    with pytest.raises(ValueError, match="host scale"):
        ProfiledCostModel(profile, frontend="offline", host_scale=0.0)
