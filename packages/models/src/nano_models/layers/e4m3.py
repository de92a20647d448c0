"""e4m3 (FP8) values read as 32-bit words of four and widened in registers, in Triton: FP8
weights in the few-row products (``gemv``) and the MoE rows kernels (``moe_rows``).

Triton's own conversion of an e4m3 tile takes each word apart byte by byte and packs pairs
again (7.6 instructions a value in a product's loop on sm_90); PTX converts two values in one
``cvt.rn.f16x2.e4m3x2`` (4.5 a value, widened to float32 after)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_quads(words, ASM: tl.constexpr):
    """int32 words [N, W] of four e4m3 values each (the first in the lowest byte) as four fp16
    tiles [N, W]: the words' bytes 0, 1, 2 and 3, exact (to be widened further, each, before
    ``in_order``). With ASM (NVIDIA's PTX; not ROCm, not Triton's interpreter) by two
    ``cvt.rn.f16x2.e4m3x2`` a word."""
    if ASM:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            .reg .b32 pair0, pair1;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 pair0, lo;
            cvt.rn.f16x2.e4m3x2 pair1, hi;
            mov.b32 {$0, $1}, pair0;
            mov.b32 {$2, $3}, pair1;
            }""",
            constraints="=h,=h,=h,=h,r",
            args=[words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        v0 = _byte(words, 0)
        v1 = _byte(words, 8)
        v2 = _byte(words, 16)
        v3 = _byte(words, 24)
    return v0, v1, v2, v3


@triton.jit
def in_order(v0, v1, v2, v3):
    """Four tiles [N, W] of the words' bytes 0-3 as one [N, 4 W], in the words' order."""
    # (value i + 2 j of a word at [..., j, i]: in order when the last three dims merge)
    quads = tl.join(tl.join(v0, v2), tl.join(v1, v3))
    return tl.reshape(quads, [v0.shape[0], v0.shape[1] * 4])


@triton.jit
def _byte(words, shift: tl.constexpr):
    """The e4m3 value at bits shift .. shift + 7 of int32 words, in fp16."""
    byte = ((words >> shift) & 0xFF).to(tl.uint8)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
