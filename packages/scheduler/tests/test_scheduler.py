"""Exact scheduling decisions in small scenarios, with a fake model and no tensors."""

from __future__ import annotations

import bisect
import pickle

import pytest
from fake_model import make, next_token, run_to_completion, seq, step

from nano_scheduler import (
    FinishReason,
    ScheduledChunk,
    SchedulerConfig,
    SequenceStatus,
    piecewise_graph_sizes,
)


def chunks(out):
    return [(c.seq.seq_id, c.start, c.num_tokens, c.samples) for c in out.prefills]


def test_one_request_prefills_then_decodes_to_max_tokens():
    sched = make(num_blocks=16, block_size=4)
    a = seq(1, range(10), max_tokens=3)
    sched.add(a)
    out, finished = step(sched)
    assert chunks(out) == [(1, 0, 10, True)] and out.decodes == []
    assert out.num_batched_tokens == 10 and a.num_computed_tokens == 10
    out, _ = step(sched)
    assert out.prefills == [] and out.decodes == [a]
    _, finished = step(sched)
    assert finished == [a] and a.finish_reason is FinishReason.LENGTH
    assert a.num_output_tokens == 3 and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_after_the_last_chunk():
    sched = make(max_num_seqs=4, max_num_batched_tokens=32, block_size=4)
    a = seq(1, range(100))
    sched.add(a)
    seen = [chunks(step(sched)[0]) for _ in range(4)]
    assert seen == [
        [(1, 0, 32, False)],
        [(1, 32, 32, False)],
        [(1, 64, 32, False)],
        [(1, 96, 4, True)],
    ]
    assert a.num_output_tokens == 1


def test_decodes_go_first_and_a_long_prompt_fills_the_rest_of_the_budget():
    sched = make(max_num_seqs=4, max_num_batched_tokens=16, block_size=4)
    a = seq(1, range(5), max_tokens=10)
    sched.add(a)
    step(sched)
    b = seq(2, range(100, 140))
    sched.add(b)
    out, _ = step(sched)
    assert out.decodes == [a] and chunks(out) == [(2, 0, 15, False)]
    out, _ = step(sched)
    assert out.decodes == [a] and chunks(out) == [(2, 15, 15, False)]
    assert out.num_batched_tokens == 16


def test_prefill_first_policy_runs_prefills_alone():
    sched = make(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, policy="prefill_first")
    a = seq(1, range(5), max_tokens=10)
    sched.add(a)
    step(sched)
    sched.add(seq(2, range(100, 120)))
    out, _ = step(sched)
    assert out.decodes == [] and chunks(out) == [(2, 0, 20, True)]
    out, _ = step(sched)
    assert [s.seq_id for s in out.decodes] == [1, 2] and out.prefills == []


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_in_whole():
    sched = make(
        max_num_seqs=4,
        max_num_batched_tokens=40,
        max_model_len=40,
        block_size=4,
        enable_chunked_prefill=False,
    )
    a, b = seq(1, range(30)), seq(2, range(100, 120))
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert chunks(out) == [(1, 0, 30, True)]
    out, _ = step(sched)
    assert out.decodes == [a] and chunks(out) == [(2, 0, 20, True)]


def test_max_num_seqs_bounds_admission():
    sched = make(max_num_seqs=2, max_num_batched_tokens=64, block_size=4)
    for i in range(3):
        sched.add(seq(i, range(i * 10, i * 10 + 5)))
    out, _ = step(sched)
    assert [c.seq.seq_id for c in out.prefills] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_prefix_hits_reduce_prefill_tokens():
    sched = make(num_blocks=32, block_size=16)
    prompt = list(range(64))
    sched.add(seq(1, prompt))
    step(sched)
    sched.add(seq(2, prompt))
    out, _ = step(sched)
    # Blocks 0-2 are shared; block 3 holds the last prompt token, which is always recomputed.
    assert chunks(out) == [(2, 48, 16, True)]
    assert out.num_batched_tokens == 16 + 1  # and request 1's decode


