"""The eager backend: runs a step program (program.py) with each op's torch reference
(photon_core/ops/*), for a decode step over the state cache's rows and for a prompt prefill
into one row. The CPU's backend, and fp32's, where the results must equal the reference path's
bit for bit: the ops are the reference's torch calls in the reference's order. The stateful
hybrid ops (gated attention, conv, delta rule) run through state_ops.py."""
from __future__ import annotations

import torch

from ..ops.decode_attention import (decode_attention_reference, decode_mask,
                                    prefill_attention_reference)
from ..ops.feedback_embedding import (FeedbackWeights, feedback_embedding_reference,
                                      token_embedding_reference)
from ..ops.eager import ACTS, run_ops
from ..ops.masked_argmax import masked_argmax_reference
from ..ops.rope import rope_angles, rope_perms, rope_tables
from ..ops.row_advance import row_advance_reference
from . import state_ops


def feedback_weights(spec, weights):
    """The feedback's tensors: FeedbackWeights for "region" (phases from the program's
    Feedback.by_phase), the token embedding for "token"."""
    fb = spec.program.feedback
    if fb.kind == "region":
        return FeedbackWeights(weights, spec.tables["coord"], spec.tables["size"],
                               dict(fb.weights), token_phase=fb.phase_of("token"),
                               size_phase=fb.phase_of("size"))
    if fb.kind == "token":
        return weights[dict(fb.weights)["wte"]]
    raise ValueError(f"unknown feedback kind {fb.kind!r}")


class EagerBackend:
    def __init__(self, spec, weights, kv, sdpa: bool):
        self.spec, self.program, self.w, self.kv = spec, spec.program, weights, kv
        a = self.program.attention
        self.sdpa = sdpa or a.n_heads != a.n_kv_heads
        dev = kv.data.device
        self.rope_perm = rope_perms(a.rot_dim, a.head_dim, dev)
        self.key_ids = torch.arange(kv.capacity, device=dev)
        self.layer_slot = {layer: i for i, layer in enumerate(self.program.kv_layers)}
        self.feedback = feedback_weights(spec, weights)
        self.hybrid = state_ops.uses_state_ops(self.program)
        self.plain_attention = any(op.kind == "attention" for op in self.program.ops)

    def run(self, ops, env: dict, attend=None, stateful=None) -> dict:
        if stateful is not None:
            stateful = {k: (lambda op, env, f=f: f(op, [env[s] for s in op.src]))
                        for k, f in stateful.items()}
        return run_ops(ops, env, self.w, attend, self.layer_slot, stateful)

    # -- a decode step ------------------------------------------------------------------
    def decoder(self, x: torch.Tensor, pos: torch.Tensor, b: int, attn_len: int,
                rows: torch.Tensor, offset: torch.Tensor | None = None,
                active: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, dim] at positions pos [b] through the program (k/v into the state cache;
        the hybrid ops: rotary at pos + offset, row states written for the active rows)."""
        a, kv = self.program.attention, self.kv
        stateful = None
        if self.hybrid:
            off = offset if offset is not None else torch.zeros_like(pos)
            stateful = state_ops.decode_ops(self.program, self.w, kv, rows, pos, off, active,
                                            attn_len)
        if self.plain_attention:
            rc, rs = rope_tables(pos, a.rot_dim, a.head_dim, a.theta)
            pos_w = pos.clamp(max=kv.capacity - 1)
            mask = decode_mask(pos, self.key_ids, attn_len, a.n_heads, x.dtype, self.sdpa)

            def attend(slot, qkv):
                return decode_attention_reference(
                    qkv, rows, pos_w, kv.data[slot, 0], kv.data[slot, 1], rc, rs,
                    self.rope_perm, mask, self.sdpa, a.n_heads, a.n_kv_heads, a.head_dim,
                    attn_len)
        else:
            attend = None
        return self.run(self.program.ops, {"x": x}, attend, stateful)["x"]

    def feed(self, st, b: int) -> torch.Tensor:
        """The next input embedding of each row, from what this step sampled (on the GPU)."""
        if self.program.feedback.kind == "region":
            return feedback_embedding_reference(self.feedback, st.out[:b], st.phase[:b])
        return token_embedding_reference(self.feedback, st.out[:b])

    def forward(self, st, b: int, attn_len: int) -> None:
        x = self.feed(st, b)
        hidden = self.decoder(x, st.pos[:b], b, attn_len, st.row_ids[:b], st.pos_offset[:b],
                              st.active[:b])
        row_advance_reference(hidden, st.hidden[:b], st.active[:b], st.pos[:b], st.phase[:b],
                              st.kind[:b], st.first[:b], st.phase_next)

    def head_logits(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        h = self.program.head(name)
        return self.run(h.ops, {"hidden": hidden})[h.logits]

    def head_pick(self, name: str, st, b: int) -> None:
        """Greedy pick of a head into st.out (the answer-marker rule for the lm head)."""
        h = self.program.head(name)
        logits = self.head_logits(name, st.hidden[:b])
        if h.mask_answer and self.spec.answer_id is not None:
            masked_argmax_reference(logits, st.out, h.col, h.segments, self.spec.answer_id,
                                    st.phase[:b], st.first[:b], self.spec.answer_phase)
        else:
            masked_argmax_reference(logits, st.out, h.col, h.segments)

    # -- a prompt prefill into one row ----------------------------------------------------
    def prefill(self, x: torch.Tensor, row: torch.Tensor, pos: torch.Tensor,
                offset=None, n_valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, dim] (the prompt's embeddings) at positions pos [T] of row `row` ([1]);
        offset: the row's rotary offset ([1] or None), n_valid: real tokens ([1] or None:
        all; padding after them never reaches a recurrent state)."""
        a, kv = self.program.attention, self.kv
        stateful = attend = None
        if self.hybrid:
            stateful = state_ops.prefill_ops(self.program, self.w, kv, row, pos,
                                             0 if offset is None else offset, n_valid)
        if self.plain_attention:
            cos, sin = rope_angles(pos, a.rot_dim, a.theta)
            pos_w = pos.clamp(max=kv.capacity - 1)
            mask_add = prefill_mask(pos, self.key_ids)

            def attend(slot, qkv):
                return prefill_attention_reference(qkv, row, pos_w, kv.data[slot, 0],
                                                   kv.data[slot, 1], cos, sin, mask_add,
                                                   a.n_heads, a.n_kv_heads, a.head_dim)
        return self.run(self.program.ops, {"x": x}, attend, stateful)["x"]


def prefill_mask(pos: torch.Tensor, key_ids: torch.Tensor) -> torch.Tensor:
    """Additive fp32 [T, capacity]: key <= the token's position."""
    return torch.zeros(pos.shape[0], key_ids.shape[0], device=pos.device,
                       dtype=torch.float32).masked_fill(key_ids[None, :] > pos[:, None],
                                                        float("-inf"))


__all__ = ["ACTS", "EagerBackend", "feedback_weights", "prefill_mask"]
