"""The per-step forward metadata: one explicit object the runner builds and the attention
layers read (passed down through forward, never stored in module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class ForwardContext:
    """Layout of one step's batch: the prefill chunks' tokens first, then one token per decode.

    Device tensors (read by kernels, also under CUDA graph replay):
      query_start_loc  int32 [B + 1]  cumulative new tokens per sequence (cu_seqlens_q)
      seq_lens         int32 [B]      context length of each sequence after this step
      block_tables     int32 [B, M]   physical blocks of each sequence, -1 padded
      slot_mapping     int64 [T]      cache slot of each new token, -1 for padding
      logits_indices   int64 [S]      rows of the hidden states that reach the LM head
      decode_order     int32 [D]      a permutation of the decodes (0 = the first decode), by
                                      context length, longest first: a kernel that takes them
                                      in this order starts the long ones early (optional)
    Host copies (for code that loops over sequences without a device sync):
      query_start_loc_cpu, seq_lens_cpu
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes

    @cached_property
    def cached_prefix(self) -> bool:
        """Whether some prefill chunk follows tokens already in the cache (a cached prefix,
        earlier chunks of its prompt)."""
        qsl, lens = self.query_start_loc_cpu, self.seq_lens_cpu
        return any(lens[b] > qsl[b + 1] - qsl[b] for b in range(self.num_prefills))

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_prefills: int,
        logits_indices: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> ForwardContext:
        """From per-sequence lists (prefills first): new tokens, context lengths after the step,
        block tables. The slot of the i-th new token of a sequence with context L and n new
        tokens is that of position L - n + i. logits_indices default: each sequence's last
        new token. ValueError for lists that do not describe such a batch."""
        count = len(query_lens)
        if len(seq_lens) != count or len(block_tables) != count:
            raise ValueError(
                f"query_lens, seq_lens and block_tables must have one entry per sequence, got "
                f"{count}, {len(seq_lens)} and {len(block_tables)}"
            )
        if not 0 <= num_prefills <= count:
            raise ValueError(f"num_prefills must be in [0, {count}], got {num_prefills}")
        for b, (n, length, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if not 1 <= n <= length or len(table) * block_size < length:
                raise ValueError(
                    f"sequence {b}: {n} new tokens, context {length}, {len(table)} blocks of "
                    f"{block_size}: needs 1 <= new tokens <= context <= its blocks' tokens"
                )
            if b >= num_prefills and n != 1:
                raise ValueError(f"sequence {b} is a decode (after the prefills): one new token")
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        width = max((len(t) for t in block_tables), default=0) or 1
        tables = torch.full((len(block_tables), width), -1, dtype=torch.int32)
        slots = []
        for b, (n, length, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
            slots += [
                table[p // block_size] * block_size + p % block_size
                for p in range(length - n, length)
            ]
        if logits_indices is None:
            logits_indices = [end - 1 for end in qsl[1:]]
        return cls(
            num_prefills=num_prefills,
            num_prefill_tokens=qsl[num_prefills],
            num_decodes=len(query_lens) - num_prefills,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            decode_order=torch.tensor(
                longest_first(seq_lens[num_prefills:]), dtype=torch.int32, device=device
            ),
        )


def longest_first(lengths: list[int]) -> list[int]:
    """Indices of lengths, longest first (ties in order)."""
    return sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