def test_a_chunk_is_shareable_in_the_step_that_computes_it():
    # The step stores every token's KV before attention reads any: a chunk scheduled this step
    # already serves a sequence admitted in the same step.
    sched = make(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    prompt = list(range(24))
    sched.add(seq(1, prompt))
    step(sched)  # request 1: tokens 0-15
    sched.add(seq(2, prompt))
    out, _ = step(sched)
    assert chunks(out) == [(1, 16, 8, True), (2, 20, 4, True)]


def test_preemption_takes_the_newest_and_requeues_it_at_the_front():
    # 6 blocks of 4 tokens: three 7-token prompts take 2 blocks each; the decodes that cross into
    # a third block must preempt.
    sched = make(
        num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0
    )
    seqs = [seq(i, range(i * 10, i * 10 + 7), max_tokens=6) for i in range(4)]
    for s in seqs:
        sched.add(s)
    step(sched)  # three prefill (the fourth does not fit) and sample their 8th token
    step(sched)  # the 8th tokens fill the second blocks
    out, _ = step(sched)  # the 9th tokens need third blocks: one preemption frees two
    assert [s.seq_id for s in out.preempted] == [2]
    assert out.decodes == seqs[:2]
    assert [s.seq_id for s in sched.waiting] == [2, 3]
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].block_table == []
    assert seqs[2].num_computed_tokens == 0 and seqs[2].num_preemptions == 1
    assert sched.num_preemptions == 1
    run_to_completion(sched)
    assert all(s.num_output_tokens == 6 for s in seqs)
    assert sched.block_manager.num_free_blocks == 6


def test_outputs_are_identical_with_and_without_preemption():
    def outputs(num_blocks):
        sched = make(
            num_blocks=num_blocks,
            block_size=2,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            watermark=0.0,
        )
        seqs = [seq(i, range(i, i + 3 + i % 5), max_tokens=9, ignore_eos=True) for i in range(8)]
        for s in seqs:
            sched.add(s)
        run_to_completion(sched)
        return [s.output_token_ids for s in seqs], sched.num_preemptions

    roomy, none = outputs(200)
    tight, preemptions = outputs(12)
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_a_sequence_alone_in_a_pool_too_small_finishes_with_length():
    sched = make(num_blocks=3, block_size=4, watermark=0.0)
    a = seq(1, range(10), max_tokens=100)
    sched.add(a)
    finished = []
    for _ in range(10):
        if not sched.has_unfinished():
            break
        finished += step(sched)[1]
    assert finished == [a] and a.finish_reason is FinishReason.LENGTH
    assert a.num_tokens == 13  # KV for 12 tokens (the whole pool) and the last one sampled
    assert sched.block_manager.num_free_blocks == 3


def test_a_preempted_sequence_longer_than_the_pool_finishes_with_length():
    """Sharing its blocks through the prefix cache, a sequence can outgrow the whole pool; once
    preempted it could never be admitted again, so it finishes with length, not wait forever."""
    sched = make(
        num_blocks=4, block_size=2, max_num_seqs=3, max_num_batched_tokens=7, max_model_len=10
    )
    a, b, c = seq(0, [1] * 4, max_tokens=4), seq(1, [1] * 7, max_tokens=7), seq(2, [1] * 4, 1)
    for s in (a, b, c):
        sched.add(s)
    finished = []
    for _ in range(20):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty
        finished += sched.update(out, [1] * len(out.sampling_seqs))  # a model that says 1
    assert not sched.has_unfinished() and sorted(s.seq_id for s in finished) == [0, 1, 2]
    assert b.finish_reason is FinishReason.LENGTH and b.num_tokens == 9  # 5 blocks: 4 exist
    assert a.num_tokens == 8 and c.num_tokens == 5
    assert sched.block_manager.num_free_blocks == 4


