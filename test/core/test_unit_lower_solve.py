"""ops/unit_lower_solve.py: the blocked substitution kernel against torch's triangular solve
(CPU: Triton's interpreter, fp32; the GPU at the encode's sizes: test_qwen3_5_kernels.py
test_real_sizes_on_gpu and the Qwen 3.5 fast-encode GPU tests)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from photon_core.ops.unit_lower_solve import (unit_lower_solve_reference,  # noqa: E402
                                              unit_lower_solve_triton)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("c,w,batch", [(16, 16, (1,)), (32, 40, (2, 3)), (64, 256, (2, 2)),
                                       (48, 7, (3,))])
def test_matches_the_triangular_solve(c, w, batch):
    """Only the strictly lower part of `a` counts (its diagonal and upper triangle are
    ignored, as unitriangular=True); entries of the delta rule's size (|L| < 1) and larger."""
    g = torch.Generator(device=DEV).manual_seed(c + w)
    for scale in (0.1, 0.5):
        a = torch.randn(*batch, c, c, generator=g, device=DEV) * scale
        a += torch.triu(torch.randn(c, c, generator=g, device=DEV) * 9)   # must be ignored
        r = torch.randn(*batch, c, w, generator=g, device=DEV)
        x = unit_lower_solve_triton(a, r)
        ref = unit_lower_solve_reference(a, r)
        assert x.shape == ref.shape and x.dtype == torch.float32
        err = (x - ref).abs().max().item()
        assert err <= 2e-5 * (1 + ref.abs().max().item()), (scale, err)
        # and it solves the system: (I + L) x = r
        low = torch.tril(a, -1) + torch.eye(c, device=DEV)
        resid = (low @ x - r).abs().max().item()
        size = (low.abs() @ x.abs()).max().item()        # the sums' magnitude (cancellation)
        assert resid <= 1e-5 * size, (resid, size)


@pytest.mark.parametrize("split", [64, 48, 16])
def test_split_outputs_are_the_columns_apart(split):
    """split: (X[..., :split], X[..., split:]) as two contiguous tensors - written apart by the
    kernel where split is a multiple of its 64-column block (64 here), else copied out of the
    whole X (48, 16)."""
    g = torch.Generator(device=DEV).manual_seed(split)
    a = torch.randn(2, 3, 64, 64, generator=g, device=DEV) * 0.2
    r = torch.randn(2, 3, 64, 128, generator=g, device=DEV)
    whole = unit_lower_solve_triton(a, r)
    u, w = unit_lower_solve_triton(a, r, split=split)
    assert u.is_contiguous() and w.is_contiguous()
    assert torch.equal(u, whole[..., :split]) and torch.equal(w, whole[..., split:])


def test_bad_inputs_are_refused():
    a, r = torch.zeros(2, 20, 20), torch.zeros(2, 20, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        unit_lower_solve_triton(a, r)
    with pytest.raises(ValueError):
        unit_lower_solve_triton(torch.zeros(2, 16, 16).double(), torch.zeros(2, 16, 8).double())
    with pytest.raises(ValueError):
        unit_lower_solve_triton(torch.zeros(2, 16, 16), torch.zeros(3, 16, 8))
    assert unit_lower_solve_triton(torch.zeros(0, 16, 16), torch.zeros(0, 16, 4)).shape == \
        (0, 16, 4)
