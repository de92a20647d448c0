"""Tensor parallelism 2 on the CPU: two real processes over gloo give the logits of one process,
and each rank reads only its shard of the checkpoint."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import PagedRunner, prompts
from safetensors import safe_open

from nano_models import TensorParallel
from nano_models.testing import build_checkpoint, fp8_checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_steps(runner: PagedRunner, seqs: list[list[int]]) -> list[torch.Tensor | None]:
    """A batched prefill of all but the last token of each sequence, then a decode of it."""
    prefills = [(i, s[:-1], 0) for i, s in enumerate(seqs) if len(s) > 1]
    out = [runner.step(prefills, len(prefills))]
    out.append(runner.step([(i, s[-1:], len(s) - 1) for i, s in enumerate(seqs)], 0))
    return out


def worker(rank: int, world: int, port: int, checkpoints: list[str], out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tp = TensorParallel.from_group()
        results = []
        for path in checkpoints:
            runner = PagedRunner(path, tp=tp)
            seqs = prompts(6, runner.model.config.vocab_size, seed=5)
            qkv = runner.model.model.layers[0].self_attn.qkv_proj
            results.append(
                {
                    "logits": run_steps(runner, seqs),
                    "bytes_read": runner.report.bytes_read,
                    "qkv": qkv.weight.detach().clone(),
                    "kv_head_start": qkv.kv_head_start,
                }
            )
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def expected_rank_bytes(path) -> int:
    """Norm weights are replicated; every other tensor is split in two."""
    total = 0
    with safe_open(path / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            nbytes = t.numel() * t.element_size()
            total += nbytes if "norm" in name else nbytes // 2
    return total


def test_tp2_equals_tp1_and_reads_only_its_shards(tmp_path):
    checkpoints = [
        build_checkpoint(tmp_path / "gqa", "qwen3", tokenizer=False),
        # One kv head for two ranks: replicated on both.
        build_checkpoint(
            tmp_path / "mqa", "llama", tokenizer=False, num_key_value_heads=1, attention_bias=True
        ),
        # experts split along their intermediate dimension, one all-reduce per layer
        build_checkpoint(tmp_path / "moe", "qwen3_moe", tokenizer=False, mlp_only_layers=[1]),
    ]
    # FP8 weights with block scales, split with them (a replicated kv head's rows too; the
    # experts' rows of gate and up, and the columns of down: rank 1's scales from block 1).
    for source in checkpoints[:3]:
        fp8, _ = fp8_checkpoint(source, f"{source}-fp8", f"{source}-plain", (16, 16))
        checkpoints.append(fp8)
    mp.spawn(
        worker,
        args=(2, free_port(), [str(c) for c in checkpoints], str(tmp_path)),
        nprocs=2,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, path in enumerate(checkpoints):
        single = PagedRunner(path)
        expected = run_steps(single, prompts(6, single.model.config.vocab_size, seed=5))
        for step, want in enumerate(expected):
            torch.testing.assert_close(ranks[0][i]["logits"][step], want, atol=1e-5, rtol=0)
            assert ranks[1][i]["logits"][step] is None  # logits are gathered to rank 0
        full_qkv = single.model.model.layers[0].self_attn.qkv_proj.weight
        if i == 0:
            assert ranks[0][i]["bytes_read"] == ranks[1][i]["bytes_read"]
            assert ranks[0][i]["bytes_read"] == expected_rank_bytes(path)
            # Rank r holds q heads [2r, 2r + 2) and kv head r of 4 q and 2 kv heads of 32.
            for r in range(2):
                qkv = ranks[r][i]["qkv"]
                assert torch.equal(qkv[:64], full_qkv[64 * r : 64 * r + 64])
                assert torch.equal(qkv[64:96], full_qkv[128 + 32 * r : 160 + 32 * r])
        elif i == 1:
            assert [ranks[r][i]["kv_head_start"] for r in range(2)] == [0, 0]
