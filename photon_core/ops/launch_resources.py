"""What a Triton launch costs the GPU, found without a GPU: record the kernel launches a piece
of code makes (the kernels are NOT run: outputs stay unwritten) and compile each distinct one
ahead of time for a GPU target (default sm_90, the H200) with Triton's bundled ptxas, reading
its registers, spills and shared memory. A launch the GPU would refuse (Triton's
OutOfResources: shared memory over the target's limit) is caught here, on the CPU.

    with record_launches() as launches:
        backend.forward(st, b, attn_len)           # CPU tensors of the real shapes and dtypes
    for r in compile_launches(launches):
        assert r.shared <= SM90_SHARED_LIMIT

What it cannot say: speed, or anything that depends on the values computed (nothing runs).
The signature mimics Triton's launch-time specialization (pointer dtypes, 16-byte alignment,
ints divisible by 16, ints equal to 1 as constants) closely enough for resource usage.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

SM90_SHARED_LIMIT = 232448        # bytes per block on sm_90 (Triton's "Hardware limit")

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
           torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
           torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl",
                   "launch_cooperative_grid")


@dataclass
class Launch:
    """One recorded launch: the kernel, its compile signature and options."""
    kernel: object                    # the JITFunction
    signature: dict                   # name -> Triton type string or "constexpr"
    constexprs: dict                  # name -> value
    attrs: dict                       # (index,) -> [["tt.divisibility", 16]]
    options: dict                     # num_warps, num_stages, ...
    grid: tuple = ()

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def key(self):
        return (self.name, tuple(sorted(self.signature.items())),
                tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
                tuple(sorted(self.attrs)), tuple(sorted(self.options.items())))

    def describe(self) -> str:
        c = ", ".join(f"{k}={v}" for k, v in self.constexprs.items())
        ptrs = ",".join(sorted({t for t in self.signature.values() if t.startswith("*")}))
        return f"{self.name}[{ptrs}]({c}; {self.options})"


@dataclass
class Resources:
    launch: Launch
    registers: int = 0
    spill: int = 0                    # bytes of stack + local memory per thread (spills)
    shared: int = 0                   # bytes of shared memory per block
    error: str | None = None
    tf32: bool = False                # the PTX has TF32 tensor-core math (fp32 dot, not ieee)
    sass_sha: str = ""                # sass_fingerprint of the compiled kernel
    raw: str = field(default="", repr=False)

    @property
    def fits(self) -> bool:
        return self.error is None and self.shared <= SM90_SHARED_LIMIT


def _type_of(v, specialize: bool):
    """(signature type, constexpr value or None, divisible by 16)."""
    if isinstance(v, torch.Tensor):
        return "*" + _DTYPES[v.dtype], None, v.data_ptr() % 16 == 0
    if v is None:
        return "constexpr", None, False
    if isinstance(v, bool):
        return "i1", None, False
    if isinstance(v, int):
        if specialize and v == 1:
            return "constexpr", 1, False
        t = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        return t, None, specialize and v % 16 == 0
    if isinstance(v, float):
        return "fp32", None, False
    if type(v).__name__ == "TensorDescriptor":     # a host descriptor (TMA): Triton's own
        from triton.runtime.jit import mangle_type  # "tensordesc<bf16[64, 128]>"
        return mangle_type(v), None, False
    raise TypeError(f"cannot record an argument of type {type(v).__name__}")


def _record(fn, grid, args, kwargs) -> Launch:
    py = fn.fn
    sig = inspect.signature(py)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAUNCH_OPTIONS}
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    dns = set()
    for d in getattr(fn, "do_not_specialize", ()) or ():
        dns.add(d if isinstance(d, str) else fn.arg_names[d])
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, v) in enumerate(bound.arguments.items()):
        p = fn.params[i]
        if p.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = v
            continue
        t, c, div = _type_of(v, name not in dns)
        signature[name] = t
        if t == "constexpr":
            constexprs[name] = c
        if div:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options.setdefault("num_warps", 4)
    options.setdefault("num_stages", 3)
    return Launch(fn, signature, constexprs, attrs, options, tuple(grid) if not callable(grid)
                  else ())


@contextmanager
def record_launches():
    """Inside: every `kernel[grid](...)` of a compiled-mode JITFunction is recorded and NOT
    run (TRITON_INTERPRET must be off when the kernels' modules were imported)."""
    from triton.runtime.jit import JITFunction
    launches: list[Launch] = []
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append(_record(self, grid, args, dict(kwargs)))
        return None
    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = orig


def distinct(launches: list[Launch]) -> list[Launch]:
    seen, out = set(), []
    for la in launches:
        k = la.key()
        if k not in seen:
            seen.add(k)
            out.append(la)
    return out


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's bundled cuobjdump with `flag` on a compiled kernel: its output."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(tool), flag, f.name], capture_output=True,
                              text=True).stdout
    finally:
        os.unlink(f.name)


def resource_line(cubin: bytes) -> str:
    """cuobjdump's resource line of a compiled kernel (REG, STACK / LOCAL = spills, SHARED)."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    return next((ln for ln in out.splitlines() if "REG" in ln), out[-200:])


def _field(line: str, name: str) -> int:
    for tok in line.replace(",", " ").split():
        if tok.startswith(name + ":"):
            return int(tok.split(":")[1])
    return 0


def sass_fingerprint(cubin: bytes) -> str:
    """A short hash of a compiled kernel's machine code (cuobjdump -sass: each instruction
    with its encoding, no line information): builds of code that moved between functions
    or files get the same fingerprint only where ptxas made the same instructions (the
    PTX alone is not enough: its line-information labels split blocks, and ptxas has
    scheduled the same PTX instructions into different registers with them moved)."""
    out = _cuobjdump(cubin, "-sass")
    code = [ln.split("*/", 1)[-1].strip() for ln in out.splitlines() if "/*" in ln]
    return hashlib.sha1("\n".join(code).encode()).hexdigest()[:12]


def compile_launch(la: Launch, arch: int = 90) -> Resources:
    """Compile one launch for sm_<arch> (a Triton or a Gluon kernel); shared memory from
    Triton's metadata (what the launch asks for), registers / spills from cuobjdump."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    source = ASTSource
    if type(la.kernel).__name__ == "GluonJITFunction":
        from triton.experimental.gluon._runtime import GluonASTSource as source
    try:
        k = triton.compile(source(la.kernel, la.signature, la.constexprs, attrs=la.attrs),
                           target=GPUTarget("cuda", arch, 32), options=dict(la.options))
    except Exception as e:  # noqa: BLE001 - reported, e.g. OutOfResources at compile time
        return Resources(la, error=f"{type(e).__name__}: {str(e)[:400]}")
    line = resource_line(k.asm["cubin"])
    return Resources(la, registers=_field(line, "REG"),
                     spill=_field(line, "STACK") + _field(line, "LOCAL"),
                     shared=int(k.metadata.shared), tf32=".tf32" in k.asm["ptx"],
                     sass_sha=sass_fingerprint(k.asm["cubin"]), raw=line.strip())


def compile_launches(launches: list[Launch], arch: int = 90) -> list[Resources]:
    return [compile_launch(la, arch) for la in distinct(launches)]


def ptxas_available() -> bool:
    """Triton's bundled ptxas and cuobjdump are there (the compile runs without a GPU)."""
    try:
        import triton
    except ImportError:
        return False
    b = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (b / "ptxas").exists() and (b / "cuobjdump").exists()
