"""Data parallelism on the CPU: two replicas of a tiny model as processes of this host (mp) and
as Ray actors of a local Ray cluster, behind LLM and behind the server. The same tokens as one
engine, load spread by the router, a prefix kept on one replica, a killed replica's requests
ended with a clear error (or sent once to the other), nothing left behind at shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from engine_helpers import sample_prompts
from server_helpers import ServerProcess, vllm_metric

from nano_engine import LLM, EngineConfig, EngineDeadError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)
SEEDED = SamplingParams(temperature=0.9, top_k=20, max_tokens=12, n=2, seed=7)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
OPTIONS = {"kvcache_block_size": 4, "device": "cpu", "max_model_len": 512}


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(checkpoints):
    """One engine's greedy and seeded tokens of the shared prompts, and its greedy texts."""
    with LLM(checkpoints("qwen3"), **OPTIONS) as llm:
        prompts = sample_prompts()
        greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
        return (
            tokens(greedy),
            tokens(llm.generate(prompts, SEEDED, use_tqdm=False)),
            [o.outputs[0].text for o in greedy],
        )


def fleet(checkpoints, backend: str = "mp", **options) -> LLM:
    return LLM(
        checkpoints("qwen3"),
        data_parallel_size=2,
        data_parallel_backend=backend,
        **{**OPTIONS, **options},
    )


