"""nano-engine profile, the step log and the fidelity harness, for real on the CPU: a profile of
the tiny config that nano-sim loads and predicts from; the engine's own order of admission
against the simulator's; the harness's table for two scenarios and a what-if."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from nano_engine import LLM, SamplingParams
from nano_scheduler import SchedulerConfig
from nano_scheduler.sim import DeviceOnlyModel, Request, Simulator
from nano_scheduler.sim.profile import Profile, read_step_log
from nano_scheduler.sim.profiled import ProfiledCostModel

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "benchmarks" / "configs" / "tiny-qwen3.json"
ENGINE = ["--load-format", "dummy", "--max-model-len", "256", "--max-num-seqs", "8"]
ENGINE += ["--max-num-batched-tokens", "256"]

pytest.importorskip("fastapi")


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=False, timeout=timeout
    )


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    proc = run(
        "-m", "nano_engine.cli", "profile", str(TINY), *ENGINE, "--quick", "--out", str(path)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile written to" in proc.stdout and "eager model on its grid" in proc.stdout
    return path


def test_the_profile_holds_the_engine_and_what_was_measured(profile):
    p = Profile.load(profile)
    engine = p.engine
    assert (engine.block_size, engine.max_num_seqs, engine.max_num_batched_tokens) == (16, 8, 256)
    assert engine.max_model_len == 256 and engine.num_kv_blocks > 0 and engine.async_scheduling
    assert engine.cuda_graph_sizes == () and p.device["synchronous"]  # (the CPU: eager)
    assert p.model["hidden_size"] == 128 and p.model["num_hidden_layers"] == 4
    assert len(p.eager) >= 8 and all(g.seconds > 0 for g in p.eager)
    assert set(p.sampling) == {"greedy", "random", "top_p", "logprobs", "penalties"}
    assert set(p.host) == {"offline", "server"}
    served = [r for r in p.host["server"] if r.num_tokens]
    assert served and all(r.cpu is not None and r.server_cpu_at is not None for r in served)
    assert p.server["ingress"] and p.server["egress"] and p.server["workloads"]
    # (served as `serve` runs by default: the engine in a process of its own, whose step log
    # records the front process's CPU time in each iteration)
    assert p.server["engine_process"] is True
    fronts = [r.server_cpu_at for r in p.host["server"] if r.server_cpu_at is not None]
    assert fronts == sorted(fronts) and fronts[-1] > 0
    model = ProfiledCostModel(p, "server")
    costs = model.server_costs
    assert costs.pass_seconds(1) > 0 and costs.latency >= 0
    assert costs.own_process and costs.busy == 0 and not model._host.cpu
    # The way in beyond the front's handling: fitted on the calmest workload's ways in (the
    # profile says which they are), a part of their typical one at their own prompts' sizes
    # (on a loaded CPU the fit may put it all on the tokens).
    from nano_scheduler.sim.server_costs import _calmest

    calm = _calmest(p.server)[0]
    assert len(calm) >= 10
    hops = sorted(costs.hop + costs.hop_token * tokens for tokens, _ in calm)
    ways = sorted(seconds for _, seconds in calm)
    assert hops[len(hops) // 2] < ways[len(ways) // 2]


def test_nano_sim_predicts_from_it(profile, tmp_path):
    out = tmp_path / "sim.json"
    workload = ["--synthetic", "30", "--input-len", "10", "100", "--output-len", "4", "20"]
    for frontend in ("server", "offline"):
        proc = run(
            "-m",
            "nano_scheduler.sim.cli",
            *workload,
            "--rate",
            "20",
            "--profile",
            str(profile),
            "--frontend",
            frontend,
            "--json",
            str(out),
        )
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(out.read_text())["summary"]
        assert summary["requests"] == 30 and summary["output_tok_per_s"] > 0
        assert 0 < summary["ttft_s"]["p50"] < summary["e2e_s"]["p50"]


def test_the_engine_admits_a_request_as_the_simulator_does(profile):
    """On the CPU (a synchronous device) with async scheduling, a request that arrives while
    iteration i computes its step is first scheduled by iteration i + 1: in the engine's own
    step log, and in nano-sim's loop on the same clock."""
    with LLM(str(TINY), load_format="dummy", skip_tokenizer_init=True, max_model_len=256) as llm:
        engine = llm.engine
        recorder = engine.record_steps()
        first = engine.add_request([1] * 40, SamplingParams(max_tokens=60, ignore_eos=True))
        while len(recorder.steps) < 10:
            time.sleep(0.001)
        time.sleep(0.0137)  # (somewhere in an iteration)
        second = engine.add_request([2] * 40, SamplingParams(max_tokens=3, ignore_eos=True))
        for stream in (first, second):
            list(stream)
        engine.stop_recording()
    steps = recorder.steps
    timing = next(r for r in recorder.requests if r.id == second.request_id)
    starts = [s.t for s in steps]
    arrived = max(i for i, t in enumerate(starts) if t <= timing.arrival)
    scheduled = max(i for i, t in enumerate(starts) if t <= timing.first_scheduled)
    assert scheduled == arrived + 1

    # nano-sim's loop, each step computing as long as the engine's did: the request is first
    # scheduled by the first iteration that begins after it arrives.
    forwards = iter([s.forward for s in steps if s.num_tokens])

    class Replayed(DeviceOnlyModel):
        synchronous = True

        def step_time(self, batch):
            return next(forwards, 1e-3)

    requests = [Request(0.0, 40, 60), Request(timing.arrival - steps[0].t, 40, 3)]
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=16384, max_model_len=256)
    sim = Simulator(requests, Replayed(), config, num_blocks=1000)
    result = sim.run()
    late = next(r for r in result.requests if r.request == 1)
    starts = [0.0, *result.timeline.time]  # (an iteration begins when the one before ends)
    assert late.first_scheduled == min(t for t in starts if t >= late.arrival)


