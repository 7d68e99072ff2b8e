"""triton and triton.language when importable; else stand-ins that let the op files import
(their torch references work, their kernels cannot run: HAVE_TRITON is False)."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False
    tl = None

    class _NoTriton:
        @staticmethod
        def jit(fn=None, **_kw):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, int(n) - 1).bit_length()

    triton = _NoTriton()
