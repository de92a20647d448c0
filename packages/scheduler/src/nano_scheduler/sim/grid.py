"""The batch shapes a profile measures the device's time of (``nano-engine profile``).

Decode-only steps at every captured CUDA-graph batch size over powers-of-two contexts; single
prefill chunks of 16 tokens up to the token budget over several cached lengths; several chunks
at once; chunks beside decodes; decodes alone; sampling over powers-of-two rows. Each within
the engine's limits (budget, model length, KV capacity). Plain data, no torch: the simulator's
tests build profiles on the same grid.
"""

from __future__ import annotations


class Grid:
    """The shapes a profile measures, within the engine's limits. ``quick``: a few of them
    (a CPU, a test)."""

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        capacity: int,
        graph_sizes: list[int],
        quick: bool = False,
    ) -> None:
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.max_len, self.capacity = max_model_len, capacity
        self.graph_sizes, self.quick = graph_sizes, quick

    def _fits(self, tokens: int, length: int) -> bool:
        return tokens <= self.budget and length <= self.max_len

    def contexts(self, batch: int) -> list[int]:
        """Decode contexts for a batch: powers of two from 16 up to what the cache holds."""
        ratio = 8 if self.quick else 2
        out, c = [], 16
        while c < self.max_len and batch * c <= self.capacity:
            out.append(c)
            c *= ratio
        top = min(self.max_len - 1, self.capacity // batch)
        if top >= 2 and (not out or top > out[-1] * 1.25):
            out.append(top)
        return out

    def decode_graphs(self) -> list[tuple[int, int]]:
        """(batch, context) for every captured size."""
        return [(b, c) for b in self.graph_sizes for c in self.contexts(b)]

    def eager(self) -> list[tuple[tuple[tuple[int, int], ...], int, int]]:
        """(chunks, decodes, decode context): single chunks over cached tokens, several
        chunks at once, chunks beside decodes, decodes alone; lengths clipped to the engine's
        limits (a small configuration still gets a grid of each kind)."""
        ratio = 8 if self.quick else 2
        lengths, n = [], 16
        while n < self.budget:
            lengths.append(n)
            n *= ratio
        lengths.append(self.budget)
        cached = {0, self.max_len // 4} | set((256,) if self.quick else (512, 2048, 8192))
        shapes = [
            (((n, c),), 0, 0) for n in lengths for c in sorted(cached) if self._fits(n, n + c)
        ]
        for total in sorted(
            {min(t, self.budget) for t in ((1024,) if self.quick else (1024, 8192))}
        ):
            for k in (4,) if self.quick else (4, 16, 64):
                n = total // k
                for c in sorted({0, min(1024, self.max_len // 4)} if not self.quick else {0}):
                    if n >= 1 and self._fits(total, n + c):
                        shapes.append((((n, c),) * k, 0, 0))
        seqs = sorted({b for b in (8, 64, self.max_num_seqs) if b <= self.max_num_seqs})
        contexts = sorted(
            {min(c, self.max_len // 2) for c in ((256,) if self.quick else (256, 2048))}
        )
        for b in seqs:
            for ctx in contexts:
                if b * ctx > self.capacity or ctx < 1:
                    continue
                for n in sorted(
                    {min(n, self.budget - b) for n in ((64,) if self.quick else (64, 512, 4096))}
                ):
                    if n >= 1 and self._fits(n + b, n):
                        shapes.append((((n, 0),), b, ctx))
                shapes.append(((), b, ctx))
        if 1 not in seqs:
            shapes += [((), 1, ctx) for ctx in contexts if ctx >= 1]
        return list(dict.fromkeys(shapes))

    def sampling_rows(self) -> list[int]:
        rows, r = [], 1
        while r < self.max_num_seqs:
            rows.append(r)
            r *= 4 if self.quick else 2
        return [*rows, self.max_num_seqs]
