"""Random workloads on tiny block pools: every request finishes with exactly its tokens, no
block leaks, no step exceeds a budget, and outputs match a run that never preempts."""

from __future__ import annotations

from fake_model import make, run_pipelined, run_to_completion, seq
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nano_scheduler import FinishReason

requests = st.lists(
    st.tuples(
        st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)
    ),  # prompt, max_tokens, prefix
    min_size=1,
    max_size=12,
)


def build(reqs, block_size, shared_prefix):
    out = []
    for i, (prompt_len, max_tokens, prefix) in enumerate(reqs):
        prompt = shared_prefix[: prefix * 4] + [(i * 31 + j) % 50 for j in range(prompt_len)]
        out.append(seq(i, prompt, max_tokens=max_tokens, ignore_eos=True))
    return out


@settings(max_examples=300, deadline=None)
@given(
    reqs=requests,
    block_size=st.integers(1, 8),
    spare_blocks=st.integers(0, 6),
    chunked=st.booleans(),
    policy=st.sampled_from(["decode_first", "prefill_first"]),
    max_num_seqs=st.integers(1, 6),
    extra_tokens=st.integers(0, 40),
    lookahead=st.integers(0, 3),
    watermark=st.sampled_from([0.0, 0.1]),
)
def test_random_workloads(
    reqs,
    block_size,
    spare_blocks,
    chunked,
    policy,
    max_num_seqs,
    extra_tokens,
    lookahead,
    watermark,
):
    shared = list(range(100, 112))
    seqs = build(reqs, block_size, shared)
    longest = max(s.num_prompt_tokens + s.params.max_tokens for s in seqs)
    max_model_len = longest + 1
    num_blocks = -(-longest // block_size) + spare_blocks
    budget = max(max_num_seqs + extra_tokens, 1 if chunked else max_model_len)
    config = {
        "block_size": block_size,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
        "policy": policy,
    }
    sched = make(
        num_blocks=num_blocks, admission_lookahead=lookahead, watermark=watermark, **config
    )
    for s in seqs:
        sched.add(s)

    original_schedule = sched.schedule

    def checked_schedule():
        out = original_schedule()
        assert 0 < out.num_batched_tokens <= budget or out.finished
        assert sum(c.num_tokens for c in out.prefills) + len(out.decodes) == out.num_batched_tokens
        assert out.num_seqs <= max_num_seqs and len(sched.running) <= max_num_seqs
        scheduled = [s.seq_id for s in out.decodes] + [c.seq.seq_id for c in out.prefills]
        assert len(set(scheduled)) == len(scheduled)  # a sequence runs at most once a step
        bm = sched.block_manager
        assert bm.num_free_blocks + bm.num_used_blocks == num_blocks
        return out

    sched.schedule = checked_schedule
    run_to_completion(sched, max_steps=5000)
    event(f"preemptions: {min(sched.num_preemptions, 3)}")

    bm = sched.block_manager
    assert bm.num_free_blocks == num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    for s in seqs:
        # The only early stop is a sequence alone in a pool too small for it.
        if s.finish_reason is FinishReason.LENGTH and s.num_output_tokens < s.params.max_tokens:
            assert s.num_tokens > num_blocks * block_size
        else:
            assert s.num_output_tokens == s.params.max_tokens

    # Same outputs as a pool where nothing is ever preempted.
    reference = build(reqs, block_size, shared)
    roomy = make(num_blocks=len(seqs) * (longest // block_size + 2), **config)
    for s in reference:
        roomy.add(s)
    run_to_completion(roomy)
    assert roomy.num_preemptions == 0
    for s, r in zip(seqs, reference):
        n = s.num_output_tokens
        assert s.output_token_ids == r.output_token_ids[:n]


@settings(max_examples=200, deadline=None)
@given(
    reqs=requests,
    block_size=st.integers(1, 8),
    spare_blocks=st.integers(0, 6),
    chunked=st.booleans(),
    max_num_seqs=st.integers(1, 6),
    min_tokens=st.integers(0, 3),
)
def test_async_scheduling_gives_the_same_outputs(
    reqs, block_size, spare_blocks, chunked, max_num_seqs, min_tokens
):
    """Scheduling each step before the previous one's tokens are known (placeholders, stop
    tokens found a step late, blocks shared once their tokens are known) changes no output, no
    finish reason, and leaks no block; the KV every step reads is its own (checked in run)."""

    def requests_with_eos():
        out = []
        for i, (prompt_len, max_tokens, prefix) in enumerate(reqs):
            prompt = list(range(100, 112))[: prefix * 4] + [
                (i * 31 + j) % 50 for j in range(prompt_len)
            ]
            out.append(
                seq(i, prompt, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens))
            )
        return out

    longest = max(p + m + 12 for p, m, _ in reqs)
    num_blocks = -(-longest // block_size) + spare_blocks
    config = {
        "block_size": block_size,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(max_num_seqs + 4, 1 if chunked else longest + 1),
        "max_model_len": longest + 1,
        "enable_chunked_prefill": chunked,
        "eos_token_ids": frozenset({3, 7}),  # the fake model's tokens hit them now and then
    }
    runs = []
    for driver in (run_to_completion, run_pipelined):
        sched = make(num_blocks=num_blocks, **config)
        seqs = requests_with_eos()
        for s in seqs:
            sched.add(s)
        driver(sched)
        bm = sched.block_manager
        assert bm.num_free_blocks == num_blocks and all(b.ref_count == 0 for b in bm.blocks)
        for b in bm.blocks:  # the prefix cache only ever holds blocks of known tokens
            if b.token_ids is not None:
                assert min(b.token_ids) >= 0
                assert b.hash == bm.compute_hash(b.token_ids, b.parent_hash)
        event(f"{driver.__name__}: preemptions {min(sched.num_preemptions, 2)}")
        runs.append([(s.output_token_ids, s.finish_reason) for s in seqs])
        event(f"{driver.__name__}: stops {sum(r is FinishReason.STOP for _, r in runs[-1]) > 0}")
    assert runs[0] == runs[1]
