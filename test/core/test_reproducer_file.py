"""megakernel_backend.reproducer_file: during a megakernel build Triton's compiler writes the
MLIR reproducer of a failing pass pipeline to files, not to stderr (session 23: one failed
hybrid build printed ~3000 lines of IR over the log), and the files go when the build
succeeds. A real sm_90 compile (no GPU: Triton's bundled ptxas, in a subprocess without
TRITON_INTERPRET) checks that the installed Triton honours the variable."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from photon_core.megakernel.megakernel_backend import reproducer_file, reproducers

ROOT = Path(__file__).resolve().parents[2]


def test_files_removed_after_a_build_kept_after_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_REPRODUCER_PATH", "/elsewhere")
    prefix = str(tmp_path / "mk")
    with reproducer_file(prefix) as p:
        assert os.environ["TRITON_REPRODUCER_PATH"] == p == prefix
        Path(prefix + ".make_ttir.repro.mlir").write_text("module {}")   # as the compiler
    assert os.environ["TRITON_REPRODUCER_PATH"] == "/elsewhere"
    assert not list(tmp_path.iterdir()) and reproducers(prefix) == ""
    monkeypatch.delenv("TRITON_REPRODUCER_PATH")
    with pytest.raises(RuntimeError, match="PassManager"):
        with reproducer_file(prefix):
            Path(prefix + ".make_ttgir.repro.mlir").write_text("module {}")
            raise RuntimeError("PassManager::run failed")
    assert "TRITON_REPRODUCER_PATH" not in os.environ
    assert reproducers(prefix) == \
        f" (the compiler's reproducer: {prefix}.make_ttgir.repro.mlir)"


COMPILE = r"""
import os, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from photon_core.megakernel.megakernel_backend import reproducer_file

@triton.jit
def k(x_ptr, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

prefix = sys.argv[1]
with reproducer_file(prefix):
    triton.compile(ASTSource(k, {"x_ptr": "*fp32", "n": "i32", "B": "constexpr"}, {"B": 64}),
                   target=GPUTarget("cuda", 90, 32))
    print("inside:", sorted(os.listdir(os.path.dirname(prefix))))
print("after:", sorted(os.listdir(os.path.dirname(prefix))))
"""


def test_the_installed_triton_writes_its_reproducers_there(tmp_path):
    from test_sm90_resources import _ptxas
    if not _ptxas():
        pytest.skip("Triton's bundled ptxas not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")        # a compile, not a cache hit
    (tmp_path / "out").mkdir()
    script = tmp_path / "compile_one.py"          # (jit functions need a source file)
    script.write_text(COMPILE)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "out" / "mk")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    inside = next(ln for ln in p.stdout.splitlines() if ln.startswith("inside:"))
    assert "mk.make_ttir.repro.mlir" in inside, p.stdout
    assert p.stdout.splitlines()[-1] == "after: []", p.stdout
