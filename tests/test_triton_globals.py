"""Every global a Triton kernel reads is one Triton compiles.

Triton's interpreter (the CPU tests) reads any Python global, but the compiler takes only
modules, other jitted functions, ``triton.language`` names and ``tl.constexpr`` objects: a
global merely annotated ``tl.constexpr`` passes every CPU test and fails on the first GPU
launch. This walks each kernel's source and applies the compiler's rule.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import textwrap
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
pytest.importorskip("torch")

MODULES = [
    "nano_kvcache.attention.decode",
    "nano_kvcache.attention.prefill",
    "nano_kvcache.attention.tiles",
    "nano_models.layers.fp8_matmul",
    "nano_models.layers.e4m3",
    "nano_models.layers.fp8_quant",
    "nano_models.layers.gemv",
    "nano_models.layers.moe_routing",
    "nano_models.layers.moe_rows",
    "nano_models.layers.moe_triton",
    "nano_models.layers.rotary_triton",
    "nano_models.layers.triton_tiles",
    "nano_engine.gumbel",
]


def compilable(value) -> bool:
    """The compiler's rule for a global (triton/compiler/code_generator.py, global_lookup)."""
    return (
        isinstance(value, types.ModuleType | tl.constexpr | tl.dtype | triton.JITFunction)
        or getattr(value, "__triton_builtin__", False)
        or getattr(value, "__module__", "").startswith("triton.language")
    )


def kernels():
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, triton.JITFunction) and value.fn.__module__ == name:
                yield pytest.param(value, id=f"{name}.{attr}")


def unreadable_globals(kernel) -> list[str]:
    """The globals ``kernel``'s source reads that Triton's compiler refuses."""
    fn = kernel.fn
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    tree.body[0].decorator_list = []  # (the decorators run in Python, not in the kernel)
    args = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    stored = {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    bad = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name) or isinstance(node.ctx, ast.Store):
            continue
        name = node.id
        if name in args or name in stored or hasattr(builtins, name):
            continue
        if name in fn.__globals__ and not compilable(fn.__globals__[name]):
            bad.add(name)
    return sorted(bad)


@pytest.mark.parametrize("kernel", kernels())
def test_the_globals_a_kernel_reads_compile(kernel):
    assert not unreadable_globals(kernel)


_ANNOTATED: tl.constexpr = tl.PropagateNan.ALL  # (what the check must catch)
_CONSTEXPR = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _reads_an_annotated_global(x, y):
    a = tl.clamp(x, 0.0, 1.0, propagate_nan=_ANNOTATED)
    b = tl.clamp(y, 0.0, 1.0, propagate_nan=_CONSTEXPR)
    return a + b


def test_the_check_catches_an_annotated_global():
    assert unreadable_globals(_reads_an_annotated_global) == ["_ANNOTATED"]