def test_sim_fidelity_harness_on_the_cpu(profile, tmp_path):
    """The harness end to end on a small configuration: servers with step logs, the trace
    replayed, nano-sim from the profile, the table."""
    out = tmp_path / "fidelity"
    proc = run(
        str(ROOT / "benchmarks" / "sim_fidelity.py"),
        str(TINY),
        "--out",
        str(out),
        "--profile",
        str(profile),
        "--limit",
        "30",
        "--max-len",
        "48",
        "--saturated-rate",
        "4",
        "--what-if-rate",
        "4",
        # (two of the three: a scenario is two servers, ~35 s of CI's CPU; the load differs
        # from the saturated one only in its rate and its requests, whose choice is tested
        # below)
        "--scenarios",
        "saturated,what-if",
        "--what-if",
        "--max-num-seqs 4 --max-num-batched-tokens 128",
        "--processes",
        "2",
        "--repeat",
        "2",
        "--",
        *ENGINE,
        "--skip-tokenizer-init",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "fidelity.json").read_text())
    assert [r["scenario"] for r in results] == ["saturated", "what-if"]
    for result in results:
        name = result["scenario"]
        rows = {row["metric"]: row for row in result["rows"]}
        assert set(rows) >= {"output tok/s", "TTFT p50", "TPOT p99", "ITL p50", "e2e p99"}
        assert all(row["engine"] > 0 and row["nano-sim"] > 0 for row in rows.values())
        # (the saturated run: 8 x max_num_seqs of the trace's requests, on both sides)
        requests = 64 if name == "saturated" else 30
        sim = json.loads((out / name / "nano-sim.json").read_text())
        assert len(sim["requests"]) == requests
        engine = json.loads((out / name / "engine.json").read_text())
        assert len(engine["requests"]) == requests
        # Each scenario served twice, each run in its own server: the engine's value is their
        # mean, the spread how far apart they lie.
        runs = [json.loads((out / d / "engine.json").read_text()) for d in (name, f"{name}-2")]
        for row, key in ((rows["output tok/s"], "output_tok_per_s"), (rows["TTFT p50"], "ttft_s")):
            measured = [r["summary"][key] for r in runs]
            measured = [m if key.startswith("output") else m["p50"] for m in measured]
            assert row["engine_runs"] == pytest.approx(measured)
            assert row["engine"] == pytest.approx(sum(measured) / 2)
            assert row["spread"] == pytest.approx(abs(measured[0] - measured[1]) / row["engine"])
        for d in (name, f"{name}-2"):
            log = read_step_log(out / d / "steps.jsonl")
            assert len(log.requests) == requests
            assert all(r.server_cpu_at is not None for r in log.steps)
        assert all(len(r["requests"]) == requests for r in runs)
        # The ways in and out of each request, the engine's from its step log joined with the
        # clients' times (one clock): positive, below the whole TTFT, on both sides.
        # Every request's way in and out, as the step log has every request.
        assert all(r["ingress"] > 0 and r["egress"] > 0 for run in runs for r in run["requests"])
        # The part at the front (the engine in a process of its own): the engine's only.
        ways = {row["metric"].split()[0] for row in result["relay"]}
        assert ways == {"in", "of", "out"}
        for row in result["relay"]:
            assert 0 < row["engine"] < rows["TTFT p99"]["engine"]
            if row["metric"].startswith("of it"):
                assert row["nano-sim"] is None  # (NaN in the JSON: null)
            else:
                assert row["nano-sim"] >= 0
        # Each run's host speed against the profile's (the CPU machine's is near 1, not far).
        assert len(result["host_ratio"]) == 2
        assert all(0.2 < x < 5 for x in result["host_ratio"])
        # and its device's (graphs / eager steps; a CPU runs no graph: null, NaN)
        assert all(len(pair) == 2 for pair in result["device_ratio"])
        assert all(x is None or 0.2 < x < 5 for pair in result["device_ratio"] for x in pair)
    assert "host time against the profile's prediction" in (out / "fidelity.md").read_text()
    assert "device's time against the profile's prediction" in (out / "fidelity.md").read_text()
    assert "the busiest one's CPU share" in (out / "fidelity.md").read_text()
    assert all(len(r["clients"]) == 2 for r in results)
    table = (out / "fidelity.md").read_text()
    assert table.startswith("| scenario | metric | engine | engine's runs apart | nano-sim |")
    assert "| what-if | in (sent -> the engine has it) p50 |" in table
    assert "metrics outside their targets" in proc.stdout


