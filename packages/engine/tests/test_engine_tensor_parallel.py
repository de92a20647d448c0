"""Tensor parallelism 2 on the CPU (gloo, a real worker process): the same greedy tokens as one
process; a killed worker makes the engine raise within seconds instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest
from engine_helpers import failing_at, sample_prompts

from nano_engine import LLM, EngineDeadError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def test_tp2_gives_the_tokens_of_tp1_and_a_dead_worker_is_reported(checkpoints):
    path = checkpoints("qwen3")
    with LLM(path, kvcache_block_size=4, device="cpu") as llm:
        expected = [
            o.outputs[0].token_ids for o in llm.generate(sample_prompts(), GREEDY, use_tqdm=False)
        ]
    with LLM(path, kvcache_block_size=4, device="cpu", tensor_parallel_size=2) as llm:
        outputs = llm.generate(sample_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        worker = llm.engine.workers.procs[0]
        stream = llm.engine.add_request(
            sample_prompts()[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        )
        assert stream.get(timeout=60) is not None
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel worker 1 \(pid \d+\) exited"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):
            llm.generate("more", GREEDY, use_tqdm=False)


@pytest.mark.parametrize("pool", ["large", "preempting"])
def test_tp2_async_scheduling_broadcasts_the_sampled_tokens(checkpoints, pool):
    """With async scheduling each step's inputs include tokens still being sampled; the worker
    gets them from rank 0's broadcast. Seeded sampling, prompts in chunks, and a pool so small
    that sequences are preempted (a re-prefill then ends in a pending token): the tokens of one
    process, with async scheduling on and off."""
    path = checkpoints("qwen3")
    params = [
        SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=3, max_tokens=14, n=2, ignore_eos=True),
    ]
    prompts = sample_prompts()[:3]
    options = {"kvcache_block_size": 4, "device": "cpu", "max_num_batched_tokens": 16}
    if pool == "preempting":  # (here about 9 preemptions, one re-prefill ending pending)
        options |= {"num_kvcache_blocks": 16, "max_model_len": 64}
        prompts = sample_prompts()
        params = [
            SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True)
            for i in range(8)
        ]

    def tokens(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert (llm.engine.scheduler.num_preemptions > 0) == (pool == "preempting")
        return [[c.token_ids for c in o.outputs] for o in outputs]

    with LLM(path, **options) as llm:
        expected = tokens(llm)
    for async_scheduling in (True, False):
        with LLM(path, tensor_parallel_size=2, async_scheduling=async_scheduling, **options) as llm:
            assert llm.engine.async_scheduling is async_scheduling
            assert tokens(llm) == expected


def test_tp2_async_a_failure_on_rank0_after_a_launch_leaves_no_worker_waiting(checkpoints):
    """The sampler fails on rank 0 with a step in flight whose tokens the next step needs: the
    engine reports it, and the worker, waiting for its next step (not in a broadcast), stops
    cleanly at shutdown."""
    path = checkpoints("qwen3")
    with LLM(path, kvcache_block_size=4, device="cpu", tensor_parallel_size=2) as llm:
        engine = llm.engine
        engine.sampler.sample = failing_at(engine.sampler.sample, 5, "injected sampler failure")
        with pytest.raises(EngineDeadError, match="injected sampler failure"):
            llm.generate(sample_prompts(), GREEDY, use_tqdm=False)
        assert not engine._apart  # (the step was launched: the worker is not left behind)
        workers = engine.workers.procs
        start = time.monotonic()
    assert time.monotonic() - start < 5
    assert [p.exitcode for p in workers] == [0]


def test_tp2_a_failure_on_rank0_mid_step_stops_the_worker_left_in_a_collective(checkpoints):
    """Rank 0 fails after sending a step, before its own forward: the worker waits in the
    forward's first all-reduce for a rank that will never come. The engine reports the error,
    knows that the ranks are apart (with NCCL it then aborts the group and terminates the
    worker: the GPU test; here gloo's all-reduce fails once rank 0 destroys its group), shuts
    down within seconds, and leaves no process group behind: the next engine of this process
    starts."""
    import torch.distributed as dist

    path = checkpoints("qwen3")
    options = {"kvcache_block_size": 4, "device": "cpu", "tensor_parallel_size": 2}
    llm = LLM(path, **options)
    engine = llm.engine
    engine.runner.execute = failing_at(engine.runner.execute, 5, "injected forward failure")
    workers = engine.workers.procs
    with pytest.raises(EngineDeadError, match="injected forward failure"):
        llm.generate(sample_prompts(), GREEDY, use_tqdm=False)
    assert engine._apart
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 5
    assert all(p.exitcode is not None for p in workers)
    assert not dist.is_initialized()
    with LLM(path, **options) as llm:
        assert llm.generate("again", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_tp2_a_worker_that_fails_exits_and_is_reported(checkpoints):
    """A worker raising (here at a step that describes no batch, sent while the engine idles)
    exits instead of waiting for its peers, so the engine reports it and stops serving."""
    from nano_engine.model_runner import StepInput

    path = checkpoints("qwen3")
    with LLM(path, kvcache_block_size=4, device="cpu", tensor_parallel_size=2) as llm:
        engine = llm.engine
        engine.workers.conns[0].send(StepInput([], [], [], [], 0, []))
        start = time.monotonic()
        while engine.error is None and time.monotonic() - start < 30:
            time.sleep(0.05)
        assert "tensor-parallel worker 1" in str(engine.error)
        assert "exited with code 1" in str(engine.error)
        with pytest.raises(EngineDeadError):
            llm.generate("more", GREEDY, use_tqdm=False)


def test_a_start_that_fails_after_the_workers_leaves_nothing_behind(checkpoints):
    """An error past the model load (here the scheduler's policy) stops the workers and the
    process group: the next engine of this process starts."""
    import torch.distributed as dist

    path = checkpoints("qwen3")
    options = {"kvcache_block_size": 4, "device": "cpu", "tensor_parallel_size": 2}
    with pytest.raises(ValueError, match="policy"):
        LLM(path, scheduling_policy="nope", **options)
    assert not dist.is_initialized()
    with LLM(path, **options) as llm:
        assert llm.generate("again", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_worker_that_cannot_start_is_reported_at_once(checkpoints, tmp_path):
    """A script without the ``if __name__ == "__main__"`` guard: the spawned worker fails
    while importing it. The engine says so instead of waiting minutes for it to join."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from nano_engine import LLM\n"
        f"LLM({str(checkpoints('qwen3'))!r}, device='cpu', tensor_parallel_size=2)\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode != 0
    assert "tensor-parallel worker 1" in proc.stderr and "did not start" in proc.stderr
    assert time.monotonic() - start < 120


_DYING_WORKER = """
import os, sys

# Loaded by every Python started with this directory on PYTHONPATH: a spawned process (the
# worker) exits at the phase the test names; rank 0, in the test's process, is untouched.
phase = os.environ.get("NANO_TEST_WORKER_DIES")
if phase and "--multiprocessing-fork" in sys.argv:
    import torch.distributed as dist

    from nano_engine import parallel
    from nano_engine.model_runner import ModelRunner

    if phase == "store":  # before joining rank 0's store
        dist.TCPStore = lambda *args, **kwargs: os._exit(7)
    elif phase == "rendezvous":  # joined: rank 0 goes on into the process group's rendezvous
        parallel.init_group = lambda *args, **kwargs: os._exit(7)
    elif phase == "sizing":  # in the group: rank 0 waits in the KV sizing's collective
        ModelRunner._size_kv_cache = lambda self: os._exit(7)
"""


@pytest.mark.parametrize(
    ("phase", "message"),
    [
        ("store", "did not start (exit code 7"),
        ("rendezvous", "exited with code 7 while the engine started"),
        ("sizing", "exited with code 7 while the engine started"),
    ],
)
def test_a_worker_that_dies_while_the_engine_starts_is_reported_within_seconds(
    checkpoints, tmp_path, monkeypatch, phase, message
):
    """A worker that dies at any phase of the start: before joining (rank 0 waits for it to
    join), after joining (rank 0 waits in the process group's rendezvous), or in the group
    (rank 0 waits in the KV sizing's collective). The start fails naming it within seconds,
    not at the group's 10-minute timeout, and leaves nothing behind: the next engine of this
    process starts."""
    import torch.distributed as dist

    (tmp_path / "sitecustomize.py").write_text(_DYING_WORKER)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("NANO_TEST_WORKER_DIES", phase)
    path = checkpoints("qwen3")
    options = {"kvcache_block_size": 4, "device": "cpu", "tensor_parallel_size": 2}
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker 1 \(pid \d+\) ") as error:
        LLM(path, **options)
    assert message in str(error.value)
    assert time.monotonic() - start < 60  # (mostly the worker's imports on a busy 2-core host)
    assert not dist.is_initialized()
    if phase == "rendezvous":  # (the one that leaves a thread behind, in the rendezvous)
        monkeypatch.delenv("NANO_TEST_WORKER_DIES")
        with LLM(path, **options) as llm:
            assert llm.generate("again", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
