"""The simulator: determinism, completion, the roofline against an analytical bound, workloads,
the fitted cost model and the nano-sim command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nano_scheduler import SchedulerConfig
from nano_scheduler.sim import (
    GPU,
    BatchShape,
    DeviceOnlyModel,
    FittedCostModel,
    ModelShape,
    RooflineCostModel,
    Simulator,
    load_azure_trace,
    nano_vllm_bench,
    scale_arrivals,
    synthetic,
)

ROOT = Path(__file__).resolve().parents[3]
QWEN3_06B = ROOT / "benchmarks" / "configs" / "qwen3-0.6b.json"
TRACE = Path(__file__).parent / "data" / "azure_llm_2023_conv_head100.csv"
H200 = GPU("h200", 4.3e12, 790e12, 141e9)


class ZeroCost(DeviceOnlyModel):
    def step_time(self, batch: BatchShape) -> float:
        return 0.0


def simulate(requests, cost, num_blocks=4096, **config):
    config = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 4096, **config}
    return Simulator(requests, cost, SchedulerConfig(**config), num_blocks, 16).run()


def test_deterministic_for_a_seed():
    model = ModelShape.from_hf_config(QWEN3_06B)
    runs = [
        simulate(
            synthetic(200, (20, 300), (5, 100), rate=50, seed=seed, num_prefixes=4, prefix_len=16),
            RooflineCostModel(model, H200, 1e-3),
        ).summary()
        for seed in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_with_a_zero_cost_model_every_request_finishes():
    requests = synthetic(300, (1, 200), (1, 50), seed=3)  # all at t=0
    result = simulate(requests, ZeroCost(), num_blocks=64)  # a small pool: preemptions happen
    assert len(result.requests) == 300 and not result.rejected
    by_index = sorted(result.requests, key=lambda r: r.request)
    assert [r.output_len for r in by_index] == [q.output_len for q in requests]
    assert all(r.finish_reason == "length" for r in result.requests)
    assert result.num_preemptions > 0


def analytical_bound(requests, model: ModelShape, gpu: GPU) -> float:
    """The lower bound the roofline should approach on nano-vllm's benchmark.

    All requests arrive at t=0 and fit in one batch, so decoding is a sequence of steps, one per
    output token of the longest request. A request with I prompt and O output tokens samples its
    first token after its prefill and decodes the other O - 1, the k-th attending I + k tokens:
      KV reads  = kv_bytes_per_token * sum over requests of ((O - 1) I + (O - 1) O / 2)
      weights   = weight_bytes * (max O - 1), read once per decode step
      prefill   = flops_per_token * sum of I, compute-bound
    For Qwen3-0.6B (114,688 KV bytes per token, 1.19 GB of weights, 0.88 GFLOP per token) on
    an H200 at 4.3 TB/s and 790 TFLOP/s: about 13.9 TB / 4.3 TB/s = 3.22 s of KV reads,
    0.28 s of weights and 0.16 s of prefill, 3.7 s in all.
    """
    kv = (
        sum(
            (r.output_len - 1) * r.prompt_len + (r.output_len - 1) * r.output_len / 2
            for r in requests
        )
        * model.kv_bytes_per_token
    )
    weights = model.weight_bytes * (max(r.output_len for r in requests) - 1)
    prefill = sum(r.prompt_len for r in requests) * model.flops_per_token
    return (kv + weights) / gpu.mem_bandwidth + prefill / gpu.flops


def test_roofline_on_nano_vllms_benchmark_is_near_the_analytical_bound():
    requests = nano_vllm_bench()
    assert len(requests) == 256 and sum(r.output_len for r in requests) == 133_966
    model = ModelShape.from_hf_config(QWEN3_06B)
    assert model.kv_bytes_per_token == 114_688
    bound = analytical_bound(requests, model, H200)
    assert 3.5 < bound < 3.9
    result = simulate(
        requests,
        RooflineCostModel(model, H200),
        num_blocks=68_000,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        max_model_len=40960,
    )
    assert result.summary()["output_tokens"] == 133_966
    assert abs(result.duration - bound) / bound < 0.10, (result.duration, bound)


def test_roofline_decode_step_is_bandwidth_bound():
    model = ModelShape.from_hf_config(QWEN3_06B)
    cost = RooflineCostModel(model, H200, step_overhead=0.001)
    batch = BatchShape([], [1000] * 256, 256)
    expected = (model.weight_bytes + (256 * 1000 + 256) * model.kv_bytes_per_token) / 4.3e12 + 0.001
    assert cost.step_time(batch) == pytest.approx(expected)
    prefill = BatchShape([(8192, 0)], [], 1)
    flops = 8192 * model.flops_per_token + model.lm_head_flops
    flops += (8192 * 8193 // 2) * model.attention_flops_per_pair
    assert cost.step_time(prefill) == pytest.approx(flops / 790e12 + 0.001)


def test_model_shape_from_config_errors():
    with pytest.raises(ValueError, match="lacks 'num_attention_heads'"):
        ModelShape.from_hf_config({"hidden_size": 8})


def test_shared_prefixes_make_prefix_caching_matter():
    requests = synthetic(100, (200, 300), (5, 10), rate=20, seed=0, num_prefixes=2, prefix_len=192)
    on = Simulator(requests, ZeroCost(), SchedulerConfig(), 4096, 16).run()
    off = Simulator(requests, ZeroCost(), SchedulerConfig(), 4096, 16, False).run()
    assert on.prefix_hit_rate > 0.5 and off.prefix_hit_rate == 0.0


def test_azure_trace_loading_and_rate_scaling():
    requests = load_azure_trace(TRACE)
    assert len(requests) == 100 and requests[0].arrival_time == 0.0
    assert len(load_azure_trace(TRACE, limit=10)) == 10
    assert requests[1].arrival_time == pytest.approx(4.314578)  # 18:15:50.9951690 - 46.6805900
    assert (requests[0].prompt_len, requests[0].output_len) == (374, 44)
    faster = scale_arrivals(requests, 2.0)
    assert faster[1].arrival_time == pytest.approx(requests[1].arrival_time / 2)


def test_the_2024_trace_timestamps_with_a_utc_offset(tmp_path):
    trace = tmp_path / "az2024.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,5,5\n2024-05-10 00:00:01.509930+00:00,6,6\n"
    )
    requests = load_azure_trace(trace)
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, 1.5])


def test_azure_trace_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_azure_trace(bad)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_azure_trace(TRACE, limit=0)
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n0,5,5\n"
    for row, message in [
        ("nan,5,5", "nan.csv:3: TIMESTAMP 'nan' is neither"),  # (it would stall the clock)
        ("-4,5,5", "nan.csv:3: TIMESTAMP '-4' is neither"),
        ("2023-13-45 10:00:00,5,5", "TIMESTAMP '2023-13-45 10:00:00' is neither"),
        ("1,-5,5", "nan.csv:3: ContextTokens must be >= 0, got -5"),
        ("1,5,five", "nan.csv:3: GeneratedTokens must be a whole number of tokens, got 'five'"),
        ("1,5.5,5", "ContextTokens must be a whole number"),
        ("1,5", "GeneratedTokens must be a whole number of tokens, got ''"),
    ]:
        bad = tmp_path / "nan.csv"
        bad.write_text(header + row + "\n")
        with pytest.raises(ValueError, match=message):
            load_azure_trace(bad)


def test_workload_validation():
    with pytest.raises(ValueError, match="input_len"):
        synthetic(10, (0, 5))
    with pytest.raises(ValueError, match="rate"):
        synthetic(10, rate=0)
    with pytest.raises(ValueError, match="prefix_len"):
        synthetic(10, (10, 20), num_prefixes=2, prefix_len=11)


def test_fitted_cost_model_recovers_known_coefficients(tmp_path):
    truth = {
        "const": 2e-3,
        "tokens": 3e-6,
        "seqs": 1e-5,
        "prefill_attention": 1e-10,
        "decode_context": 2e-8,
    }
    model = FittedCostModel(truth)
    batches = [
        BatchShape([(n, s)] * (i % 3), [c] * (i % 7 * 9), i % 3 + i % 7 * 9)
        for i, (n, s, c) in enumerate(
            (n, s, c) for n in (16, 512, 2048) for s in (0, 300) for c in (100, 900, 4000)
        )
    ]
    samples = [
        {
            "prefills": b.prefills,
            "decodes": b.decodes,
            "num_sampled": b.num_sampled,
            "seconds": model.step_time(b),
        }
        for b in batches
    ]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"samples": samples}))
    fitted = FittedCostModel.from_json(path)
    for name, value in truth.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-4), name
    fitted.to_json(tmp_path / "coef.json")
    again = FittedCostModel.from_json(tmp_path / "coef.json")
    assert again.coefficients == fitted.coefficients
    with pytest.raises(ValueError, match="unknown cost features"):
        FittedCostModel({"flux": 1.0})


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "nano_scheduler.sim.cli", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_cli_runs_a_synthetic_workload(tmp_path):
    out = tmp_path / "sim.json"
    proc = run_cli(
        "--synthetic",
        "50",
        "--input-len",
        "10",
        "100",
        "--output-len",
        "5",
        "20",
        "--rate",
        "20",
        "--model-config",
        str(QWEN3_06B),
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "output tok/s" in proc.stdout and "TTFT (ms)" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["requests"] == 50 and summary["rejected"] == 0


def test_cli_reports_bad_input():
    proc = run_cli("--synthetic", "5", "--model-config", "/nonexistent/config.json")
    assert proc.returncode == 2 and "nano-sim: error" in proc.stderr
    proc = run_cli("--synthetic", "5", "--model-config", str(QWEN3_06B), "--gpu", "tpu")
    assert proc.returncode == 2 and "unknown GPU 'tpu'" in proc.stderr
    model = ("--model-config", str(QWEN3_06B))
    for args, message in [
        (("--synthetic", "5", "--step-overhead-ms", "-10"), "--step-overhead-ms must be >= 0"),
        (("--synthetic", "5", "--bandwidth", "0"), "--bandwidth must be > 0"),
        (("--synthetic", "5", "--block-size", "0"), "--block-size must be >= 1"),
        (("--nano-vllm-bench", "--rate", "3"), "--rate would be ignored with --nano-vllm-bench"),
        (("--trace", str(TRACE), "--input-len", "5", "9"), "--input-len would be ignored with"),
        (("--synthetic", "5", "--limit", "3"), "--limit would be ignored with --synthetic"),
        (
            ("--synthetic", "5", "--fitted", "x.json", "--step-overhead-ms", "2"),
            "--step-overhead-ms would be ignored with --fitted",
        ),
    ]:
        proc = run_cli(*args, *model)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_json_has_null_where_a_metric_has_no_value(tmp_path):
    """One output token per request: no inter-token latency (NaN is not JSON)."""
    out = tmp_path / "sim.json"
    args = ("--synthetic", "5", "--input-len", "10", "20", "--output-len", "1", "1")
    proc = run_cli(*args, "--model-config", str(QWEN3_06B), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    json.loads(out.read_text(), parse_constant=pytest.fail)
    assert "null" in out.read_text()


def test_records_and_rejections_name_requests_by_their_index_in_the_workload():
    from nano_scheduler.sim import Request

    requests = [Request(5.0, 10, 3), Request(0.0, 5000, 7), Request(1.0, 20, 2)]
    result = simulate(requests, ZeroCost(), max_model_len=1024)
    assert [i for i, _ in result.rejected] == [1]
    assert {r.request: r.prompt_len for r in result.requests} == {0: 10, 2: 20}


def test_fitting_needs_steps_that_determine_every_coefficient():
    model = FittedCostModel({"const": 2e-3, "tokens": 3e-6, "seqs": 1e-5, "decode_context": 2e-8})
    decodes = [BatchShape([], [c] * n, n) for n in (1, 8, 64) for c in (100, 900, 4000)]
    with pytest.raises(ValueError, match="do not determine the cost model"):
        FittedCostModel.fit([(b, model.step_time(b)) for b in decodes])


def test_bad_samples_are_named(tmp_path):
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"samples": [{"prefills": [], "decodes": [5]}]}))
    with pytest.raises(ValueError, match=r"sample 0 needs .* seconds"):
        FittedCostModel.from_json(path)


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    result = simulate(synthetic(30, (10, 50), (5, 20), rate=50, seed=1), ZeroCost())
    result.plot(tmp_path / "sim.png")
    assert (tmp_path / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_mixture_of_experts_reads_the_experts_its_tokens_choose():
    """Qwen3-30B-A3B's shape, counted by hand: 61 GB of weights, of which a step reads the
    touched experts' (uniform routing: E (1 - (1 - k / E)^tokens) of each sparse layer)."""
    path = Path(__file__).resolve().parents[3] / "benchmarks/configs/qwen3-30b-a3b.json"
    m = ModelShape.from_hf_config(path)
    h, e, k, i, layers = 2048, 128, 8, 768, 48
    attention = h * (32 + 2 * 4) * 128 + 32 * 128 * h
    expert = 3 * h * i
    total = layers * (attention + e * (h + expert)) + 2 * 151936 * h + (2 * layers + 1) * h
    assert m.sparse_layers == layers and m.weight_bytes == 2 * total
    assert m.flops_per_token == 2 * layers * (attention + e * h + k * expert)
    assert m.experts_touched(1) == pytest.approx(k)
    assert m.experts_touched(10_000) == pytest.approx(e)
    one = m.weight_bytes - 2 * layers * (e - k) * expert
    assert m.weight_bytes_read(1) == pytest.approx(one)
    assert one < m.weight_bytes_read(32) < m.weight_bytes_read(256) <= m.weight_bytes
    # a dense layer in mlp_only_layers, and a dense model, read all of their weights
    config = json.loads(path.read_text()) | {"mlp_only_layers": [0, 5]}
    assert ModelShape.from_hf_config(config).sparse_layers == layers - 2
    dense = ModelShape.from_hf_config(Path(path).with_name("qwen3-8b.json"))
    assert dense.weight_bytes_read(1) == dense.weight_bytes


def test_an_fp8_kv_cache_halves_the_bytes_a_token_keeps_and_reads():
    import dataclasses

    model = ModelShape.from_hf_config(QWEN3_06B)
    fp8 = dataclasses.replace(model, kv_dtype_bytes=1)
    assert fp8.kv_bytes_per_token * 2 == model.kv_bytes_per_token
    batch = BatchShape([], [4000] * 64, 64)
    bf16_step = RooflineCostModel(model, H200).step_time(batch)
    fp8_step = RooflineCostModel(fp8, H200).step_time(batch)
    assert 0.45 < fp8_step / bf16_step < 0.75  # (the KV reads halve; the weights do not)
    proc = subprocess.run(
        [sys.executable, "-m", "nano_scheduler.sim.cli", "--synthetic", "20",
         "--model-config", str(QWEN3_06B), "--kv-cache-dtype", "fp8"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "137010 KV blocks" in proc.stdout, proc.stderr
