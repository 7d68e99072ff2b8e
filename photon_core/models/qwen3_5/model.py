"""The Qwen 3.5 reference engine: load, encode a frame once (vision tower + the decoder's pass
over the image prefix), run tasks on it (engine API of docs/architecture.md)."""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...engine import Capabilities, GpuTiming
from . import checkpoint, decoder, vision
from ...dtype_names import parse_dtype
from ...engine_conveniences import EngineConveniences
from ...split_encode import EncodeInputs, SplitEncode, upload_frame
from ._shared import Task, to_rgb_array
from .config import Qwen35Config
from ...layout_cache import LayoutCache
from ...pil_resize import ResizePlans
from .image_processor import (ImageProcessorConfig, normalize_table, patches_torch,
                              resized_size)
from .prompts import ChatPrompts, instruction
from .run import TaskRun, _sync
from .state import HybridState

# every skill (detect/point through grounding JSON); whole-image encode only (no crop modes)
CAPABILITIES = Capabilities("qwen3.5", "Qwen 3.5",
                            frozenset({"query", "caption", "detect", "point"}))
MAX_CONTEXT = 8192   # per task (image prefix + prompt + answer); real models allow far more


@dataclass(frozen=True)
class EncodedImage(GpuTiming):
    """A frame after the vision tower AND the decoder's pass over the image prefix
    (<|im_start|>user\\n<|vision_start|> image tokens <|vision_end|>). Read-only: tasks copy
    `state` (k/v + DeltaNet states) on start. gpu_timing: engine.GpuTiming's (an encode
    returned before the GPU ran it)."""
    state: HybridState
    prefix_text: str
    width: int
    height: int
    grid: tuple[int, int, int]
    encode_ms: float
    model_id: str
    setup_ms: float = 0.0
    gpu_timing: Any = None

    @property
    def n_crops(self) -> int:
        """Image units the encoder ran (the scheduler's encode cost hint): one frame."""
        return 1


def image_positions(start: int, gh: int, gw: int, device) -> torch.Tensor:
    """M-RoPE positions [3, gh*gw] of the merged image tokens starting at text position start:
    (start, start + row, start + col)."""
    rows = torch.arange(gh, device=device)[:, None].expand(gh, gw).reshape(-1)
    cols = torch.arange(gw, device=device)[None, :].expand(gh, gw).reshape(-1)
    return torch.stack([torch.zeros_like(rows), rows, cols]) + start


