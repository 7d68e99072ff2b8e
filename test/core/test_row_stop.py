"""ops/row_stop.py: the Triton kernel (interpreter on the CPU) against its torch reference,
and the rule: a stop token in a phase whose bit is set marks the row, for good."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                and not torch.cuda.is_available(),
                                reason="CPU tensors need TRITON_INTERPRET=1")


def _dev():
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def test_row_stop_kernel_matches_reference_and_is_sticky():
    from photon_core.ops.row_stop import MAX_STOP_IDS, row_stop, row_stop_reference
    dev = _dev()
    out = torch.zeros(5, 4, dtype=torch.long, device=dev)
    out[:, 0] = torch.tensor([7, 7, 3, 9, 7])
    phase = torch.tensor([0, 1, 0, 1, 1], device=dev)
    ids = torch.full((5, MAX_STOP_IDS), -1, dtype=torch.long, device=dev)
    ids[0, 0], ids[1, 1], ids[2, 0], ids[3, :2] = 7, 7, 7, torch.tensor([2, 9])
    # row 4: no stop ids (ignores eos) though it picked 7
    masks = torch.tensor([1, 1 << 1, 1, 1 << 1, 1 << 1], dtype=torch.int32, device=dev)
    masks[1] = 1                      # row 1's stop phase is 0, it is in phase 1: no stop
    stopped = torch.tensor([0, 0, 1, 0, 0], dtype=torch.int32, device=dev)
    want = row_stop_reference(out, phase, ids, masks, stopped.clone())
    got = row_stop(out, phase, ids, masks, stopped)
    assert torch.equal(got, want) and got is stopped
    assert want.tolist() == [1, 0, 1, 1, 0]          # row 2 was stopped already: stays
    out[:, 0] = 0                                     # later picks do not clear it
    assert row_stop(out, phase, ids, masks, stopped).tolist() == [1, 0, 1, 1, 0]


def test_set_row_writes_the_tasks_stops_and_clears_the_flag():
    from photon_core.engine import EngineOptions
    from photon_core.fast import decode_step as ds
    from photon_core.fast.static_kv_cache import StaticKVCache
    from photon_core.moondream.model import build_random_model
    from photon_core.moondream.test_model import tiny_config
    m = build_random_model(tiny_config(fast=True), device="cpu", dtype="fp32", seed=0)
    cfg = m.config.text
    kv = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, 2, 64, cfg.head_dim, "cpu", torch.float32)
    st = ds.StepState(m, 2, kv, EngineOptions(fused="off"))
    st.stopped[1] = 1
    st.set_row(1, st.hidden[0], 10, 1, 1, 0.0, 1.0, stop_ids=(5, 6), stop_phases=1 << 1)
    assert st.stopped[1].item() == 0 and st.stop_ids[1].tolist() == [5, 6, -1, -1]
    assert st.stop_phases[1].item() == 2
    st.set_row(1, st.hidden[0], 10, 1, 1, 0.0, 1.0)          # no stops: never stopped
    assert st.stop_ids[1].tolist() == [-1] * 4 and st.stop_phases[1].item() == 0
