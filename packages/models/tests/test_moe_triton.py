"""The fused MoE kernels against float64 torch: the alignment of pairs to tiles against a
brute-force model, the routing (softmax, top-k) fused with it against torch's, the two grouped
GEMMs (SiLU-and-mul in the first one's epilogue) on ragged expert loads (an expert with no token, a
single token, every token on one expert), every tile setting, and on the GPU inside a CUDA
graph replayed with other routings. GPU-marked; with TRITON_INTERPRET=1 (float32, small
shapes; Triton 3.6's interpreter needs numpy < 2.4) it also runs on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from nano_models.layers.moe import ExpertScales, moe_torch, route
from nano_models.layers.moe_routing import (
    align,
    align_parallel,
    align_torch,
    align_triton,
    route_align,
    route_align_parallel,
    route_align_triton,
)
from nano_models.layers.moe_tiles import as_kwargs, choose, rule
from nano_models.layers.moe_triton import fused_moe, routed_moe

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
    ),
]
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def routing(tokens: int, experts: int, top_k: int, kind: str, seed: int) -> torch.Tensor:
    """ids [tokens, top_k], distinct per token: random, skewed to few experts, or with the
    last expert never chosen."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        scores = torch.rand(tokens, experts, generator=g)
    elif kind == "skewed":  # most pairs on experts 0..top_k
        scores = torch.rand(tokens, experts, generator=g) + (torch.arange(experts) < top_k) * 10
    else:  # "unused": the last expert gets nothing
        scores = torch.rand(tokens, experts, generator=g)
        scores[:, -1] = -1
    return torch.topk(scores, top_k, dim=-1).indices.to(DEVICE)


def reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """float64, a token and a slot at a time."""
    x, w13, w2, weights = (t.double().cpu() for t in (x, w13, w2, weights))
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).split(inter)
            out[t] += weights[t, slot] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def weights_of(experts, inter, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def in_order(sorted_pairs: list[int], runs: list[int]) -> list[int]:
    """``sorted_pairs`` with each expert's run (lengths ``runs``) sorted: the parallel
    alignment places an expert's pairs in no set order."""
    out, start = [], 0
    for n in runs:
        out += sorted(sorted_pairs[start : start + n])
        start += n
    return out + sorted_pairs[start:]


@pytest.mark.parametrize(
    "how", [align_torch, align_triton, align_parallel], ids=["torch", "triton", "parallel"]
)
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize(
    "tokens,experts,top_k,kind",
    [
        (1, 8, 2, "random"),
        (5, 8, 8, "random"),
        (37, 16, 4, "skewed"),
        (64, 6, 2, "unused"),
        (50, 60, 8, "random"),  # (experts not a power of two; 400 pairs: 7 chunks)
        (300, 128, 8, "skewed"),  # (2,400 pairs: 38 programs of the parallel one, one expert's
        # pairs from all of them)
        (40, 600, 4, "random"),  # (1,024 experts' one-hots: 16 pairs a parallel program)
    ],
)
def test_align_sorts_pairs_by_expert_into_padded_tiles(tokens, experts, top_k, kind, block_m, how):
    ids = routing(tokens, experts, top_k, kind, seed=tokens + experts)
    sorted_pairs, tile_experts, used = (t.cpu() for t in how(ids, experts, block_m))
    pairs = tokens * top_k
    flat = ids.flatten().cpu().tolist()
    # Brute force: each expert's pairs in order, padded to a multiple of block_m.
    expected, owners, runs = [], [], []
    for e in range(experts):
        mine = [p for p in range(pairs) if flat[p] == e]
        if mine:
            run = mine + [pairs] * (-len(mine) % block_m)
            expected += run
            owners += [e] * (len(run) // block_m)
            runs.append(len(run))
    assert used.item() == len(expected)
    got = sorted_pairs[: len(expected)].tolist()
    assert (in_order(got, runs) if how is align_parallel else got) == expected
    assert (sorted_pairs[len(expected) :] == pairs).all()
    assert len(sorted_pairs) % block_m == 0
    assert len(sorted_pairs) >= pairs + min(experts, pairs) * (block_m - 1)
    assert tile_experts[: len(owners)].tolist() == owners
    assert (tile_experts[len(owners) :] == experts).all()


@pytest.mark.parametrize(
    "tokens,experts,top_k,renormalize",
    [
        (1, 8, 2, True),
        (5, 8, 8, False),  # every expert chosen
        (37, 16, 4, True),  # (chunks of tokens: 128 at 16 experts)
        (50, 60, 8, False),  # (experts not a power of two)
        (40, 128, 8, True),  # Qwen3-30B-A3B's router: 16 tokens a chunk
        (300, 128, 8, True),  # (2,400 pairs: many programs of the parallel one)
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "how", [route_align_triton, route_align_parallel], ids=["one program", "parallel"]
)
def test_route_align_chooses_as_torch_does(tokens, experts, top_k, renormalize, dtype, how):
    g = torch.Generator().manual_seed(tokens * experts + top_k)
    # Distinct logits in each row (steps of 0.05, exact enough in bf16: no two equal), so the
    # choice and its order are torch's; among equal ones any order is right.
    ranks = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)
    logits = (ranks * 0.05 - 3).to(DEVICE, dtype)
    block_m = 16
    weights, ids, aligned = how(logits, top_k, renormalize, dtype, block_m)
    want_w, want_ids = route(logits, top_k, renormalize, dtype)
    assert weights.dtype == dtype and weights.shape == ids.shape == (tokens, top_k)
    assert ids.long().cpu().tolist() == want_ids.cpu().tolist()
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), **tol)
    want = align_torch(want_ids, experts, block_m)
    got = aligned[0].cpu().tolist()
    if how is route_align_parallel:  # (an expert's pairs in no set order)
        tiles = aligned[1].cpu()
        runs = torch.bincount(tiles[tiles < experts], minlength=experts) * block_m
        got = in_order(got, runs[runs > 0].tolist())
    assert got == want[0].cpu().tolist()
    assert aligned[1].cpu().tolist() == want[1].cpu().tolist()  # (the tiles' experts)
    assert aligned[2].cpu().tolist() == want[2].cpu().tolist()  # (the length used)