class Qwen35Model(SplitEncode, EngineConveniences):
    capabilities = CAPABILITIES

    def __init__(self, config: Qwen35Config, weights: dict, prompts: ChatPrompts,
                 image_config: ImageProcessorConfig, model_id: str = "qwen3.5",
                 max_context: int = MAX_CONTEXT):
        self.config, self.weights, self.prompts = config, weights, prompts
        self.image_config, self.model_id, self.max_context = image_config, model_id, max_context
        self.stats: Counter = Counter()   # grounding_parse_errors, grounding_skipped_entries
        self._table = None                # image_processor.normalize_table on the device
        self._resize_plans = ResizePlans(self.device, "bicubic")   # by frame size
        self._grid_tables = LayoutCache()  # grid -> vision.grid_tables (made on first use)
        self._prefix = LayoutCache()       # merged grid -> _prefix_layout

    @property
    def device(self) -> torch.device:
        return self.weights["lm_head.weight"].device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights["lm_head.weight"].dtype

    @property
    def tokenizer(self) -> ChatPrompts:
        return self.prompts

    # -- images ---------------------------------------------------------------------------
    # encode_image (SplitEncode) in three parts: fast/graphed_reference_encoder.py replays the
    # body as a CUDA graph per layout
    encoded_type = EncodedImage

    def encode_inputs(self, image) -> EncodeInputs:
        """Decode on the host; the prefix's ids and M-RoPE positions. The uint8 frame goes to
        the device as it is; encode_body resizes it there (pil_resize.ResizePlan: PIL's
        BICUBIC pixels) and makes the patches (image_processor.patches_torch: preprocess's,
        bit for bit)."""
        t0 = time.perf_counter()
        array = to_rgb_array(image)
        h, w = resized_size(array.shape[0], array.shape[1], self.image_config)
        p = self.image_config.patch_size
        grid = (1, h // p, w // p)
        dev = self.device
        plan = self._resize_plans.for_size(array.shape[0], array.shape[1], h, w)
        m = self.config.vision.spatial_merge_size
        gh, gw = grid[1] // m, grid[2] // m
        text, ids, first, rope_pos, ids_t, pos = self._prefix.get(
            (gh, gw), lambda: self._prefix_layout(gh, gw))
        if self._table is None:
            self._table = torch.from_numpy(normalize_table(self.image_config)).to(dev)
        tensors = {"image": upload_frame(array, dev),
                   "table": self._table, "ids": ids_t, "pos": pos}
        info = {"grid": grid, "first": first, "n_image": gh * gw, "ids": ids, "text": text,
                "rope_pos": rope_pos, "width": array.shape[1], "height": array.shape[0],
                "resize": plan}
        return EncodeInputs((tuple(grid), len(ids), tuple(array.shape)), tensors, info, t0)

    def _prefix_layout(self, gh: int, gw: int) -> tuple:
        """The image prefix of a gh x gw merged grid, the same for every frame of that grid:
        (text, ids, first image position, rope position after it, ids and M-RoPE positions
        on the device)."""
        cfg, dev = self.config, self.device
        text, ids = self.prompts.image_prefix(gh * gw)
        first = ids.index(cfg.image_token_id)
        if ids[first:first + gh * gw] != [cfg.image_token_id] * (gh * gw):
            raise ValueError("image tokens of the prefix are not contiguous")
        after = len(ids) - first - gh * gw
        img_end = first + max(gh, gw)
        pos = torch.cat([decoder.text_positions(0, first, dev),
                         image_positions(first, gh, gw, dev),
                         decoder.text_positions(img_end, after, dev)], dim=1)
        return text, ids, first, img_end + after, torch.tensor(ids, device=dev), pos

    def encode_body_fast(self, inp: EncodeInputs) -> HybridState:
        """encode_body with the prefix pass's norms as Triton kernels on CUDA (FastEngine's
        encoder "fast": decoder.forward(fused_norms=True); close, not bitwise)."""
        return self.encode_body(inp, fast=True)

    def encode_body(self, inp: EncodeInputs, fast: bool = False) -> HybridState:
        """The vision tower and the decoder's pass over the image prefix (device work only).
        (The chunked delta-rule kernel, decoder.forward(use_kernels=True), was measured 2.3x
        slower here than the torch form at a 640x480 frame's prefix: docs/benchmarks.md,
        session 11.)"""
        w, cfg, info, t = self.weights, self.config, inp.info, inp.tensors
        image = info["resize"](t["image"]) if info["resize"] is not None else t["image"]
        patches = patches_torch(image, t["table"], self.image_config)
        grid = info["grid"]
        dt = w[vision.V + "patch_embed.proj.weight"].dtype
        tables = self._grid_tables.get(grid, lambda: vision.grid_tables(
            w, cfg.vision, grid, self.device, dt))
        feats = vision.encode(w, cfg.vision, patches, grid, tables)
        x = decoder.embed(w, t["ids"])
        first, n = info["first"], info["n_image"]
        x[first:first + n] = feats.to(x.dtype)
        state = HybridState.empty(cfg.text, len(info["ids"]), self.device, self.dtype)
        decoder.forward(w, cfg.text, x, t["pos"], state, fused_norms=fast and x.is_cuda)
        return state

    def encode_result(self, state: HybridState, inp: EncodeInputs, copy: bool,
                      setup_ms: float = 0.0, gpu_timing=None) -> EncodedImage:
        """gpu_timing (the graphed encoder's sync=False): no host wait; encode_ms is the
        host's time, gpu_encode_ms() the GPU's."""
        info = inp.info
        if copy:                       # a graph's static state: this image owns a copy
            state = state.copy()
        state.length = len(info["ids"])
        state.rope_pos = info["rope_pos"]
        state.tokens = list(info["ids"])
        if gpu_timing is None:
            _sync(self.device)
        return EncodedImage(state=state, prefix_text=info["text"], width=info["width"],
                            height=info["height"], grid=info["grid"],
                            encode_ms=(time.perf_counter() - inp.t0) * 1e3,
                            model_id=self.model_id, setup_ms=setup_ms,
                            gpu_timing=gpu_timing)

    def fast_family(self):
        """The runtime's plugin view of this model (photon_core/fast/fast_family.py)."""
        fam = self.__dict__.get("_fast_family")
        if fam is None:
            from .fast_family import QwenFast
            fam = self._fast_family = QwenFast(self)
        return fam

    # -- tasks ----------------------------------------------------------------------------
    def start(self, enc, task: Task, stream: Callable[[str], None] | None = None,
              ignore_eos: bool = False) -> TaskRun:
        enc = self.encode_image(enc)
        if enc.model_id != self.model_id:
            raise ValueError("this EncodedImage was made by a different model")
        return TaskRun(self, enc, task, stream, ignore_eos)

    def step_batch(self, runs: list[TaskRun]) -> list[bool]:
        return [r.step() for r in runs]

    max_runs = None     # the reference engine holds any number of runs (engine.Engine)

    def count_prompt_tokens(self, task: Task) -> int:
        """Tokens a task prefills after the image prefix (the scheduler's cost model)."""
        pre, rest = self.prompts.split(instruction(task.skill, task.target))
        return len(self.prompts.encode(rest))


def load_model(path_or_id: str, device: str = "cpu", dtype="fp32", revision: str | None = None,
               max_context: int = MAX_CONTEXT, **_ignored) -> Qwen35Model:
    """Load a Qwen 3.5 checkpoint (local folder or Hugging Face id) as the reference engine."""
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    files = checkpoint.resolve(path_or_id, revision)
    config = checkpoint.load_config(files["config"])
    weights, _extra = checkpoint.load_tensors(files["weights"], config, device, torch_dtype)
    pre = None
    if files["preprocessor"] is not None:
        try:
            pre = json.loads(files["preprocessor"].read_text())
        except ValueError as e:
            raise checkpoint.CheckpointError(f"{files['preprocessor']}: invalid JSON ({e})") from None
    prompts = ChatPrompts(files["tokenizer"], files["template"], config.image_token_id,
                          config.vision_end_token_id)
    model_id = str(path_or_id) + (f"@{revision}" if revision else "")
    return Qwen35Model(config, weights, prompts, ImageProcessorConfig.from_dict(pre), model_id,
                       max_context)