def test_a_later_request_that_fits_passes_a_head_that_does_not():
    for lookahead, admitted in ((4, [1, 3]), (0, [1])):
        sched = make(num_blocks=8, block_size=4, watermark=0.0, admission_lookahead=lookahead)
        sched.add(seq(1, range(20), max_tokens=20))  # 5 blocks
        step(sched)
        sched.add(seq(2, range(100, 120)))  # needs 5 blocks: only 3 free
        sched.add(seq(3, range(200, 205)))  # needs 2
        step(sched)
        assert [s.seq_id for s in sched.running] == admitted, lookahead
        assert sched.waiting[0].seq_id == 2


def test_the_watermark_keeps_blocks_free_while_others_run():
    sched = make(num_blocks=100, block_size=4, watermark=0.1)
    sched.add(seq(1, range(300)))  # 76 blocks, alone: the watermark does not apply
    step(sched)
    sched.add(seq(2, range(1000, 1060)))  # 15 blocks would leave 9 < 10 free
    out, _ = step(sched)
    assert out.prefills == [] and len(sched.waiting) == 1


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "in_flight", "finished"])
def test_abort_in_every_state_frees_blocks(state):
    sched = make(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a = seq(1, range(20), max_tokens=3)
    sched.add(a)
    if state == "prefilling":
        step(sched)
    elif state == "decoding":
        for _ in range(3):
            step(sched)
        assert a.num_output_tokens == 1
    elif state == "finished":
        run_to_completion(sched)
    if state == "in_flight":
        out = sched.schedule()
        assert sched.abort(1) is a
        assert sched.update(out, [7] * len(out.sampling_seqs)) == []
        assert a.num_computed_tokens == 0 and a.num_output_tokens == 0
    elif state == "finished":
        assert sched.abort(1) is None and a.finish_reason is FinishReason.LENGTH
    else:
        assert sched.abort(1) is a
    if state != "finished":
        assert a.finish_reason is FinishReason.ABORT and a.is_finished
    assert a.block_table == [] and sched.block_manager.num_free_blocks == 16
    assert not sched.has_unfinished() and not sched.running and not sched.waiting
    assert sched.abort(1) is None


def test_stop_conditions():
    sched = make(num_blocks=64, block_size=4, max_model_len=20, eos_token_ids={0})
    eos = seq(1, [5, 6], max_tokens=10)
    ignored = seq(2, [5, 6], max_tokens=3, ignore_eos=True)
    stop_id = seq(3, [5, 6], max_tokens=10, stop_token_ids=[9])
    early = seq(4, [5, 6], max_tokens=10, min_tokens=2)
    model_len = seq(5, range(17), max_tokens=10)
    for s in (eos, ignored, stop_id, early, model_len):
        sched.add(s)
    forced = {1: 0, 2: 0, 3: 9, 4: 0, 5: 1}
    while sched.has_unfinished():
        step(sched, forced)
    assert (eos.finish_reason, eos.output_token_ids) == (FinishReason.STOP, [0])
    assert (ignored.finish_reason, ignored.output_token_ids) == (FinishReason.LENGTH, [0, 0, 0])
    assert (stop_id.finish_reason, stop_id.output_token_ids) == (FinishReason.STOP, [9])
    assert (early.finish_reason, early.output_token_ids) == (FinishReason.STOP, [0, 0])
    assert (model_len.finish_reason, model_len.num_tokens) == (FinishReason.LENGTH, 20)


def test_finish_for_a_stop_string_found_by_the_engine():
    sched = make()
    a = seq(1, range(5), max_tokens=50)
    sched.add(a)
    step(sched)
    assert sched.finish(1, FinishReason.STOP) is a
    assert a.finish_reason is FinishReason.STOP and sched.block_manager.num_used_blocks == 0


def test_requests_that_can_never_run_are_rejected_at_add():
    sched = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt \(64 tokens\).*maximum model length of 64"):
        sched.add(seq(1, range(64)))
    with pytest.raises(ValueError, match="more than the whole pool of 4 blocks"):
        sched.add(seq(2, range(16)))
    with pytest.raises(ValueError, match="empty"):
        sched.add(seq(3, []))
    sched.add(seq(4, range(3)))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(seq(4, range(3)))
    for bad in ([1, 2.5], [3, -1], ["a"], [2, None], [2**70]):
        with pytest.raises(ValueError, match=f"integers >= 0, the prompt has {bad[-1]!r}"):
            sched.add(seq(5, bad))
    assert [s.seq_id for s in sched.waiting] == [4]


def test_stats():
    sched = make(num_blocks=10, block_size=4, max_num_seqs=1)
    sched.add(seq(1, range(8), max_tokens=5))
    sched.add(seq(2, range(50, 53)))
    step(sched)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (1, 1, 0)
    assert stats.kv_usage == pytest.approx(0.2) and stats.free_blocks == 8


def test_update_checks_the_number_of_sampled_tokens():
    sched = make()
    sched.add(seq(1, range(5)))
    out = sched.schedule()
    with pytest.raises(ValueError, match="expected 1 sampled tokens, got 2"):
        sched.update(out, [1, 2])


def test_timestamps_follow_the_clock():
    now = [0.0]
    sched = make(clock=lambda: now[0])
    a = seq(1, range(5), max_tokens=2)
    a.arrival_time = 0.0
    sched.add(a)
    now[0] = 1.0
    step(sched)
    now[0] = 2.0
    step(sched)
    assert (a.first_scheduled_time, a.first_token_time, a.finish_time) == (1.0, 1.0, 2.0)


def test_scheduled_lists_every_sequence_with_its_new_and_cached_tokens():
    sched = make(num_blocks=32, block_size=4)
    a = seq(1, range(6), max_tokens=5)
    sched.add(a)
    step(sched)
    sched.add(seq(2, range(50, 53)))
    out = sched.schedule()
    assert out.scheduled == [
        ScheduledChunk(out.prefills[0].seq, 0, 3, True),
        ScheduledChunk(a, 6, 1, True),
    ]


def test_a_decoding_sequence_pickles_without_its_history():
    sched = make(num_blocks=256, block_size=16)
    a = seq(1, range(1000), max_tokens=5)
    sched.add(a)
    step(sched)
    copy = pickle.loads(pickle.dumps(a))
    assert copy.token_ids is None
    assert (copy.num_tokens, copy.last_token_id, copy.block_table) == (
        1001,
        a.token_ids[-1],
        a.block_table,
    )
    assert len(pickle.dumps(a)) < 1500
    prefilling = seq(2, range(10))
    assert pickle.loads(pickle.dumps(prefilling)).token_ids.tolist() == list(range(10))


def test_next_token_depends_on_history():
    assert next_token([1, 2, 3]) != next_token([2, 1, 3]) or next_token([1]) != next_token([2])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        ({"max_num_seqs": 64, "max_num_batched_tokens": 32}, "must be >= max_num_seqs"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}, "without chunked"),
        ({"policy": "fastest"}, "policy must be one of"),
        ({"watermark": 1.0}, r"watermark must be in \[0, 1\)"),
        ({"admission_lookahead": -1}, "admission_lookahead"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize("budget", [1, 15, 16, 100, 512, 513, 2048, 5000, 16384, 65536])
def test_piecewise_graph_sizes_pad_a_step_by_at_most_an_eighth(budget):
    """Every token count up to the budget has a size that holds it, the budget itself is one,
    and above 512 tokens a step pads by at most 1/8 of its tokens (below: to a power of two)."""
    sizes = piecewise_graph_sizes(budget)
    assert sizes == sorted(set(sizes)) and sizes[-1] == budget and sizes[0] == min(16, budget)
    for tokens in range(1, budget + 1, max(1, budget // 997)):
        size = sizes[bisect.bisect_left(sizes, tokens)]
        assert size >= tokens
        assert size - tokens <= (tokens / 8 if tokens > 512 else max(tokens, 16))