def test_the_harness_rates_follow_each_scenario_s_capacity():
    """The rates the harness serves: those given, else multiples of the capacity nano-sim
    predicts for each scenario's settings (the what-if's own) and requests (the saturated
    run's own, when it takes more), each pair asked once; a rate <= 0 or a capacity that is no
    positive number: an error that says which."""
    harness = _harness()
    asked = []

    def capacity_of(overrides, trace):
        asked.append((overrides, trace))
        return (20.0 if not overrides else 8.0) * (2 if trace.stem.endswith("saturated") else 1)

    what_if = ["--max-num-seqs", "64"]
    scenarios = ["load", "saturated", "what-if"]
    none = dict.fromkeys(scenarios)
    one = dict.fromkeys(scenarios, Path("trace.csv"))
    rates = harness.choose_rates(scenarios, none, what_if, capacity_of, one)
    assert rates == {"load": 12.0, "saturated": 60.0, "what-if": pytest.approx(4.8)}
    assert asked == [([], one["load"]), (what_if, one["what-if"])]
    asked.clear()
    given = {**none, "load": 5.0, "what-if": 2.0}
    assert harness.choose_rates(scenarios, given, what_if, capacity_of, one) == {
        "load": 5.0,
        "saturated": 60.0,
        "what-if": 2.0,
    }
    assert asked == [([], one["saturated"])]
    asked.clear()
    own = {**one, "saturated": Path("trace-saturated.csv")}
    rates = harness.choose_rates(scenarios, none, what_if, capacity_of, own)
    assert rates == {"load": 12.0, "saturated": 120.0, "what-if": pytest.approx(4.8)}
    assert asked == [([], one["load"]), ([], own["saturated"]), (what_if, one["what-if"])]
    with pytest.raises(ValueError, match="saturated scenario's rate must be > 0"):
        harness.choose_rates(scenarios, {**none, "saturated": 0.0}, what_if, capacity_of, one)
    for bad in (math.nan, None, 0.0):
        with pytest.raises(ValueError, match=r"--max-num-seqs 64.*--what-if-rate"):
            harness.choose_rates(["what-if"], none, what_if, lambda o, t, bad=bad: bad, one)


def test_the_saturated_scenario_takes_enough_requests_to_queue(profile, tmp_path):
    """Far above capacity the first max_num_seqs requests are admitted at once: the saturated
    run takes at least 8x max_num_seqs of them by default (the one the engine is given, else
    the profile's), the number given, or all; a negative count is an error before anything
    runs."""
    harness = _harness()
    assert Profile.load(profile).engine.max_num_seqs == 8
    assert harness.saturated_limit(30, None, [], profile) == 64
    assert harness.saturated_limit(700, None, ["--max-num-seqs", "256"], profile) == 2048
    assert harness.saturated_limit(700, None, ["--max-num-seqs=256"], profile) == 2048
    assert harness.saturated_limit(3000, None, ["--max-num-seqs", "256"], profile) == 3000
    assert harness.saturated_limit(30, None, ["--max-num-seqs", "2"], profile) == 30
    assert harness.saturated_limit(0, None, [], profile) == 0  # (the whole trace)
    assert harness.saturated_limit(700, 500, [], profile) == 500
    assert harness.saturated_limit(700, 0, [], profile) == 0
    # Every request may hold its stream open while it queues: the server is given room for
    # them all, open and queued, unless the options say otherwise.
    assert harness.serve_options(["--load-format", "dummy"], 2048) == [
        "--load-format",
        "dummy",
        "--max-connections",
        "2112",
        "--max-queue",
        "2112",
    ]
    assert harness.serve_options([], 30) == ["--max-connections", "94", "--max-queue", "94"]
    given = ["--max-connections", "50", "--max-queue=60"]
    assert harness.serve_options(given, 2048) == given
    assert harness.serve_options(given[:2], 2048) == [*given[:2], "--max-queue", "2112"]
    for flag, value, error in (
        ("--limit", "-1", "--limit: must be >= 0"),
        ("--saturated-limit", "-1", "--saturated-limit: must be >= 0"),
        ("--scenarios", "load,saturatd", "unknown scenarios ['saturatd']"),
    ):
        proc = run(
            str(ROOT / "benchmarks" / "sim_fidelity.py"),
            str(TINY),
            "--out",
            str(tmp_path),
            flag,
            value,
        )
        assert proc.returncode == 2 and error in proc.stderr
        assert not (tmp_path / "profile.json").exists()


