"""The experts of a few tokens row by row (``moe_rows``) against float64 torch: shapes that no
tile divides, top-1 to top-8, an expert chosen by several tokens, the router's choice through
the routing launch, the dispatch from ``routed_moe``, and on the GPU bf16 and a CUDA graph
replayed with other logits. GPU-marked; with TRITON_INTERPRET=1 (float32) it also runs on the
CPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from test_moe_triton import reference  # (float64, a token and a slot at a time)

from nano_models.layers.moe import moe_torch, route
from nano_models.layers.moe_routing import route_triton
from nano_models.layers.moe_rows import ROWS_TOKENS, moe_rows, routed_moe_rows

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cpu" and not INTERPRET, reason="needs a CUDA GPU (or TRITON_INTERPRET=1)"
    ),
]
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def problem(tokens, experts, inter, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return (t.to(DEVICE, dtype) for t in (x, w13, w2))


def tolerance(dtype) -> dict:
    return {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


CASES = [  # tokens, experts, intermediate, hidden, top_k, tiles
    (1, 8, 32, 64, 2, ((16, 32, 4), (16, 32, 4))),
    (1, 16, 40, 72, 1, ((16, 32, 4), (8, 16, 2))),  # (no tile divides 40 or 72)
    (2, 8, 24, 48, 8, ((8, 16, 2), (16, 64, 4))),  # (every expert chosen by both tokens)
    (3, 6, 48, 300, 4, ((32, 128, 4), (32, 16, 4))),
    (4, 128, 16, 32, 8, ((16, 256, 4), (16, 256, 4))),  # (tiles larger than the shapes)
    (1, 16, 768, 64, 8, (None, None)),  # (the default tiles: rows of 768 in three slices)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,inter,hidden,top_k,tiles", CASES)
def test_the_experts_of_a_few_tokens_match_float64(
    tokens, experts, inter, hidden, top_k, tiles, dtype
):
    x, w13, w2 = problem(tokens, experts, inter, hidden, dtype, seed=tokens + experts)
    g = torch.Generator().manual_seed(7)
    ids = torch.topk(torch.rand(tokens, experts, generator=g), top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    out = moe_rows(x, w13, w2, weights.to(DEVICE), ids.to(DEVICE, torch.int32), *tiles)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(
        out.double().cpu(), reference(x, w13, w2, weights, ids), **tolerance(dtype)
    )


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (3, 60, 4), (40, 128, 8)])
def test_the_routing_launch_chooses_as_torch_does(tokens, experts, top_k):
    """(40 tokens of 128 experts: more than one pass of the program's tokens)"""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    weights, ids = route_triton(logits.to(DEVICE), top_k, True, torch.float32)
    want_w, want_ids = route(logits, top_k, True, torch.float32)
    assert ids.dtype == torch.int32 and ids.long().cpu().tolist() == want_ids.tolist()
    torch.testing.assert_close(weights.cpu(), want_w)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_routers_choice_through_the_routing_launch(renormalize):
    x, w13, w2 = problem(3, 16, 32, 64, torch.float32, seed=1)
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, ids = route(logits, 4, renormalize, torch.float32)
    torch.testing.assert_close(
        routed_moe_rows(x, logits, w13, w2, 4, renormalize),
        moe_torch(x, w13, w2, weights, ids),
        atol=1e-4,
        rtol=1e-4,
    )


def test_no_token_gives_an_empty_output():
    x, w13, w2 = problem(0, 8, 16, 32, torch.float32, seed=3)
    ids = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    assert moe_rows(x, w13, w2, torch.zeros(0, 2, device=DEVICE), ids).shape == (0, 32)


def test_weights_not_contiguous_along_their_input_are_refused():
    x, w13, w2 = problem(1, 4, 16, 32, torch.float32, seed=4)
    ids = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous along their input"):
        moe_rows(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, torch.ones(1, 2), ids)


def test_routed_moe_takes_the_rows_up_to_rows_tokens(monkeypatch):
    import nano_models.layers.moe_rows as rows
    from nano_models.layers.moe_triton import routed_moe

    calls = []
    real = rows.routed_moe_rows
    monkeypatch.setattr(
        rows, "routed_moe_rows", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k)
    )
    for tokens in (ROWS_TOKENS, ROWS_TOKENS + 1):
        x, w13, w2 = problem(tokens, 8, 32, 64, torch.float32, seed=tokens)
        logits = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        weights, ids = route(logits, 2, True, torch.float32)
        torch.testing.assert_close(
            routed_moe(x, logits, w13, w2, 2, True),
            moe_torch(x, w13, w2, weights, ids),
            atol=1e-4,
            rtol=1e-4,
        )
    assert calls == [ROWS_TOKENS]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("tokens", [1, ROWS_TOKENS])
def test_a_cuda_graph_replays_the_rows_of_other_logits(tokens):
    experts, inter, hidden, top_k = 128, 768, 2048, 8
    x, w13, w2 = problem(tokens, experts, inter, hidden, torch.bfloat16, seed=6)
    logits = torch.randn(tokens, experts, device=DEVICE, dtype=torch.bfloat16)
    routed_moe_rows(x, logits, w13, w2, top_k, True)  # (compiled before capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_moe_rows(x, logits, w13, w2, top_k, True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits) * 4)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(
            out, routed_moe_rows(x, logits, w13, w2, top_k, True), atol=0, rtol=0
        )
        weights, ids = route(logits, top_k, True, torch.float32)
        want = reference(x, w13, w2, weights, ids.cpu())
        torch.testing.assert_close(out.double().cpu(), want, atol=3e-2, rtol=3e-2)
