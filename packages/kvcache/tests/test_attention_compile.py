"""The decode kernel compiled for Hopper (sm_90a) without a GPU: Triton lowers it to PTX and
its bundled ptxas assembles it, so CI sees the variants a GPU would run (PTX the interpreter
cannot execute included)."""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton")


def decode_ptx(v_words: int, tmp_path) -> str:
    """PTX of the decode kernel over an FP8 cache under an fp16-dot bf16 q, at Qwen3-0.6B's
    heads (16 / 8, head_dim 128), block size 16, 4 programs a multiprocessor (128 registers)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nano_kvcache.attention import _decode_kernel

    constants = dict(
        BLOCK_SIZE=16, GROUP=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, KV_HEADS=8,
        NUM_SPLITS=1, ORDERED=True, PRECISION="tf32", F16_DOTS=True, V_WORDS=v_words, EARLY=1,
        LINES=1, PDL=True,
    )  # fmt: skip
    pointers = {"q_ptr": "*bf16", "k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv"}
    pointers |= {"block_tables": "*i32", "seq_lens": "*i32", "order": "*i32"}
    pointers |= {"out_ptr": "*bf16", "part_ml": "*fp32", "part_acc": "*fp32"}
    pointers |= {"scale_log2": "fp32", "v_scale": "fp32"}
    names = _decode_kernel.arg_names
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    unaligned = {"block_tables", "seq_lens", "order", "stride_bt", "scale_log2", "v_scale"}
    attrs = {  # (as a launch specializes the caches, q, the output and their strides)
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if n not in constants and n not in unaligned
    }
    source = ASTSource(
        _decode_kernel,
        signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs=attrs,
    )
    options = {"num_warps": 4, "num_stages": 2, "maxnreg": 128}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    (tmp_path / "kernel.ptx").write_text(ptx)
    report = subprocess.run(
        [triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", tmp_path / "kernel.ptx",
         "-o", tmp_path / "kernel.cubin"],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    assert " 0 bytes spill stores" in report, report
    return ptx


def test_fp8_v_read_as_words_takes_no_byte_from_shared_memory(tmp_path):
    """``FP8_V_WORDS``: V widened to fp16 in registers, then transposed by ldmatrix; read as
    bytes, the product's operand comes from shared memory a byte at a time."""
    words, as_bytes = decode_ptx(2, tmp_path), decode_ptx(0, tmp_path)
    assert "ld.shared.b8" in as_bytes and "ld.shared.b8" not in words
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in words
    assert "cvt.rn.f16x2.e4m3x2" in words
