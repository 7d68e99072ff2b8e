"""The benches' CPU smoke modes still run: a bench that has rotted (an engine function's
signature changed under it) fails on the GPU machine, where device time is scarce -
bench/stream_probe.py had, unnoticed, for three sessions (its `_gemv_pipe` call had two
arguments too many). Each case runs one bench's --smoke (tiny random model or shapes, fp32,
the Triton interpreter; no timings are checked) in a process of its own and checks what it
says of its own results. The megakernel benches' smokes (bench_megakernel, race_megakernel:
~45 s each) and the transformers comparisons' (bench_gemma4, bench_qwen3_5: ~5 s each) are
left out for CI's time; test_megakernel*.py covers the megakernel benches' engine code."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _smoke(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1",
           "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def _number_after(text: str, label: str) -> float:
    m = re.search(re.escape(label) + r"\W*([-+0-9.eE]+)", text)
    assert m, f"{label!r} not in the output:\n{text[-2000:]}"
    return float(m.group(1))


def test_stream_probe_drives_the_megakernel_gemv():
    """Every streaming case (the megakernel's `_gemv_pipe` at 2 programs) computes right."""
    out = _smoke("stream_probe.py", "--smoke")
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "case" not in ln]
    assert len(rows) >= 8 and all(ln.rstrip().endswith("| True |") for ln in rows), out


def test_gemm_forms_probe_runs_every_form():
    out = _smoke("probe_gemm_forms.py", "--smoke")
    m = re.search(r"(\d+) forms, (\d+) failed", out)
    assert m and int(m.group(1)) > 50 and m.group(2) == "0", out[-2000:]


def test_merge_in_gemv_probe_matches_the_shipped_merge():
    assert _number_after(_smoke("probe_merge_in_gemv.py", "--smoke"),
                         "merged = shipped within") < 1e-4


def test_megakernel_field_diff_is_bitwise():
    out = _smoke("diag_megakernel.py", "--smoke")
    fields = [ln for ln in out.splitlines() if ln.startswith("field ")]
    assert len(fields) >= 5 and all("bitwise equal True" in ln for ln in fields), out


def test_crop_modes_bench_compares_the_modes():
    out = _smoke("bench_crop_modes.py", "--smoke")
    assert '"overlap:4"' in out and '"recall_at_0.5"' in out, out[-2000:]


@pytest.mark.parametrize("script", ["bench_qwen3_5_fast.py", "bench_gemma4_fast.py"])
def test_fast_path_benches_answer_as_the_reference(script):
    out = _smoke(script, "--smoke")
    assert ("fast == reference: True" in out) or ('"answer_equal": true' in out), \
        out[-2000:]

