"""nano-sim's fleet: replicas behind the server's router on one virtual clock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nano_scheduler import SchedulerConfig
from nano_scheduler.router import LeastTokens
from nano_scheduler.sim import (
    GPU,
    FleetSimulator,
    ModelShape,
    RooflineCostModel,
    Simulator,
    load_azure_trace,
    scale_arrivals,
    synthetic,
)
from nano_scheduler.sim.workload import Request

ROOT = Path(__file__).resolve().parents[3]
QWEN3_06B = ROOT / "benchmarks" / "configs" / "qwen3-0.6b.json"
TRACE = Path(__file__).parent / "data" / "azure_llm_2023_conv_head100.csv"
H200 = GPU("h200", 4.3e12, 790e12, 141e9)
CONFIG = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096)


def cost():
    return RooflineCostModel(ModelShape.from_hf_config(QWEN3_06B), H200, 1e-3)


def times(result):
    return sorted((r.request, r.first_token, r.finish, r.output_len) for r in result.requests)


def test_replicas_with_one_request_each_equal_independent_simulations():
    requests = [
        Request(0.0, 300, 40),
        Request(0.0, 1200, 7),
        Request(0.0, 50, 90),
        Request(0.0, 700, 1),
    ]
    fleet = FleetSimulator(requests, cost(), CONFIG, 512, replicas=4).run()
    assert fleet.routed == [1, 1, 1, 1]
    alone = []
    for i, request in enumerate(requests):
        (record,) = Simulator([request], cost(), CONFIG, 512).run().requests
        alone.append((i, record.first_token, record.finish, record.output_len))
    assert times(fleet) == alone


def test_one_replica_is_the_engine_alone():
    requests = scale_arrivals(load_azure_trace(TRACE), 20)
    alone = Simulator(requests, cost(), CONFIG, 2048).run()
    fleet = FleetSimulator(requests, cost(), CONFIG, 2048, replicas=1).run()
    assert times(fleet) == times(alone)
    assert fleet.num_steps == alone.num_steps


def test_two_replicas_serve_a_saturating_load_about_twice_as_fast():
    requests = synthetic(400, (100, 1000), (50, 300), rate=2000, seed=4)
    one = Simulator(requests, cost(), CONFIG, 2048).run().summary()
    two = FleetSimulator(requests, cost(), CONFIG, 2048, replicas=2).run()
    assert sorted(r.request for r in two.requests) == list(range(400))
    assert abs(two.routed[0] - two.routed[1]) < 40
    assert two.summary()["output_tok_per_s"] > 1.7 * one["output_tok_per_s"]
    assert len(two.replicas) == 2 and two.num_steps == sum(p.num_steps for p in two.replicas)


def test_the_prefix_aware_router_raises_the_prefix_cache_hit_rate():
    """30 system prompts of 512 tokens, caches of 800 blocks: spread evenly, each replica sees
    every prompt and keeps few; kept together, each sees its own."""
    requests = synthetic(
        600, (600, 800), (20, 40), rate=300, seed=2, num_prefixes=30, prefix_len=512
    )
    hit_rate = {
        router: FleetSimulator(requests, cost(), CONFIG, 800, replicas=3, router=router)
        .run()
        .prefix_hit_rate
        for router in ("round_robin", "least_tokens", "prefix_aware")
    }
    assert hit_rate["prefix_aware"] > 1.5 * max(hit_rate["round_robin"], hit_rate["least_tokens"])


def test_a_router_of_another_size_is_refused():
    with pytest.raises(ValueError, match="the router has 3 replicas, the fleet 2"):
        FleetSimulator([Request(0, 1, 1)], cost(), CONFIG, 64, replicas=2, router=LeastTokens(3))
    with pytest.raises(ValueError, match="replicas must be"):
        FleetSimulator([Request(0, 1, 1)], cost(), CONFIG, 64, replicas=0)


def nano_sim(*args):
    return subprocess.run(
        [sys.executable, "-m", "nano_scheduler.sim.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_finds_the_fewest_replicas_that_meet_an_slo():
    common = ["--model-config", QWEN3_06B, "--trace", TRACE, "--rate-scale", 400]
    proc = nano_sim(*common, "--slo-ttft-p99", 0.045, "--step-overhead-ms", 5)
    assert proc.returncode == 0, proc.stderr
    found = int(proc.stdout.split("fewest replicas with TTFT p99 <= 45 ms: ")[1].split()[0])
    assert found >= 2  # (one replica is too few at this rate)
    rows = {
        int(line.split()[0]): line.split()[-1]
        for line in proc.stdout.splitlines()
        if line.strip() and line.split()[0].isdigit() and line.split()[-1] in ("yes", "no")
    }
    assert rows[found] == "yes" and rows[found - 1] == "no"
    assert f"replicas            {found}, requests routed" in proc.stdout
    proc = nano_sim(*common, "--slo-tpot-p99", 1e-6, "--max-replicas", 2)
    assert proc.returncode == 1 and "even 2 replicas miss TPOT p99 <= 0.001 ms" in proc.stderr


def test_cli_fleet_options_are_checked():
    common = ["--model-config", QWEN3_06B, "--synthetic", 20]
    proc = nano_sim(*common, "--replicas", 2, "--router", "round_robin")
    assert proc.returncode == 0, proc.stderr
    assert "replicas            2, requests routed to each: 10, 10" in proc.stdout
    for bad, message in (
        (["--replicas", 0], "--replicas must be >= 1"),
        (["--replicas", 2, "--slo-ttft-p99", 1], "exclude each other"),
        (["--slo-ttft-p99", 0], "--slo-ttft-p99 must be > 0"),
    ):
        proc = nano_sim(*common, *bad)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
