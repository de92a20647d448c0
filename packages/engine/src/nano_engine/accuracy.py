"""How close a quantized engine stays to the reference one: greedy runs of both over the same
prompts, compared by vLLM's ``check_logprobs_close`` rule. Along each sequence, until the two
greedy paths part, each side's token must be among the other's top-k; the paths may part (a
near tie flips), and the comparison of that sequence stops there.

``nano-engine accuracy MODEL --kv-cache-dtype fp8`` runs it from the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nano_engine.outputs import RequestOutput


@dataclass
class Agreement:
    """What ``compare`` found over a prompt set (``k``: the top-k compared)."""

    k: int
    sequences: int = 0
    identical: int = 0  # sequences whose whole greedy output is the reference's
    positions: int = 0  # tokens compared: up to and including the first that differs
    matched: int = 0  # of those, the same token on both sides
    outside_top_k: list[tuple[int, int]] = field(default_factory=list)  # (sequence, position)
    max_logprob_error: float = 0.0  # over matched tokens
    sum_logprob_error: float = 0.0

    @property
    def passed(self) -> bool:
        """vLLM's rule: no compared token outside the other side's top-k."""
        return not self.outside_top_k

    @property
    def mean_logprob_error(self) -> float:
        return self.sum_logprob_error / self.matched if self.matched else 0.0

    def summary(self) -> dict:
        return {
            "sequences": self.sequences,
            "identical_sequences": self.identical,
            "greedy_match_rate": self.identical / self.sequences if self.sequences else 0.0,
            "tokens_compared": self.positions,
            "tokens_matched": self.matched,
            f"top{self.k}_agreement": (
                1 - len(self.outside_top_k) / self.positions if self.positions else 1.0
            ),
            "outside_top_k": self.outside_top_k,
            "mean_abs_logprob_error": self.mean_logprob_error,
            "max_abs_logprob_error": self.max_logprob_error,
        }


def compare(
    reference: list[RequestOutput], candidate: list[RequestOutput], k: int = 5
) -> Agreement:
    """Compare greedy outputs with ``logprobs >= k`` of the same prompts, in order."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference outputs, {len(candidate)} candidates")
    result = Agreement(k)
    for s, (ref, cand) in enumerate(zip(reference, candidate)):
        ours, theirs = ref.outputs[0], cand.outputs[0]
        if ours.logprobs is None or theirs.logprobs is None:
            raise ValueError("compare needs outputs generated with logprobs")
        result.sequences += 1
        result.identical += ours.token_ids == theirs.token_ids
        for position, (a, b) in enumerate(zip(ours.logprobs, theirs.logprobs)):
            result.positions += 1
            top_a, top_b = dict(a.top[:k]), dict(b.top[:k])
            if a.token_id not in top_b or b.token_id not in top_a:
                result.outside_top_k.append((s, position))
            if a.token_id != b.token_id:
                break
            result.matched += 1
            error = abs(a.logprob - b.logprob)
            result.sum_logprob_error += error
            result.max_logprob_error = max(result.max_logprob_error, error)
    return result


def format_agreement(agreement: Agreement) -> str:
    s = agreement.summary()
    k = agreement.k
    return "\n".join(
        [
            f"sequences          {s['sequences']} ({s['identical_sequences']} identical: greedy "
            f"match rate {s['greedy_match_rate']:.1%})",
            f"tokens compared    {s['tokens_compared']} (until each sequence's paths part), "
            f"{s['tokens_matched']} the same",
            f"top-{k} agreement    {s[f'top{k}_agreement']:.2%} ("
            + (
                "every token in the other side's top-" + str(k)
                if agreement.passed
                else f"{len(s['outside_top_k'])} outside the other's top-{k}: "
                + ", ".join(f"seq {a} pos {b}" for a, b in s["outside_top_k"][:5])
            )
            + ")",
            f"|logprob error|    mean {s['mean_abs_logprob_error']:.4f}, max "
            f"{s['max_abs_logprob_error']:.4f} (same tokens)",
        ]
    )
