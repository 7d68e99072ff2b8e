"""ops/row_setup.py: a row's set-up for a new task in one launch (the Triton kernel, the
interpreter on the CPU) against its torch reference, field by field; the other rows untouched."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                and not torch.cuda.is_available(),
                                reason="CPU tensors need TRITON_INTERPRET=1")

FIELDS = ("hidden", "pos", "pos_offset", "phase", "kind", "first", "temperature", "top_p",
          "seed", "stopped", "stop_ids", "stop_phases")


def _state(rows: int, dim: int, dtype, dev, seed: int):
    """StepState's per-row tensors (its dtypes), filled with junk a set-up must overwrite."""
    from photon_core.ops.row_stop import MAX_STOP_IDS
    g = torch.Generator().manual_seed(seed)

    def ints(*shape, dt=torch.long):
        return torch.randint(-50, 50, shape, generator=g).to(dt).to(dev)
    return SimpleNamespace(
        hidden=torch.randn(rows, dim, generator=g).to(dtype).to(dev), pos=ints(rows),
        pos_offset=ints(rows), phase=ints(rows), kind=ints(rows),
        first=torch.zeros(rows, dtype=torch.bool, device=dev),
        temperature=torch.rand(rows, generator=g).to(dev),
        top_p=torch.rand(rows, generator=g).to(dev), seed=ints(rows),
        stopped=torch.ones(rows, dtype=torch.int32, device=dev),
        stop_ids=ints(rows, MAX_STOP_IDS), stop_phases=ints(rows, dt=torch.int32))


def _clone(st):
    return SimpleNamespace(**{k: getattr(st, k).clone() for k in FIELDS})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [
    dict(row=0, pos=731, phase=1, kind=1, temperature=0.0, top_p=1.0, seed=None, offset=0,
         stop_ids=(50256,), stop_phases=1 << 1),
    dict(row=2, pos=12, phase=0, kind=0, temperature=0.7, top_p=0.9, seed=2 ** 40 + 3,
         offset=-5, stop_ids=(7, 8, 9, 10, 11), stop_phases=1),
    dict(row=3, pos=0, phase=2, kind=0, temperature=1.5, top_p=0.25, seed=17, offset=4,
         stop_ids=(), stop_phases=1),
])
def test_row_setup_matches_reference(dtype, case):
    from photon_core.ops.row_setup import row_setup, row_setup_reference
    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    dim = 1500                                   # two blocks of 1024, the last one partial
    st = _state(4, dim, dtype, dev, seed=case["row"])
    ref = _clone(st)
    src = torch.randn(1, dim, generator=torch.Generator().manual_seed(9)).to(dev)  # fp32
    args = {k: v for k, v in case.items() if k != "row"}
    row_setup(st, case["row"], src, **args)
    row_setup_reference(ref, case["row"], src, **args)
    for k in FIELDS:
        assert torch.equal(getattr(st, k), getattr(ref, k)), k
    r = case["row"]
    assert st.first[r] and st.stopped[r] == 0 and st.pos[r] == case["pos"]
    assert torch.equal(st.hidden[r], src[0].to(dtype))
    ids = list(case["stop_ids"])[:4]
    assert st.stop_ids[r].tolist() == ids + [-1] * (4 - len(ids))
    assert st.stop_phases[r] == (case["stop_phases"] if ids else 0)
    if case["seed"] is not None:
        assert st.seed[r] == case["seed"]
    other = [i for i in range(4) if i != r]
    fresh = _state(4, dim, dtype, dev, seed=case["row"])       # the junk before the set-up
    for k in FIELDS:
        assert torch.equal(getattr(st, k)[other], getattr(fresh, k)[other]), k
