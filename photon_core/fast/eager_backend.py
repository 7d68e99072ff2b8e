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
from ..ops.logit_softcap import logit_softcap
from ..ops.per_layer_input import per_layer_input
from ..ops.row_advance import row_advance_reference
from ..ops.scaled_embedding import scale_tensor, scaled_embedding
from . import state_ops, window_state_ops


class ScaledTokenFeedback:
    """Feedback "scaled_token" (program.py): x = wte[id] * scale, and optionally one more
    segment = extra[id] * extra_scale (Gemma 4's per-layer token part; its table may live
    in host memory: ops/scaled_embedding.py)."""

    def __init__(self, fb, weights):
        names = dict(fb.weights)
        self.wte = weights[names["wte"]]
        self.scale = scale_tensor(self.wte, fb.param("scale", 1.0))
        self.extra = weights[names["extra"]] if "extra" in names else None
        self.segment = fb.param("extra_segment")
        self.extra_scale = scale_tensor(self.extra, fb.param("extra_scale", 1.0)) \
            if self.extra is not None else None

    def embed(self, ids: torch.Tensor) -> dict:
        """ids [n] -> {"x": [n, dim], segment: [n, width]} in the table's dtype."""
        env = {"x": scaled_embedding(self.wte, ids, self.scale)}
        if self.extra is not None:
            env[self.segment] = scaled_embedding(self.extra, ids, self.extra_scale,
                                                 self.wte.device)
        return env


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
    if fb.kind == "scaled_token":
        return ScaledTokenFeedback(fb, weights)
    raise ValueError(f"unknown feedback kind {fb.kind!r}")


def embed_ids(feedback, ids: torch.Tensor) -> dict:
    """A prompt's token ids -> the program's inputs {"x": ..., more segments} through the
    family's feedback (the token embedding, or the scaled one with its extra segment)."""
    if isinstance(feedback, ScaledTokenFeedback):
        return feedback.embed(ids)
    wte = feedback.wte if isinstance(feedback, FeedbackWeights) else feedback
    return {"x": torch.nn.functional.embedding(ids, wte)}


