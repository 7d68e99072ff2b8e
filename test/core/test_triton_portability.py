"""Code the GPU machine's Triton (3.6) refuses although the newer one here compiles it: no
`@triton.jit` function in photon_core gives a parameter a str default. Triton 3.6 does not make
a nested jit function's str default a constexpr ("'str' object has no attribute 'type'" at
compile: session 23, the cache modifier of the shared op bodies); pass the value at the call."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "photon_core"


def _jit_functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def str_defaults(source: str) -> list[str]:
    """`name(param)` of every jit function's parameter whose default is a str literal."""
    out = []
    for fn in _jit_functions(ast.parse(source)):
        a = fn.args
        params = (a.posonlyargs + a.args)[-len(a.defaults):] if a.defaults else []
        pairs = list(zip(params, a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
        out += [f"{fn.name}({p.arg})" for p, d in pairs
                if isinstance(d, ast.Constant) and isinstance(d.value, str)]
    return out


def test_the_check_finds_a_str_default():
    src = ("import triton\nimport triton.language as tl\n@triton.jit\n"
           "def f(x, CM: tl.constexpr = ''):\n    pass\n"
           "@triton.jit\ndef g(x, CM: tl.constexpr):\n    pass\n")
    assert str_defaults(src) == ["f(CM)"]


def test_no_jit_function_has_a_str_default():
    bad = [f"{p.relative_to(ROOT.parent)}: {name}" for p in sorted(ROOT.rglob("*.py"))
           for name in str_defaults(p.read_text())]
    assert not bad, bad
