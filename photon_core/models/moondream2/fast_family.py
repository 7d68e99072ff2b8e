"""Moondream 2's runtime view (photon_core/fast/fast_family.py: FastFamily): what the fast path
needs of this family - its step program and skill protocol (program.py, skill_protocol.py),
prompts, prefix state, the graphed image encoder, the long-prompt prefill through the
reference decoder, and the host side of a detect / point task (RegionTask: the commit rules
of the x / y / size phases, shifted by one step against run.py's)."""
from __future__ import annotations

import torch

from ...fast.fast_family import TextTask
from ...task import FINISH_LENGTH, FINISH_STOP, Task
from . import region, text
from . import skill_protocol as sp
from .kv_cache import KVCache
from .skill_protocol import OUT_COORD, OUT_H, OUT_TOKEN, OUT_W, PHASE_TEXT, PHASE_X, PHASE_Y


class RegionTask:
    """detect / point on the host (phases x -> y [-> size], skill_protocol.py).

    Commit rules (phase at launch -> what the host does with the row's sampled values):
      x:    token == eos -> stop | capacity -> length | else remember x, steps += 1
      y:    remember y, steps += 1; point: the object {x, y}
      size: the box (center +- size / 2), steps += 1
    The step that completes the max_objects-th object ends the task (length) at its commit:
    it is launched as the run's final step, without the forward that would feed its value
    (pipelined_decoder.SKIP_FINAL_FORWARD) - run.py's rule."""

    text = streams = False
    temperature, top_p, seed = 0.0, 1.0, None

    def __init__(self, task: Task, config, ignore_eos: bool):
        self.task, self.ignore_eos = task, ignore_eos
        self.eos_id = config.tokenizer.eos_id
        self.coord_bins = config.region.coord_out_dim
        self.size_bins = config.region.size_out_dim // 2
        self.kind = sp.row_kind(task.skill)
        self.first_phase = sp.first_phase(task.skill)
        self.budget = sp.step_budget(task)
        self.region = sp.RegionCollector(task.skill)
        self._objects_launched = 0

    def heads(self, phase: int) -> tuple[str, ...]:
        return sp.HEADS[phase]

    def stops(self) -> tuple[tuple[int, ...], int]:
        """eos picked in the x phase ends the task (ops/row_stop.py); none with ignore_eos."""
        return ((), 0) if self.ignore_eos else ((self.eos_id,), 1 << PHASE_X)

    def next_phase(self, phase: int) -> int:
        return sp.next_phase(phase, self.kind)

    def launched(self, run, phase: int) -> bool:
        final = run.final_launched
        if sp.ends_object(phase, self.kind):
            self._objects_launched += 1
            final = final or self._objects_launched >= self.task.max_objects
        return final

    def commit(self, run, phase: int, out) -> None:
        if phase == PHASE_X:
            if out[OUT_TOKEN] == self.eos_id and not self.ignore_eos:
                return run.end(FINISH_STOP)
            if run.pos >= run.capacity:
                return run.end(FINISH_LENGTH)
        if phase in (PHASE_X, PHASE_Y):
            self.region.take(phase, region.bin_to_coordinate(out[OUT_COORD], self.coord_bins))
        else:
            self.region.take(phase, (region.bin_to_size(out[OUT_W], self.size_bins),
                                     region.bin_to_size(out[OUT_H], self.size_bins)))
        run.steps += 1
        run.pos += 1
        if sp.ends_object(phase, self.kind) and \
                len(self.region.objects) >= self.task.max_objects:
            run.end(FINISH_LENGTH)

    def objects(self, text: str, finish_reason: str) -> list[dict]:
        return self.region.objects


class MoondreamFast:
    """FastFamily of a MoondreamModel."""

    def __init__(self, model):
        from .program import step_spec
        self.model = model
        self.spec = step_spec(model)
        self.weights = model.weights
        self.device, self.dtype = model.device, model.dtype
        self.max_context = model.config.text.max_context

    def prefix(self, enc):
        """The EncodedImage is the prefix state (PrefixState: k/v of BOS + image tokens)."""
        t = self.model.config.text
        if enc.kv is None or enc.kv.shape[0] != t.n_layers or enc.kv.dtype != self.dtype:
            raise ValueError("this EncodedImage was made by a different model")
        return enc

    def prompt(self, task: Task, enc) -> list[int]:
        return self.model.tokenizer.prompt(task.skill, task.target)

    def count_prompt_tokens(self, task: Task) -> int:
        return self.model.count_prompt_tokens(task)

    def task_protocol(self, task: Task, ignore_eos: bool, room: int):
        cfg = self.model.config
        if sp.is_text(task.skill):
            return TextTask(task, (cfg.tokenizer.eos_id,), sp.step_budget(task), ignore_eos,
                            phase=PHASE_TEXT, kind=sp.row_kind(task.skill))
        return RegionTask(task, cfg, ignore_eos)

    def decode(self, ids: list[int]) -> str:
        return self.model.tokenizer.decode(ids)

    def make_encoder(self, use_graphs: bool, fast: bool = False):
        # the split encode's body, the reference's form (encoder "fast": the batched
        # encoder's fused forms, make_batch_encoder)
        from ...fast.graphed_reference_encoder import GraphedReferenceEncoder
        return GraphedReferenceEncoder(self.model, use_graphs)

    def encode_image(self, image, crops: str = "overlap"):
        return self.model.encode_image(image, crops=crops)

    def crop_count(self, height: int, width: int, crops: str) -> int:
        return self.model.crop_count(height, width, crops)

    def make_batch_encoder(self, use_graphs: bool, fast: bool, max_frames: int,
                           default_crops: str):
        from ...fast.graphed_batch_encoder import GraphedBatchEncoder   # Moondream's encode
        return GraphedBatchEncoder(self.model, use_graphs, fast=fast, max_frames=max_frames,
                                   default_crops=default_crops)

    def prefill_long(self, kv, row: int, start: int, prompt: list[int], enc) -> torch.Tensor:
        """The reference decoder over the prompt, writing straight into the row's k/v (a
        reference KVCache whose storage is a view of the row; the prefix is loaded)."""
        m = self.model
        cache = KVCache.__new__(KVCache)
        cache.data, cache.length = kv.row_view(row), start
        ids = torch.tensor([prompt], device=self.device)
        return text.decoder(m.weights, m.config.text, text.embed(m.weights, ids), start, cache,
                            m.prefix_len)[0, -1]
