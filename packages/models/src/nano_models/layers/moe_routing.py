"""The router's choice and the (token, slot) pairs' alignment for the MoE launches (Triton):
each token's softmax over its expert logits and top-k (``route_triton``), then the pairs
sorted by expert, each expert's run padded to a multiple of the tile height (``align``), or
both at once (``route_align``). One program does it all for a few tokens; past that two
launches of many programs (``route_align_parallel``): one routes its tokens and counts their
experts, the other reserves each expert's places with an atomic add a program and expert and
puts its pairs there; else torch's ops. The sorted list is as long as the worst case and no
value goes back to the host: it runs inside CUDA graphs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano_kvcache.launch import launch_options
from nano_kvcache.launch import pdl as pdl_here
from nano_models.layers.moe import route

# Up to this many (token, slot) pairs one Triton program routes and aligns them, in one launch
# instead of torch's ~20 (each a few microseconds even in a CUDA graph). The program walks the
# pairs 64 at a time; past this count the parallel launches (``route_align_parallel``: a memset
# and two launches, ~15 us whatever the count) are faster. Measured on an H200
# (benchmarks/bench_moe.py, 128 experts, top-8, in CUDA graphs; the one program / the parallel
# launches / torch's ops, us): 32 pairs 13.1 / 14.7 / 73.6, 64: 13.1 / 14.8 / 79.2, 96: 18.0 /
# 15.4 / 80.1, 128: 18.1 / 15.2 / 80.0, 1,024: 88.9 / 15.1 / 112.6, 8,192: 657 / 16.8 / 169.
ONE_PROGRAM_PAIRS = 64
# Pairs a program of the parallel alignment places (at most: ``_place_block``).
PLACE_BLOCK = 64
# Past ONE_PROGRAM_PAIRS: the parallel launches (True) or torch's ops (False; also where
# Triton is older than 3.5). Qwen3-30B-A3B's layer at 128 / 256 tokens: 314 / 324 us, against
# 386 / 425 with the one program / torch's ops (bench_moe, H200).
PARALLEL_ALIGN = True
# The parallel alignment reads back what a vector atomic add returns in every thread: Triton
# before 3.5 gave 0 to the threads that did not do the add (triton-lang/triton#7402).
_ATOMICS_RETURN = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 5)


def _aligned_length(pairs: int, num_experts: int, block_m: int) -> int:
    length = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-length // block_m) * block_m


def align(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs of ``ids`` [T, k] by expert, each expert's run padded to a
    multiple of ``block_m``. Returns ``sorted_pairs`` [P] int32 (pair indices t * k + slot, in
    order within an expert; padding holds T * k), ``tile_experts`` [P / block_m] int32 (the
    expert of each tile; ``num_experts`` past the used tiles) and ``used`` [1] int32 (the
    padded length used). P = T k + min(E, T k) (block_m - 1), rounded up to block_m: the most
    any routing needs. On CUDA one Triton launch of one program up to ``ONE_PROGRAM_PAIRS``
    pairs, past that two of many (``PARALLEL_ALIGN``; an expert's pairs then come in no set
    order); torch's ops elsewhere."""
    if not ids.is_cuda:
        return align_torch(ids, num_experts, block_m)
    if ids.numel() <= ONE_PROGRAM_PAIRS:
        return align_triton(ids, num_experts, block_m)
    if PARALLEL_ALIGN and _ATOMICS_RETURN:
        return align_parallel(ids, num_experts, block_m)
    return align_torch(ids, num_experts, block_m)