def test_the_parallel_alignment_of_no_pair():
    ids = torch.empty(0, 4, dtype=torch.int64, device=DEVICE)
    assert align_parallel(ids, 16, 16)[2].item() == 0
    logits = torch.empty(0, 16, device=DEVICE)
    weights, ids, aligned = route_align_parallel(logits, 4, True, torch.float32, 16)
    assert weights.shape == ids.shape == (0, 4) and aligned[2].item() == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="long prefills: too slow for the interpreter")
@pytest.mark.parametrize("tokens,kind", [(8192, "skewed"), (16384, "random")])
def test_the_parallel_routing_of_a_long_prefill(tokens, kind):
    """A prefill chunk of up to max_num_batched_tokens (131,072 pairs of Qwen3-30B-A3B's
    router): the parallel launches, now taken past ONE_PROGRAM_PAIRS, route and align as
    torch's ops do (an expert's pairs in any order)."""
    experts, top_k, block_m = 128, 8, 64
    g = torch.Generator().manual_seed(tokens)
    ranks = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)
    if kind == "skewed":  # (three in four tokens choose among the first 16 experts)
        ranks[: tokens * 3 // 4, :16] += experts
    logits = (ranks * 0.05 - 3).to(DEVICE, torch.float32)
    weights, ids, aligned = route_align(logits, top_k, True, torch.float32, block_m)
    want_w, want_ids = route(logits, top_k, True, torch.float32)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    want = align_torch(want_ids, experts, block_m)
    assert torch.equal(aligned[1], want[1]) and torch.equal(aligned[2], want[2])
    tiles = aligned[1].cpu()
    runs = torch.bincount(tiles[tiles < experts], minlength=experts) * block_m
    got = in_order(aligned[0].cpu().tolist(), runs[runs > 0].tolist())
    assert got == want[0].cpu().tolist()


def test_route_align_of_a_strided_logits_view():
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    view = logits[:, :16]  # (rows 32 apart)
    weights, ids, _ = route_align_triton(view, 3, True, torch.float32, 16)
    want_w, want_ids = route(view, 3, True, torch.float32)
    assert ids.long().cpu().tolist() == want_ids.cpu().tolist()
    torch.testing.assert_close(weights, want_w)


def test_one_program_for_decode_many_for_long_prefills_torch_off_cuda(monkeypatch):
    import nano_models.layers.moe_routing as moe_routing

    ids = routing(40, 16, 4, "random", seed=1)
    calls = []
    for name in ("align_triton", "align_parallel", "align_torch"):
        monkeypatch.setattr(moe_routing, name, lambda *a, name=name: calls.append(name) or ())
    monkeypatch.setattr(moe_routing, "PARALLEL_ALIGN", True)
    monkeypatch.setattr(moe_routing, "ONE_PROGRAM_PAIRS", 160)
    align(ids, 16, 16)
    monkeypatch.setattr(moe_routing, "ONE_PROGRAM_PAIRS", 159)
    align(ids, 16, 16)
    monkeypatch.setattr(moe_routing, "PARALLEL_ALIGN", False)
    align(ids, 16, 16)
    cuda = ["align_triton", "align_parallel", "align_torch"]
    assert calls == (cuda if DEVICE == "cuda" else ["align_torch"] * 3)
    calls.clear()
    for name in ("route_align_triton", "route_align_parallel"):
        stub = lambda *a, name=name: calls.append(name) or (0, 0, 0)  # noqa: E731
        monkeypatch.setattr(moe_routing, name, stub)
    logits = torch.randn(40, 16, device=DEVICE)
    torch_ids = route_align(logits, 4, True, torch.float32, 16)[1]  # (159 at most in one program)
    monkeypatch.setattr(moe_routing, "PARALLEL_ALIGN", True)
    route_align(logits, 4, True, torch.float32, 16)
    monkeypatch.setattr(moe_routing, "ONE_PROGRAM_PAIRS", 160)
    route_align(logits, 4, True, torch.float32, 16)
    assert torch_ids.dtype == torch.int64  # (torch's topk)
    if DEVICE == "cuda":
        assert calls == ["align_torch", "route_align_parallel", "route_align_triton"]
    else:
        assert calls == ["align_torch"] * 3


CASES = [  # tokens, experts, intermediate, hidden, top_k, routing
    (1, 8, 32, 64, 2, "random"),
    (3, 8, 48, 64, 8, "random"),  # every expert chosen by each token
    (17, 16, 32, 96, 4, "skewed"),
    (40, 6, 64, 32, 2, "unused"),
]
if not INTERPRET:
    CASES += [(256, 128, 96, 256, 8, "random"), (512, 64, 192, 512, 6, "skewed")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,inter,hidden,top_k,kind", CASES)
def test_fused_moe_matches_float64(tokens, experts, inter, hidden, top_k, kind, dtype):
    g = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w13, w2 = weights_of(experts, inter, hidden, dtype, seed=experts)
    ids = routing(tokens, experts, top_k, kind, seed=tokens)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(DEVICE, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    want = reference(x, w13, w2, weights, ids)
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double().cpu(), want, **tol)
    # The torch path (the CPU's) agrees as well.
    torch.testing.assert_close(moe_torch(x, w13, w2, weights, ids).double().cpu(), want, **tol)


def e4m3_experts(w: torch.Tensor, block: int) -> tuple[torch.Tensor, ExpertScales, torch.Tensor]:
    """w [E, N, K] in e4m3 with a float32 scale a row and block of ``block`` columns (max|w| /
    448 of each; the last block may be short), and the float64 weight they stand for."""
    e, n, k = w.shape
    blocks = -(-k // block)
    padded = torch.zeros(e, n, blocks * block, dtype=torch.float64)
    padded[..., :k] = w.double().cpu()
    scale = padded.view(e, n, blocks, block).abs().amax(dim=-1) / 448
    full = scale.repeat_interleave(block, dim=-1)[..., :k]
    w8 = (w.double().cpu() / full).to(torch.float8_e4m3fn)
    scales = ExpertScales(scale.float().to(DEVICE), block)
    return (
        w8.to(DEVICE),
        scales,
        w8.double() * scale.float().double().repeat_interleave(block, dim=-1)[..., :k],
    )


@pytest.mark.parametrize("block", [32, 48, 128, "row"])
@pytest.mark.parametrize("tokens", [1, 3, 4, 37])
def test_e4m3_experts_match_float64(tokens, block):
    """Experts in e4m3 with a scale a row and block of input columns (an FP8 checkpoint's; 48
    leaves partial blocks; "row": quantization="fp8"'s one a row), through the router's path:
    the rows kernels up to ROWS_TOKENS tokens, the grouped GEMMs past them; against float64
    products of the weights they stand for, and the torch experts (the CPU's path)."""
    # (320 intermediate columns: the down product takes them in several tiles, the last one
    # partial, with blocks of 48 and 128 a partial block too)
    experts, inter, hidden, top_k = 8, 320, 256, 2
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w13, w2 = weights_of(experts, inter, hidden, torch.float32, seed=tokens + 1)
    w13_8, s13, dense13 = e4m3_experts(w13, hidden if block == "row" else block)
    w2_8, s2, dense2 = e4m3_experts(w2, inter if block == "row" else block)
    logits = torch.randn(tokens, experts, generator=g).to(DEVICE)
    weights, ids = route(logits, top_k, True, dtype)
    out = routed_moe(x, logits, w13_8, w2_8, top_k, True, scales=(s13, s2))
    want = reference(x, dense13, dense2, weights, ids)
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double().cpu(), want, **tol)
    torch.testing.assert_close(
        moe_torch(x, w13_8, w2_8, weights, ids, scales=(s13, s2)).double().cpu(), want, **tol
    )
    with pytest.raises(ValueError, match="e4m3 experts come with their scales"):
        routed_moe(x, logits, w13_8, w2_8, top_k, True)


@pytest.mark.parametrize("tile", sorted({rule(t, 2)[0] for t in (1, 100, 1000, 10_000)}))
def test_every_tile_setting_gives_the_same_result(tile):
    tokens, experts, inter, hidden, top_k = 24, 8, 64, 128, 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13, w2 = weights_of(experts, inter, hidden, torch.float32, seed=5)
    ids = routing(tokens, experts, top_k, "random", seed=9)
    weights = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    out = fused_moe(x, w13, w2, weights, ids, tiles=(as_kwargs(tile), as_kwargs(tile)))
    torch.testing.assert_close(
        out.double().cpu(), reference(x, w13, w2, weights, ids), atol=2e-4, rtol=2e-4
    )


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_routers_choice_through_the_kernels(renormalize):
    """routed_moe(): the block's path on the GPU, against route() then the torch experts."""
    tokens, experts, inter, hidden, top_k = 9, 8, 32, 64, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13, w2 = weights_of(experts, inter, hidden, torch.float32, seed=2)
    logits = torch.randn(tokens, experts, generator=g).to(DEVICE)
    weights, ids = route(logits, top_k, renormalize, x.dtype)
    torch.testing.assert_close(
        routed_moe(x, logits, w13, w2, top_k, renormalize),
        moe_torch(x, w13, w2, weights, ids),
        atol=1e-4,
        rtol=1e-4,
    )


def test_choose_falls_back_to_the_rule_for_unmeasured_shapes():
    up, down = choose(7, 3, 5, 11, 2, torch.float32)
    assert (up, down) == tuple(as_kwargs(t) for t in rule(7, 2))


@pytest.fixture(params=["default", "parallel", "torch"])
def alignment(request, monkeypatch):
    """The alignment as chosen, or at every size that aligns (past ``moe_rows.ROWS_TOKENS`` in
    ``routed_moe``) the parallel launches (an expert's pairs placed in no set order: the
    outputs must not depend on it, bit for bit) or torch's ops (where Triton is older than
    3.5)."""
    if request.param != "default":
        import nano_models.layers.moe_routing as moe_routing

        monkeypatch.setattr(moe_routing, "PARALLEL_ALIGN", request.param == "parallel")
        monkeypatch.setattr(moe_routing, "ONE_PROGRAM_PAIRS", 0)
    return request.param


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("tokens", [1, 32, 256])
def test_a_cuda_graph_replays_other_routings(tokens, alignment):
    experts, inter, hidden, top_k = 128, 96, 256, 8
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    w13, w2 = weights_of(experts, inter, hidden, torch.bfloat16, seed=4)
    ids = routing(tokens, experts, top_k, "random", seed=1)
    weights = torch.rand(tokens, top_k, device=DEVICE, dtype=torch.bfloat16)
    fused_moe(x, w13, w2, weights, ids)  # (compiled before capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed, kind in ((2, "random"), (3, "skewed"), (4, "unused")):
        ids.copy_(routing(tokens, experts, top_k, kind, seed))
        x.copy_(torch.randn_like(x))
        weights.copy_(torch.rand_like(weights))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids), atol=0, rtol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("tokens", [1, 32, 256])
def test_a_cuda_graph_replays_the_routing_of_other_logits(tokens, alignment):
    experts, inter, hidden, top_k = 128, 96, 256, 8
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device=DEVICE, dtype=torch.bfloat16)
    w13, w2 = weights_of(experts, inter, hidden, torch.bfloat16, seed=4)
    routed_moe(x, logits, w13, w2, top_k, True)  # (compiled before capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_moe(x, logits, w13, w2, top_k, True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits) * 4)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, routed_moe(x, logits, w13, w2, top_k, True), atol=0, rtol=0)
        weights, ids = route(logits, top_k, True, x.dtype)
        want = reference(x, w13, w2, weights, ids.cpu())
        torch.testing.assert_close(out.double().cpu(), want, atol=3e-2, rtol=3e-2)