def exited(pids: list[int], timeout: float = 10.0) -> bool:
    """Whether every process of ``pids`` is gone (or a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_mp_replicas_give_one_engines_tokens_and_share_the_load(checkpoints, reference):
    with fleet(checkpoints) as llm:
        engine = llm.engine
        prompts = sample_prompts()
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference[0]
        assert tokens(llm.generate(prompts, SEEDED, use_tqdm=False)) == reference[1]
        assert min(engine.routed) >= 6 and sum(engine.routed) == 16
        # Requests of one size: in turn (the fewest outstanding tokens).
        before = list(engine.routed)
        llm.generate([[i + 3] * 10 for i in range(8)], GREEDY, use_tqdm=False)
        assert [a - b for a, b in zip(engine.routed, before)] == [4, 4]
        stats = engine.replica_stats()
        assert [s.serving for s in stats] == [True, True]
        assert sum(s.prefix_queries for s in stats) > 0
        assert engine.router.outstanding == [0, 0]
        # A streamed request, aborted: the replica ends it (finish_reason abort).
        stream = engine.add_request(prompts[0], LONG)
        assert stream.get(timeout=60) is not None
        engine.abort(stream.request_id)
        assert list(stream)[-1].outputs[0].finish_reason == "abort"
        pids = [r.info.pid for r in engine.replicas]
    assert exited(pids)
    assert not any(p.name.startswith("nano-engine-dp") for p in _children())


def _children():
    import multiprocessing

    return multiprocessing.active_children()


def test_prefix_aware_routing_keeps_a_prefix_on_one_replica(checkpoints):
    system = list(range(10, 50))  # ten blocks of four tokens
    with fleet(checkpoints, router="prefix_aware") as llm:
        engine = llm.engine
        replicas = set()
        for i in range(6):
            stream = engine.add_request([*system, 60 + i, 61], GREEDY)
            list(stream)
            replicas.add(stream.engine_index)
        assert len(replicas) == 1
        (kept,) = replicas
        stats = engine.replica_stats()
        assert stats[kept].prefix_hits >= 5 * len(system)  # (the five after the first)
        # While the replica with the prefix is busy, another prompt goes to the other one.
        busy = engine.add_request([*system, 99], LONG)
        other = engine.add_request(list(range(200, 240)), GREEDY)
        list(other)
        assert (busy.engine_index, other.engine_index) == (kept, 1 - kept)
        engine.abort(busy.request_id)


def test_a_killed_replica_ends_its_streams_and_the_other_serves_on(checkpoints, reference):
    prompts = sample_prompts()
    with fleet(checkpoints, router="round_robin") as llm:
        engine = llm.engine
        streamed = engine.add_request(prompts[0], LONG)  # replica 0
        filler = engine.add_request(prompts[1], GREEDY)  # replica 1
        # Replica 0 again, its output in one piece at the end: nothing streamed until then.
        whole = engine.make_request(prompts[2], GREEDY, stream_deltas=False)
        engine.submit([whole])
        assert (streamed.engine_index, filler.engine_index, whole.stream.engine_index) == (0, 1, 0)
        assert streamed.get(timeout=60) is not None
        victim = engine.replicas[0].info.pid
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"replica 0 stopped .*1 of 2 replicas serve"):
            list(streamed)
        assert time.monotonic() - start < 5
        # The unstreamed request went to replica 1 and finished there, as one engine has it.
        (out,) = list(whole.stream)
        assert out.finished and [c.token_ids for c in out.outputs] == reference[0][2]
        assert whole.stream.engine_index == 1 and engine.retries == 1
        list(filler)
        assert engine.alive and [s.serving for s in engine.replica_stats()] == [False, True]
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference[0]
        os.kill(engine.replicas[1].info.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.alive
        with pytest.raises(EngineDeadError, match=r"no replica serves: replica 0: .*replica 1: "):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)


def test_a_replica_that_cannot_start_is_named_and_nothing_is_left(checkpoints):
    start = time.monotonic()
    # (a user's error, as one engine would raise it, naming the replica)
    with pytest.raises(ValueError, match=r"data-parallel replica \d did not start: the KV cache"):
        fleet(checkpoints, num_kvcache_blocks=2)  # (fewer blocks than one sequence needs)
    assert time.monotonic() - start < 60
    assert not any(p.name.startswith("nano-engine-dp") for p in _children())


def test_data_parallel_options_are_checked(checkpoints):
    path = checkpoints("qwen3")
    for bad, message in (
        ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1"),
        ({"data_parallel_backend": "threads"}, "data_parallel_backend must be one of"),
        ({"router": "random"}, "router must be one of"),
        (
            {"data_parallel_backend": "mp", "data_parallel_address": "auto"},
            "data_parallel_address is a Ray cluster's",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_kwargs(path, **bad)


def test_the_fleet_routes_with_the_simulators_router():
    from nano_engine.data_parallel import fleet as served
    from nano_scheduler.sim import fleet as simulated

    assert served.make_router is simulated.make_router
    assert served.request_cost is simulated.request_cost


# ---- Ray ---------------------------------------------------------------------------------


def _ray_processes() -> list[int]:
    """This machine's Ray processes (workers, raylet, GCS)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ray = (b"ray::", b"/ray/core/src/ray/raylet", b"gcs_server")
        if any(name in cmdline for name in ray) and not _gone(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_ray_replicas_serve_survive_a_killed_actor_and_leave_nothing(checkpoints, reference):
    ray = pytest.importorskip("ray")  # (nano-engine[ray]; CI installs it)
    assert not ray.is_initialized()
    prompts = sample_prompts()
    with fleet(checkpoints, "ray") as llm:
        engine = llm.engine
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference[0]
        assert tokens(llm.generate(prompts, SEEDED, use_tqdm=False)) == reference[1]
        assert min(engine.routed) >= 6 and sum(engine.routed) == 16
        hosts = {r.info.pid for r in engine.replicas}
        assert len(hosts) == 2 and os.getpid() not in hosts
        stream = engine.add_request(prompts[0], LONG)
        assert stream.get(timeout=60) is not None
        victim = stream.engine_index
        os.kill(engine.replicas[victim].info.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            EngineDeadError, match=rf"replica {victim} stopped .*the Ray actor died"
        ):
            list(stream)
        assert time.monotonic() - start < 5
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference[0]
        assert [s.serving for s in engine.replica_stats()].count(True) == 1
    assert not ray.is_initialized()
    deadline = time.monotonic() + 20
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ray_processes() == []


def test_an_output_travels_whole():
    """What a replica sends (its outputs as tuples, pickled) is the output the front rebuilds:
    every field of every completion, logprobs and prompt logprobs included; the prompt comes
    from the front. A request's outputs queued together travel merged, as ``merge_outputs``
    merges them."""
    import dataclasses
    import pickle

    from nano_engine.data_parallel.replica import from_wire, merge_wire
    from nano_engine.llm import merge_outputs
    from nano_engine.outputs import CompletionOutput, Logprob, RequestOutput

    def wire(out: RequestOutput, span=None) -> tuple:  # (the fields in their order)
        completions = [
            (o.index, o.text, o.token_ids, o.finish_reason, o.logprobs, o.stop_reason)
            for o in out.outputs
        ]
        return (
            out.request_id,
            out.finished,
            out.num_cached_tokens,
            completions,
            out.prompt_logprobs,
            span,
        )

    lp = [Logprob.of(7, -0.25, [7, 9], [-0.25, -1.5], rank=1)]
    out = RequestOutput(
        "r-1",
        None,
        [],
        [
            CompletionOutput(0, "ab", [7], "stop", lp, "</s>"),
            CompletionOutput(1, "c", [9, 4], None, None, None),
        ],
        finished=True,
        num_cached_tokens=32,
        prompt_logprobs=[None, *lp],
    )
    back = from_wire(pickle.loads(pickle.dumps(wire(out, 0.5))), "the prompt", [5, 6])
    assert back == dataclasses.replace(out, prompt="the prompt", prompt_token_ids=[5, 6])

    first = RequestOutput(
        "r-1",
        None,
        [],
        [CompletionOutput(1, "x", [3], None, None, None)],
        num_cached_tokens=16,
        prompt_logprobs=[None, *lp],
    )
    second = RequestOutput("r-1", None, [], [CompletionOutput(0, "y", [8], None, lp, None)])
    later = dataclasses.replace(out, num_cached_tokens=0, prompt_logprobs=None)
    deltas = [wire(first, 0.1), wire(second, 0.2), wire(later, 0.5)]
    sent = pickle.dumps(deltas)
    merged = merge_wire(merge_wire(deltas[0], deltas[1]), deltas[2])
    assert pickle.dumps(deltas) == sent  # (its inputs untouched)
    assert merged[-1] == 0.5  # (the latest span)
    expected = merge_outputs(merge_outputs(merge_outputs(None, first), second), later)
    assert expected.num_cached_tokens == 16 and expected.prompt_logprobs == [None, *lp]
    assert from_wire(merged, None, []) == dataclasses.replace(expected, metrics={})


# ---- the server --------------------------------------------------------------------------


def _replica_pids(server: ServerProcess) -> list[int]:
    """The server's replica processes (spawned by multiprocessing, not its resource tracker)."""
    out = subprocess.run(
        ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server.proc.pid)],
        capture_output=True,
        text=True,
        check=False,  # (ps exits 1 when the server has no child)
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]