def route_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``route`` then ``align``: (weights [T, k] in ``dtype``, expert ids [T, k], the aligned
    pairs). On CUDA one Triton launch of one program up to ``ONE_PROGRAM_PAIRS`` pairs, past
    that two of many (``PARALLEL_ALIGN``); torch's ops elsewhere."""
    if router_logits.is_cuda and router_logits.shape[0] * top_k <= ONE_PROGRAM_PAIRS:
        return route_align_triton(router_logits, top_k, renormalize, dtype, block_m)
    if router_logits.is_cuda and PARALLEL_ALIGN and _ATOMICS_RETURN:
        return route_align_parallel(router_logits, top_k, renormalize, dtype, block_m)
    weights, ids = route(router_logits, top_k, renormalize, dtype)
    return weights, ids, align_torch(ids, router_logits.shape[1], block_m)


def route_align_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``route_align`` in one Triton launch (one program: for a few tokens); the ids in int32,
    among equal probabilities the lower expert id first."""
    tokens, experts = router_logits.shape
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=dtype, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    aligned = _aligned_buffers(tokens * top_k, experts, block_m, device)
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    _route_align_kernel[(1,)](
        router_logits,
        weights,
        ids,
        *aligned,
        tokens,
        aligned[0].numel(),
        experts,
        router_logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=max(1, 2048 // triton.next_power_of_2(experts)),
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(experts),
        BLOCK=64,
        num_warps=4,
    )
    return weights, ids, aligned


def route_align_parallel(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``route_align`` in two launches of many programs (for prefills and large batches): the
    ids in int32, among equal probabilities the lower expert id first; an expert's pairs in
    no set order (each pair's product is its own row of the grouped GEMMs, so the results do
    not depend on it)."""
    tokens, experts = router_logits.shape
    if tokens == 0:  # (no program to write ``used``)
        return route_align_triton(router_logits, top_k, renormalize, dtype, block_m)
    _check_atomics()
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=dtype, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    aligned = _aligned_buffers(tokens * top_k, experts, block_m, device)
    counts = torch.zeros(2, experts, dtype=torch.int32, device=device)  # (counts, places taken)
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    # A few tokens a program (512 logits), a warp per 256 of them.
    block_e = triton.next_power_of_2(experts)
    block_t = min(triton.next_power_of_2(tokens), max(1, 512 // block_e))  # (tokens > 0)
    _count_kernel[(triton.cdiv(tokens, block_t),)](
        router_logits,
        weights,
        ids,
        counts,
        aligned[0],
        tokens,
        tokens * top_k,
        aligned[0].numel(),
        experts,
        router_logits.stride(0),
        ROUTE=True,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_E=block_e,
        BLOCK=_place_block(experts),
        num_warps=min(4, max(1, block_t * block_e // 256)),
    )
    _place(ids.reshape(-1), counts, aligned, block_m)
    return weights, ids, aligned


def align_parallel(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align`` in two launches of many programs (an expert's pairs in no set order)."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    if pairs == 0:  # (no program to write ``used``)
        return align_triton(ids, num_experts, block_m)
    _check_atomics()
    aligned = _aligned_buffers(pairs, num_experts, block_m, ids.device)
    counts = torch.zeros(2, num_experts, dtype=torch.int32, device=ids.device)
    block = _place_block(num_experts)
    _count_kernel[(triton.cdiv(pairs, block),)](
        flat,
        flat,
        flat,
        counts,
        aligned[0],
        0,
        pairs,
        aligned[0].numel(),
        num_experts,
        0,
        ROUTE=False,
        TOP_K=1,
        RENORMALIZE=False,
        BLOCK_T=1,
        BLOCK_K=1,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK=block,
        num_warps=4,
    )
    _place(flat, counts, aligned, block_m)
    return aligned


def _place_block(num_experts: int) -> int:
    """Pairs a program of the parallel alignment takes: ``PLACE_BLOCK``, fewer where a
    one-hot of them over the experts would pass 8,192 values."""
    return max(16, min(PLACE_BLOCK, 8192 // triton.next_power_of_2(num_experts)))


def _check_atomics() -> None:
    if not _ATOMICS_RETURN:
        raise RuntimeError(
            f"the parallel MoE alignment needs Triton 3.5 or later (this is {triton.__version__})"
        )


def _place(flat_ids: torch.Tensor, counts: torch.Tensor, aligned: tuple, block_m: int) -> None:
    """The parallel alignment's second launch: every pair to its place, the tiles' experts."""
    sorted_pairs, tile_experts, used = aligned
    num_experts = counts.shape[1]
    block = _place_block(num_experts)
    _place_kernel[(triton.cdiv(flat_ids.numel(), block),)](
        flat_ids,
        counts,
        sorted_pairs,
        tile_experts,
        used,
        flat_ids.numel(),
        sorted_pairs.numel(),
        num_experts,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK=block,
        num_warps=4,
    )


def route_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    dtype: torch.dtype,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` in one Triton launch (one program: for decode-sized batches): (weights
    [T, k] in ``dtype``, expert ids [T, k] int32), among equal probabilities the lower expert
    id first. ``pdl``: as a programmatic dependent launch where the device has it (it waits
    for the previous kernel, then lets the next one start: ``nano_kvcache.launch``)."""

    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    # As many tokens at a time as there are (up to 2,048 logits), a warp per 256 logits: at
    # one token one warp routes in 5.6 us, where 16 tokens' rows over 4 warps took 7.7 (an
    # H200, 128 experts, top-8).
    block_e = triton.next_power_of_2(experts)
    block_t = min(triton.next_power_of_2(max(tokens, 1)), max(1, 2048 // block_e))
    pdl = pdl and pdl_here(router_logits)
    _route_kernel[(1,)](
        router_logits,
        weights,
        ids,
        tokens,
        experts,
        router_logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_E=block_e,
        PDL=pdl,
        num_warps=min(4, max(1, block_t * block_e // 256)),
        **launch_options(pdl),
    )
    return weights, ids


def align_torch(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align`` with torch's ops."""
    pairs = ids.numel()
    device = ids.device
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    length = _aligned_length(pairs, num_experts, block_m)
    sorted_pairs = torch.full((length,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, (ends - padded)[by_expert] + rank, order.int())
    tile_starts = torch.arange(0, length, block_m, device=device)
    tile_experts = torch.searchsorted(ends, tile_starts, right=True).int()
    return sorted_pairs, tile_experts, ends[-1:].int()


def _aligned_buffers(pairs: int, num_experts: int, block_m: int, device) -> tuple:
    length = _aligned_length(pairs, num_experts, block_m)
    return (
        torch.empty(length, dtype=torch.int32, device=device),
        torch.empty(length // block_m, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
    )


def align_triton(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align`` in one Triton launch (one program: for decode-sized routings)."""
    aligned = _aligned_buffers(ids.numel(), num_experts, block_m, ids.device)
    _align_kernel[(1,)](
        ids.reshape(-1),
        *aligned,
        ids.numel(),
        aligned[0].numel(),
        num_experts,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK=64,
        num_warps=4,
    )
    return aligned


@triton.jit
def _route(
    logits,
    weights,
    ids,
    tokens,
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Each token's softmax over its experts' logits (float32) and its TOP_K most probable
    experts, most probable first (renormalized to sum to 1 with RENORMALIZE): ``weights`` and
    ``ids`` [tokens, TOP_K]. BLOCK_T tokens at a time."""
    for start in range(0, tokens, BLOCK_T):
        _route_block(
            logits,
            weights,
            ids,
            start,
            tokens,
            num_experts,
            stride_t,
            TOP_K,
            RENORMALIZE,
            BLOCK_T,
            BLOCK_K,
            BLOCK_E,
        )


@triton.jit
def _route_block(
    logits,
    weights,
    ids,
    start,
    tokens,
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """``_route`` of tokens start..start + BLOCK_T; returns their [BLOCK_T, BLOCK_K] experts,
    -1 past the last token and slot."""
    e = tl.arange(0, BLOCK_E)
    slot = tl.arange(0, BLOCK_K)
    expert = (e < num_experts)[None, :]
    t = start + tl.arange(0, BLOCK_T)
    live = t < tokens
    ptrs = logits + t.to(tl.int64)[:, None] * stride_t + e[None, :]
    x = tl.load(ptrs, mask=live[:, None] & expert, other=0.0).to(tl.float32)
    x = tl.where(expert, x, float("-inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = tl.where(expert, p / tl.sum(p, 1)[:, None], -1.0)
    chosen_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    chosen_e = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, 1, tie_break_left=True).to(tl.int32)
        chosen_w = tl.where(slot[None, :] == j, tl.max(p, 1)[:, None], chosen_w)
        chosen_e = tl.where(slot[None, :] == j, best[:, None], chosen_e)
        p = tl.where(e[None, :] == best[:, None], -1.0, p)  # (taken)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, 1)[:, None]
    offs = t[:, None] * TOP_K + slot[None, :]
    mask = live[:, None] & (slot[None, :] < TOP_K)
    tl.store(weights + offs, chosen_w.to(weights.dtype.element_ty), mask=mask)
    tl.store(ids + offs, chosen_e, mask=mask)
    return tl.where(mask, chosen_e, -1)


@triton.jit(do_not_specialize=["tokens"])
def _route_kernel(
    logits,
    weights,
    ids,
    tokens,
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # (the logits are complete; the next kernel may start)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _route(
        logits,
        weights,
        ids,
        tokens,
        num_experts,
        stride_t,
        TOP_K,
        RENORMALIZE,
        BLOCK_T,
        BLOCK_K,
        BLOCK_E,
    )


@triton.jit
def _experts_of(ids, start, pairs, BLOCK: tl.constexpr):
    """Pairs start..start + BLOCK: their indices and experts (-1 past the last pair)."""
    offs = start + tl.arange(0, BLOCK)
    return offs, tl.load(ids + offs, mask=offs < pairs, other=-1).to(tl.int32)


# (the pair counts vary step to step: no variant compiled per their divisibility while serving;
# launched alone by align_triton, and called by _route_align_kernel)
@triton.jit(do_not_specialize=["pairs", "length"])
def _align_kernel(
    ids,
    sorted_pairs,
    tile_experts,
    used,
    pairs,
    length,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: count each expert's pairs, lay the padded runs out (a prefix sum), name
    each tile's expert, then place every pair at its expert's start plus its rank among the
    expert's earlier pairs (BLOCK pairs at a time, a one-hot [BLOCK, BLOCK_E] per chunk)."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, pairs, BLOCK):
        _, x = _experts_of(ids, start, pairs, BLOCK)
        counts += tl.sum((x[:, None] == e[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(used, tl.sum(padded, 0))
    for start in range(0, length // BLOCK_M, BLOCK):
        tile = start + tl.arange(0, BLOCK)
        before = (ends[None, :] <= (tile * BLOCK_M)[:, None]) & (e[None, :] < num_experts)
        tl.store(tile_experts + tile, tl.sum(before.to(tl.int32), 1), mask=tile < length // BLOCK_M)
    for start in range(0, length, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(sorted_pairs + offs, tl.zeros([BLOCK], dtype=tl.int32) + pairs, mask=offs < length)
    tl.debug_barrier()  # (the padding is written before any pair lands on it)
    placed = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, pairs, BLOCK):
        offs, x = _experts_of(ids, start, pairs, BLOCK)
        onehot = (x[:, None] == e[None, :]).to(tl.int32)
        rank = tl.sum((tl.cumsum(onehot, 0) - onehot) * onehot, 1)
        base = tl.sum(onehot * (starts + placed)[None, :], 1)
        tl.store(sorted_pairs + base + rank, offs, mask=offs < pairs)
        placed += tl.sum(onehot, 0)


@triton.jit(do_not_specialize=["tokens", "pairs", "length"])
def _count_kernel(
    logits,
    weights,
    ids,
    counts,
    sorted_pairs,
    tokens,
    pairs,
    length,
    num_experts,
    stride_t,
    ROUTE: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The parallel alignment's first launch. With ROUTE a program routes tokens
    pid * BLOCK_T.. (``_route_block``), else it reads pairs pid * BLOCK.. of ``ids``; it adds
    its pairs' experts to ``counts`` [0] (one atomic add an expert it saw) and fills its share
    of ``sorted_pairs`` with the padding (``pairs``), which the placement overwrites."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    if ROUTE:
        chosen = _route_block(
            logits,
            weights,
            ids,
            pid * BLOCK_T,
            tokens,
            num_experts,
            stride_t,
            TOP_K,
            RENORMALIZE,
            BLOCK_T,
            BLOCK_K,
            BLOCK_E,
        )
        x = tl.reshape(chosen, [BLOCK_T * BLOCK_K])
    else:
        _, x = _experts_of(ids, pid * BLOCK, pairs, BLOCK)
    seen = tl.sum((x[:, None] == e[None, :]).to(tl.int32), 0)
    tl.atomic_add(counts + e, seen, mask=seen > 0, sem="relaxed")  # (read by the next launch)
    padding = tl.zeros([BLOCK], dtype=tl.int32) + pairs
    for start in range(pid * BLOCK, length, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(sorted_pairs + offs, padding, mask=offs < length)


@triton.jit(do_not_specialize=["pairs", "length"])
def _place_kernel(
    ids,
    counts,
    sorted_pairs,
    tile_experts,
    used,
    pairs,
    length,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The parallel alignment's second launch: each program lays the padded runs out from
    ``counts`` [0] (a prefix sum), takes its places in each expert's run that its pairs
    pid * BLOCK.. need (an atomic add to ``counts`` [1]) and puts them there in their order;
    the programs share the tiles' experts; program 0 writes ``used``."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    count = tl.load(counts + e, mask=e < num_experts, other=0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    offs, x = _experts_of(ids, pid * BLOCK, pairs, BLOCK)
    onehot = (x[:, None] == e[None, :]).to(tl.int32)
    mine = tl.sum(onehot, 0)
    taken = tl.atomic_add(counts + num_experts + e, mine, mask=mine > 0, sem="relaxed")
    first = tl.where(mine > 0, ends - padded + taken, 0)
    rank = tl.sum((tl.cumsum(onehot, 0) - onehot) * onehot, 1)
    tl.store(sorted_pairs + tl.sum(onehot * first[None, :], 1) + rank, offs, mask=offs < pairs)
    tiles = length // BLOCK_M
    for start in range(pid * BLOCK, tiles, tl.num_programs(0) * BLOCK):
        tile = start + tl.arange(0, BLOCK)
        before = (ends[None, :] <= (tile * BLOCK_M)[:, None]) & (e[None, :] < num_experts)
        tl.store(tile_experts + tile, tl.sum(before.to(tl.int32), 1), mask=tile < tiles)
    if pid == 0:
        tl.store(used, tl.sum(padded, 0))


@triton.jit(do_not_specialize=["tokens", "length"])
def _route_align_kernel(
    logits,
    weights,
    ids,
    sorted_pairs,
    tile_experts,
    used,
    tokens,
    length,
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program routes the tokens (``_route``), then aligns the pairs it chose
    (``_align_kernel``, reading back the ids this program wrote)."""
    _route(
        logits,
        weights,
        ids,
        tokens,
        num_experts,
        stride_t,
        TOP_K,
        RENORMALIZE,
        BLOCK_T,
        BLOCK_K,
        BLOCK_E,
    )
    tl.debug_barrier()  # (every token's ids are written before the alignment reads them)
    pairs = tokens * TOP_K
    _align_kernel(
        ids, sorted_pairs, tile_experts, used, pairs, length, num_experts, BLOCK_M, BLOCK_E, BLOCK
    )
