"""The Triton launches fit the H200 (sm_90): compiled ahead of time on the CPU with Triton's
bundled ptxas (bench/compile_sm90.py, ops/launch_resources.py; nothing runs), every launch of
Gemma 4's fused step executor at E2B shapes (bf16 and fp32) and of the Qwen 3.5 kernels at
test_real_sizes_on_gpu's sizes (fp32/fp16/bf16; with the fast encode's conv prefill and delta-rule prep) and of
Gemma 4's fast vision tower, and Moondream 2's fused step, compiles and asks for at most
232,448 bytes of shared
memory per block (the H200 refused 280,576 and 296,960 before the fixes). The Gemma
executor's launches also compile without register spills, and in fp32 without TF32 math
(tl.dot's GPU default, which the interpreter does not emulate: it moved the fp32 tiny model's
logits by 0.022 on the H200, test_gemma4_gpu.py's fused case).

The compile runs in a subprocess (the test session imports the kernels under
TRITON_INTERPRET=1). Skipped where Triton's ptxas is missing. ~1-2 min on 2 CPU cores."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ptxas() -> bool:
    try:
        from photon_core.ops.launch_resources import ptxas_available
        return ptxas_available()
    except Exception:  # noqa: BLE001
        return False


pytestmark = pytest.mark.skipif(not _ptxas(), reason="Triton's bundled ptxas not available")


def _compile(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "compile_sm90.py"), "--json",
                        *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=850)
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("[")), None)
    assert line is not None, p.stderr[-3000:]
    return json.loads(line)


def _report(rows):
    return "\n".join(f"{r['dtype']} shared {r['shared']} spill {r['spill']} {r['launch']} "
                     f"{r['error'] or ''}" for r in rows)


def test_gemma4_fused_executor_fits_sm90():
    # E2B widths (hidden 1536, MLP 6144 / 12288, heads 256 / 512, PLE 256, vocab 262144) with
    # 10 layers (2 global, 4 KV-shared) instead of 35: the same distinct launches, fewer repeats
    rows = _compile("--what", "gemma4", "--dtype", "bf16,fp32", "--layers", "10",
                    "--kv-shared", "4", "--b", "1,4,16")
    names = {r["kernel"] for r in rows}
    assert {"_rows_decode_split_kernel", "_rows_combine_kernel", "_gemv_kernel",
            "_norm_rotary_kernel", "_rmsnorm_residual_kernel",
            "_softcap_kernel", "_argmax_kernel", "_argmax_merge_kernel"} <= names, names
    # the global layers' 512-wide heads are among them
    assert any("_rows_decode_split_kernel" in r["launch"] and "D=512" in r["launch"]
               for r in rows)
    bad = [r for r in rows if not r["fits"]]
    assert not bad, _report(bad)
    spills = [r for r in rows if r["spill"]]
    assert not spills, _report(spills)
    tf32 = [r for r in rows if r["dtype"] == "fp32" and r["tf32"]]
    assert not tf32, _report(tf32)


def test_qwen3_5_real_size_kernels_fit_sm90():
    rows = _compile("--what", "qwen3_5", "--dtype", "fp32,fp16,bf16")
    assert {r["dtype"] for r in rows} == {"fp32", "fp16", "bf16"}
    assert {"_gdr_chunk_scan_kernel", "_causal_conv1d_prefill_kernel",
            "_gdr_fast_prep_kernel", "_gdr_chunk_states_kernel",
            "_gdr_chunk_out_kernel"} <= {r["kernel"] for r in rows}
    bad = [r for r in rows if not r["fits"]]
    assert not bad, _report(bad)


def test_gemma4_encode_kernels_compile_for_sm90():
    """The fast vision tower's q / k norm + axial rotary (halves=2) compiles for sm_90 (the
    interpreter does not apply the compiler's rules: a name rebound to another shape in a
    branch compiles nowhere but there - what session 16's conv prefill kernel did on the
    H200 first) and fits, without spills."""
    rows = _compile("--what", "gemma4_encode", "--dtype", "bf16,fp32")
    assert {r["kernel"] for r in rows} == {"_norm_rotary_kernel"}
    bad = [r for r in rows if not r["fits"] or r["spill"]]
    assert not bad, _report(bad)


def test_moondream_encode_kernels_fit_sm90():
    """The fast encode's Triton kernels (rope_kv_write, add + LayerNorm, the vision
    attention's Triton configs and, where Triton has Gluon, the Gluon kernel's) at real
    shapes: they fit, without spills."""
    from photon_core.ops.vision_attention_gluon import HAVE_GLUON
    rows = _compile("--what", "moondream_encode", "--dtype", "bf16,fp32")
    names = {r["kernel"] for r in rows}
    assert {"_rope_kv_write_kernel", "_add_layernorm_kernel",
            "_vision_attention_kernel"} <= names
    assert ("_vision_attention_gluon_kernel" in names) == HAVE_GLUON
    assert ("_vision_attention_wg_kernel" in names) == HAVE_GLUON
    bad = [r for r in rows if not r["fits"] or r["spill"]]
    assert not bad, _report(bad)


def test_moondream_fused_step_fits_sm90_and_fingerprints_its_code():
    """Every launch of Moondream 2's fused step at its real shapes (decode at 1 / 2 / 8 rows,
    default and deterministic mode, PDL edges, TMA weight tiles, a 16-token prompt prefill)
    compiles for sm_90
    without spills and fits; each has a machine-code fingerprint, the same for the launches
    whose constexprs differ only in what the kernel does not compile differently (the
    attention's ORDERED flag: the split kernel has no merge of its own), and different for
    different kernels."""
    rows = _compile("--what", "moondream", "--dtype", "bf16", "--sass")
    names = {r["kernel"] for r in rows}
    assert {"_gemv_kernel", "_attend_partial_kernel", "_combine_kernel", "_layernorm_kernel",
            "_argmax_kernel", "_prefill_attend_kernel"} <= names, names
    # the residual GEMV's weight tiles by TMA (a host TensorDescriptor argument), as on a
    # Hopper GPU at 2+ rows
    assert any(r["kernel"] == "_gemv_kernel" and "TMA=True" in r["launch"] for r in rows)
    bad = [r for r in rows if not r["fits"] or r["spill"]]
    assert not bad, _report(bad)
    attend = {}
    for r in rows:
        if r["kernel"] == "_attend_partial_kernel":
            attend.setdefault(r["launch"].replace("ORDERED=True", "ORDERED=False"),
                              set()).add(r["sass"])
    assert attend and all(len(v) == 1 for v in attend.values()), attend
    assert len({next(iter(v)) for v in attend.values()}) == len(attend)    # 64 / 128 keys
    assert len({r["sass"] for r in rows}) > len(names)


@pytest.mark.parametrize("family", ["qwen3.5", "gemma4"])
def test_hybrid_megakernel_compiles_for_sm90_without_spills(family):
    """The hybrid megakernel (megakernel/hybrid_kernel.py) at Qwen 3.5 0.8B's / Gemma 4 E2B's
    shapes, b=1 and 8, 8 warps: it compiles (the interpreter accepts code the compiler
    refuses, e.g. one name of two shapes in two branches) and keeps every register in the
    register file (no stack frame)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "compile_megakernel.py"),
                        "--hybrid", family, "--b", "1,8", "--variants", "auto/w8/s3"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=850)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("hybrid megakernel")]
    assert len(lines) == 2, p.stdout[-2000:] + p.stderr[-3000:]
    for ln in lines:
        assert "STACK:0 " in ln and "LOCAL:0 " in ln, ln