def _kill_the_last(server: ServerProcess, pid: int, client: openai.OpenAI, prompt) -> None:
    """Kill the last engine process that serves: /health says 503 within seconds, and so
    does a request."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if httpx.get(f"{server.url}/health", timeout=5).status_code == 503:
            break
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    with pytest.raises(openai.APIStatusError) as error:
        client.completions.create(model=server.model, prompt=prompt, max_tokens=4)
    assert error.value.status_code == 503


def test_the_server_over_two_replicas(checkpoints, reference):
    path = checkpoints("qwen3")
    server = ServerProcess(
        path,
        "--data-parallel-size=2",
        "--data-parallel-backend=mp",
        "--max-model-len=512",
        "--block-size=4",
        "--device=cpu",
    )
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        prompts = sample_prompts()
        for prompt, expected, text in zip(prompts, reference[0], reference[2]):
            reply = client.completions.create(
                model=path, prompt=prompt, max_tokens=12, temperature=0
            )
            assert reply.choices[0].text == text
            assert reply.usage.completion_tokens == len(expected[0])
        m = server.metrics()
        generated = [m[vllm_metric("generation_tokens_total", path, engine=e)] for e in "01"]
        assert sum(generated) == sum(len(e[0]) for e in reference[0])
        assert all(g > 0 for g in generated)
        serving = [m[f"nano_engine:engine_serving{{engine={e},model_name={path}}}"] for e in "01"]
        assert serving == [1, 1]
        # One replica killed: the server serves on with the other and says so.
        pids = _replica_pids(server)
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            m = server.metrics()
            if m[f"nano_engine:engine_serving{{engine=0,model_name={path}}}"] == 0:
                break
            time.sleep(0.1)
        assert m[f"nano_engine:engine_serving{{engine=0,model_name={path}}}"] == 0
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        for prompt in prompts[:3]:
            reply = client.completions.create(model=path, prompt=prompt, max_tokens=4)
            assert reply.choices[0].text is not None
        assert "replica 0 (pid" in server.output() and "1 of 2 replicas serve" in server.output()
        _kill_the_last(server, pids[1], client, prompts[0])
    finally:
        server.stop()
    assert exited(pids)


def test_the_server_runs_its_engine_in_a_process_of_its_own(checkpoints, reference):
    """By default the engine is a process of the server's (the front streams, the engine's
    process steps); ``--disable-frontend-multiprocessing`` keeps it in the server's process.
    The same tokens either way; a killed engine process is seen at once."""
    path = checkpoints("qwen3")
    options = ("-v", "--max-model-len=512", "--block-size=4", "--device=cpu")
    prompts = sample_prompts()[:3]
    for flags in ((), ("--disable-frontend-multiprocessing",)):
        server = ServerProcess(path, *options, *flags)
        try:
            engines = _replica_pids(server)
            assert len(engines) == (0 if flags else 1)
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            for prompt, text in zip(prompts, reference[2]):
                stream = client.completions.create(
                    model=path, prompt=prompt, max_tokens=12, temperature=0, stream=True
                )
                assert "".join(chunk.choices[0].text for chunk in stream) == text
            assert "rank 0: loaded" in server.output()  # (-v reaches the engine's process)
            if flags:
                assert "own process" not in server.output()
                continue
            assert f"the engine runs in its own process: replica 0 (pid {engines[0]}" in (
                server.output()
            )
            _kill_the_last(server, engines[0], client, prompts[0])
            assert f"replica 0 (pid {engines[0]}" in server.output()  # (why, in the log)
        finally:
            server.stop()


def test_a_setting_the_engine_refuses_is_one_clear_line(checkpoints):
    """A user's error found while the engine's process starts reads as it would in one
    process: one line naming the flag, exit status 2, no traceback; and nothing is left."""
    import sys

    from nano_engine.parallel import free_port

    path = checkpoints("qwen3")
    command = [sys.executable, "-m", "nano_engine.cli", "serve", path, "--port", str(free_port())]
    command += ["--max-model-len=512", "--block-size=4", "--device=cpu", "--num-kvcache-blocks=1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith("nano-engine: error:") and "--num-kvcache-blocks" in errors[-1]
    assert "Traceback" not in done.stderr
