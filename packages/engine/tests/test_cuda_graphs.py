"""The decode graphs' staged inputs (host) and their unpacking (the torch ops a graph
captures), on the CPU against the step's lists: ids with pending tokens filled in, positions,
cache slots, block tables, decode order, the fused draw's temperatures and seeds, padding rows
that write nowhere."""

from __future__ import annotations

import random

import pytest
import torch

from nano_engine.cuda_graphs import stage, unpack
from nano_engine.model_runner import StepInput
from nano_engine.sampler import FusedRows

BLOCK = 4
WIDTH = 8  # blocks per sequence at most (max_model_len 32)


def random_step(rng: random.Random, batch: int) -> StepInput:
    lens = [rng.randint(1, BLOCK * WIDTH) for _ in range(batch)]
    tables = [rng.sample(range(100), -(-n // BLOCK)) for n in lens]
    ids = [rng.randrange(1000) for _ in range(batch)]
    pending = [r for r in range(batch) if rng.random() < 0.5]
    for r in pending:
        ids[r] = -1
    rows = [rng.randrange(16) for _ in pending]
    return StepInput(ids, [1] * batch, lens, tables, 0, list(range(batch)), pending, rows)


@pytest.mark.parametrize("batch,size", [(1, 1), (3, 4), (5, 8), (16, 16)])
@pytest.mark.parametrize("drawn", [False, True])
def test_unpacked_inputs_are_the_steps(batch, size, drawn):
    rng = random.Random(batch * 10 + size + drawn)
    step = random_step(rng, batch)
    sampling = None
    if drawn:
        sampling = FusedRows(
            [0.0 if r % 2 else 1 / 0.7 for r in range(batch)],
            [rng.getrandbits(53) for _ in range(batch)],
        )
    previous = torch.tensor([rng.randrange(1000) for _ in range(16)], dtype=torch.int64)
    staged = torch.zeros(7 * 16 + 2 + 16 * WIDTH, dtype=torch.int32)
    staged.fill_(12345)  # stale values from other steps: never read
    flat = stage(step, size, sampling)
    staged[: len(flat)] = torch.frombuffer(flat, dtype=torch.int32)
    ids, positions, ctx, inv, seeds = unpack(staged, size, BLOCK, WIDTH, previous, 32)

    expected_ids = list(step.input_ids)
    for position, row in zip(step.pending_positions, step.pending_rows):
        expected_ids[position] = int(previous[row])
    pad = size - batch
    assert ids.tolist() == expected_ids + [0] * pad
    lens = step.seq_lens
    assert positions.tolist() == [n - 1 for n in lens] + [0] * pad
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(step.block_tables, lens)]
    assert ctx.slot_mapping.tolist() == slots + [-1] * pad
    assert ctx.seq_lens.tolist() == lens + [0] * pad
    tables = [t + [-1] * (WIDTH - len(t)) for t in step.block_tables] + [[-1] * WIDTH] * pad
    assert ctx.block_tables.tolist() == tables
    order = ctx.decode_order.tolist()
    assert sorted(order) == list(range(size)) and order[batch:] == list(range(batch, size))
    assert [lens[i] for i in order[:batch]] == sorted(lens, reverse=True)
    assert ctx.query_start_loc.tolist() == list(range(size + 1))
    assert ctx.logits_indices.tolist() == list(range(size))
    if drawn:
        assert seeds.tolist() == sampling.seeds + [0] * pad
        assert inv.tolist() == pytest.approx(sampling.inv_temperature + [0.0] * pad)
    else:
        assert seeds.tolist() == [0] * size and inv.tolist() == [0.0] * size