def test_the_harness_judges_each_run_with_its_own_batch_limits():
    """A what-if run's host and device ratios are taken with the model of its settings (its
    CUDA graphs and piecewise sizes), read from the engine options both sides were given."""
    harness = _harness()
    options = ["--max-num-seqs", "64", "--enforce-eager", "--max-num-batched-tokens=4096"]
    assert harness.batch_limits(options) == {
        "max_num_seqs": 64,
        "max_num_batched_tokens": 4096,
    }
    assert harness.batch_limits(["--kv-cache-dtype", "fp8"]) == {}


def test_the_harness_says_when_its_clients_were_late():
    """A client that sent a request late by more than 10 ms stamped its stalls into the
    engine's latencies: the note says so, with each run's busiest client's share."""
    harness = _harness()
    calm = {"scenario": "load", "clients": [{"cpu_share": 0.3, "late_max_s": 0.009}]}
    late = {"scenario": "saturated", "clients": [{"cpu_share": 0.52, "late_max_s": 0.011}]}
    note = harness.client_note([calm])
    assert "load 30% (9 ms late)" in note and "Warning" not in note
    note = harness.client_note([calm, late])
    assert "saturated 52% (11 ms late)" in note and "late by more than 10 ms" in note
    assert harness.client_note([{"scenario": "load"}]) == ""


def test_the_harness_warns_of_a_host_or_device_that_ran_at_another_speed():
    """Ratios outside 0.85-1.15 (host) or 0.9-1.1 (device) are named in a warning with their
    span; one such ratio is said once."""
    harness = _harness()
    runs = [
        {"scenario": "load", "host_ratio": [0.92], "device_ratio": [[1.0, 1.04]]},
        {"scenario": "saturated", "host_ratio": [0.81], "device_ratio": [[0.99, 0.99]]},
    ]
    note = harness.host_note(runs)
    assert "load 0.92, saturated 0.81" in note and "(0.81x its time)" in note
    runs[0]["host_ratio"] = [1.27]
    assert "(0.81-1.27x its time)" in harness.host_note(runs)
    runs[0]["host_ratio"] = [math.nan]  # (no step to compare: no warning of its own)
    assert "(0.81x its time)" in harness.host_note(runs)
    runs[1]["host_ratio"] = [1.15]
    assert "Warning" not in harness.host_note(runs)
    note = harness.device_note(runs)
    assert "load 1.00 / 1.04" in note and "Warning" not in note
    runs[1]["device_ratio"] = [[1.2, math.nan]]
    assert "(1.20x its time)" in harness.device_note(runs)


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "sim_fidelity", ROOT / "benchmarks" / "sim_fidelity.py"
    )
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    return harness


def test_bench_serving_reports_nano_sims_fields(tmp_path):
    """The serving benchmark's JSON: nano-sim's summary keys (TPOT included) and one record
    per request, so the two compare field by field."""
    from server_helpers import ServerProcess

    server = ServerProcess(str(TINY), *ENGINE, "--skip-tokenizer-init")
    out = tmp_path / "serving.json"
    try:
        proc = run(
            str(ROOT / "benchmarks" / "bench_serving.py"),
            "--url",
            server.url,
            "--model",
            str(TINY),
            "--limit",
            "12",
            "--max-len",
            "32",
            "--rate-scale",
            "20",
            "--processes",
            "2",
            "--json",
            str(out),
            timeout=300,
        )
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    sim_keys = {"requests", "duration_s", "output_tok_per_s", "ttft_s", "tpot_s", "itl_s", "e2e_s"}
    assert sim_keys <= set(data["summary"]) and data["summary"]["failed"] == 0
    assert len(data["requests"]) == 12
    for record in data["requests"]:
        assert 0 < record["ttft"] <= record["e2e"] and record["output_len"] <= 32
        assert record["tpot"] is None or record["tpot"] > 0