def _per_layer_input(op, env, w):
    ple = per_layer_input(env[op.src[0]], env[op.src[1]], w[op.weights[0] + ".weight"],
                          w[op.weights[1] + ".weight"], len(op.dst),
                          env[op.src[1]].shape[-1] // len(op.dst), op.eps)
    width = ple.shape[-1] // len(op.dst)
    for i, d in enumerate(op.dst):
        env[d] = ple[..., i * width:(i + 1) * width]
    return env[op.dst[0]]


def generic_ops(w) -> dict:
    """The torch references of the op kinds beyond ops/eager.py's (add, scale, softcap,
    per_layer_input): {kind: fn(op, env) -> the dst's value}."""
    return {
        "add": lambda op, env: env[op.dst[0]] + env[op.src[0]],
        "scale": lambda op, env: env[op.src[0]] * w[op.weights[0]],
        "softcap": lambda op, env: logit_softcap(env[op.src[0]], op.param("cap")),
        "per_layer_input": lambda op, env: _per_layer_input(op, env, w)}


class EagerBackend:
    def __init__(self, spec, weights, kv, sdpa: bool):
        self.spec, self.program, self.w, self.kv = spec, spec.program, weights, kv
        a = self.program.attention
        self.sdpa = sdpa or a.n_heads != a.n_kv_heads
        dev = kv.device
        self.rope_perm = rope_perms(a.rot_dim, a.head_dim, dev)
        self.key_ids = torch.arange(kv.capacity, device=dev)
        self.layer_slot = {layer: i for i, layer in enumerate(self.program.kv_layers)}
        self.feedback = feedback_weights(spec, weights)
        self.hybrid = state_ops.uses_state_ops(self.program)
        self.plain_attention = any(op.kind == "attention" for op in self.program.ops)
        self.generic = generic_ops(weights)
        # per-layer attention over the state cache's rings / own shapes (Gemma 4)
        self.window = window_state_ops.uses_window_attention(self.program)
        self.rotary = window_state_ops.RotaryTables(self.program, kv.capacity, dev, kv.dtype) \
            if self.window else None

    def run(self, ops, env: dict, attend=None, stateful=None) -> dict:
        if stateful is not None:
            stateful = {k: (lambda op, env, f=f: f(op, [env.get(s) for s in op.src]))
                        for k, f in stateful.items()}
        stateful = {**self.generic, **(stateful or {})}
        return run_ops(ops, env, self.w, attend, self.layer_slot, stateful)

    # -- a decode step ------------------------------------------------------------------
    def decoder(self, x: torch.Tensor, pos: torch.Tensor, b: int, attn_len: int,
                rows: torch.Tensor, offset: torch.Tensor | None = None,
                active: torch.Tensor | None = None, extra: dict | None = None
                ) -> torch.Tensor:
        """x [b, dim] at positions pos [b] through the program (k/v into the state cache;
        the hybrid ops: rotary at pos + offset, row states written for the active rows);
        extra: more input segments (the feedback's, e.g. Gemma's per-layer token part)."""
        a, kv = self.program.attention, self.kv
        stateful = None
        if self.hybrid:
            off = offset if offset is not None else torch.zeros_like(pos)
            stateful = state_ops.decode_ops(self.program, self.w, kv, rows, pos, off, active,
                                            attn_len)
        if self.window:
            stateful = {**(stateful or {}), **window_state_ops.decode_ops(
                self.program, self.w, kv, self.rotary, rows, pos.clamp(max=kv.capacity - 1),
                attn_len)}
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
        return self.run(self.program.ops, {**(extra or {}), "x": x}, attend, stateful)["x"]

    def feed(self, st, b: int):
        """The next input embedding of each row, from what this step sampled (on the GPU);
        the scaled-token feedback: {"x": ..., its extra segment}."""
        if self.program.feedback.kind == "region":
            return feedback_embedding_reference(self.feedback, st.out[:b], st.phase[:b])
        if self.program.feedback.kind == "scaled_token":
            return self.feedback.embed(st.out[:b, 0])
        return token_embedding_reference(self.feedback, st.out[:b])

    def forward(self, st, b: int, attn_len: int) -> None:
        x, extra = self.feed(st, b), None
        if isinstance(x, dict):
            extra, x = x, x["x"]
        hidden = self.decoder(x, st.pos[:b], b, attn_len, st.row_ids[:b], st.pos_offset[:b],
                              st.active[:b], extra)
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
                offset=None, n_valid: torch.Tensor | None = None,
                extra: dict | None = None) -> torch.Tensor:
        """x [T, dim] (the prompt's embeddings) at positions pos [T] of row `row` ([1]);
        offset: the row's rotary offset ([1] or None), n_valid: real tokens ([1] or None:
        all; padding after them never reaches a recurrent state or a ring); extra: more
        input segments (embed_ids)."""
        a, kv = self.program.attention, self.kv
        stateful = attend = None
        if self.hybrid:
            stateful = state_ops.prefill_ops(self.program, self.w, kv, row, pos,
                                             0 if offset is None else offset, n_valid)
        if self.window:
            stateful = {**(stateful or {}), **window_state_ops.prefill_ops(
                self.program, self.w, kv, self.rotary, row, pos, n_valid)}
        if self.plain_attention:
            cos, sin = rope_angles(pos, a.rot_dim, a.theta)
            pos_w = pos.clamp(max=kv.capacity - 1)
            mask_add = prefill_mask(pos, self.key_ids)

            def attend(slot, qkv):
                return prefill_attention_reference(qkv, row, pos_w, kv.data[slot, 0],
                                                   kv.data[slot, 1], cos, sin, mask_add,
                                                   a.n_heads, a.n_kv_heads, a.head_dim)
        return self.run(self.program.ops, {**(extra or {}), "x": x}, attend, stateful)["x"]


def prefill_mask(pos: torch.Tensor, key_ids: torch.Tensor) -> torch.Tensor:
    """Additive fp32 [T, capacity]: key <= the token's position."""
    return torch.zeros(pos.shape[0], key_ids.shape[0], device=pos.device,
                       dtype=torch.float32).masked_fill(key_ids[None, :] > pos[:, None],
                                                        float("-inf"))


__all__ = ["ACTS", "EagerBackend", "ScaledTokenFeedback", "embed_ids", "feedback_weights",
           "generic_ops", "prefill_mask"]
