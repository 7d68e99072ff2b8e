"""The Gemma 4 reference engine: load, encode an image once (vision tower + the decoder's
pass over the image prefix), run query/caption tasks on it step by step.

Skills: query and caption. Gemma 4's documentation (model card, transformers docs) gives no
box or point output format for E2B/E4B, so detect and point are not served: `start` refuses
such a Task with a TaskError that says so (the node refuses it in its YAML, see SKILLS).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ...moondream.image_input import MAX_SIDE, to_rgb_array
from ...layout_cache import LayoutCache
from ...pil_resize import ResizePlans
from ...dtype_names import parse_dtype
from ...engine_conveniences import EngineConveniences
from ...task import Task
from ...engine import Capabilities, GpuTiming
from ...split_encode import EncodeInputs, SplitEncode, upload_frame
from . import text, vision
from .config import Gemma4Cfg, parse_config
from .kv_cache import KVCache
from .prompt import Prompter, read_chat_template
from .run import TaskRun, _sync
from .weights import PER_LAYER_TABLE, load_weights, shard_files

SKILLS = frozenset({"query", "caption"})
UNSUPPORTED = ("Gemma 4 (E2B/E4B) does not support {skill}: the model has no documented "
               "box/point output; this model serves query and caption only")
# what the family serves (photon_core.engine.Capabilities): its own refusal of the rest
CAPABILITIES = Capabilities("gemma4", "Gemma 4 (E2B/E4B)", SKILLS, unsupported=UNSUPPORTED)
DEFAULT_MAX_CONTEXT = 4096


class CheckpointNotFound(ValueError):
    pass


@dataclass(frozen=True)
class EncodedImage(GpuTiming):
    """An image after the vision tower AND the decoder's pass over its prefix
    (head + <boi> + image tokens + <eoi>): `cache` holds that prefix's k/v, read-only
    (every task copies it into its own cache). gpu_timing: engine.GpuTiming's (an encode
    returned before the GPU ran it)."""
    cache: KVCache
    length: int
    n_image_tokens: int
    width: int
    height: int
    encode_ms: float
    model_id: str
    setup_ms: float = 0.0
    n_crops: int = 1            # one variable-resolution image (for the scheduler's cost model)
    gpu_timing: Any = None


class Gemma4Model(SplitEncode, EngineConveniences):
    max_runs = None      # the reference engine: no limit on open runs (photon_core.engine.Engine)
    capabilities = CAPABILITIES

    def __init__(self, config: Gemma4Cfg, weights: dict[str, torch.Tensor], prompter: Prompter,
                 model_id: str = "gemma4", max_soft_tokens: int = vision.DEFAULT_SOFT_TOKENS,
                 max_context: int = DEFAULT_MAX_CONTEXT, max_image_side: int = MAX_SIDE):
        self.config, self.weights, self.prompter = config, weights, prompter
        self.model_id = model_id
        self.max_soft_tokens = max_soft_tokens
        self.max_context = min(max_context, config.text.max_positions)
        self.max_image_side = max_image_side
        emb0 = weights["language_model.embed_tokens.weight"]
        self.freqs = {k: f.to(emb0.device) for k, f in text.rope_freqs(config.text).items()}
        emb = weights["language_model.embed_tokens.weight"]
        self.device, self.dtype = emb.device, emb.dtype
        # the device encode's per-layout pieces (encode_inputs): BICUBIC resize plans by frame
        # size, patch positions by grid, vision.pixel_table on the device
        self._resize_plans = ResizePlans(self.device, "bicubic")
        self._positions = LayoutCache()
        self._prefix = LayoutCache()      # image tokens -> _prefix_layout
        self._pixel_table = None
        self._fast_tower = None           # vision_fast.FastTower, made on first use

    def step_spec(self):
        """The decode step as a step program (program.py) for the runtime's backends: one
        text phase feeding back its token, no answer-marker rule."""
        from .program import step_spec
        return step_spec(self.config.text, self.config.tied)

    def fast_family(self):
        """The runtime's view of this model (fast_family.py), built once."""
        if getattr(self, "_fast", None) is None:
            from .fast_family import Gemma4Fast
            self._fast = Gemma4Fast(self)
        return self._fast

    # -- decoder over token ids ------------------------------------------------------------
    def forward_ids(self, ids: torch.Tensor, pos0: int, cache: KVCache,
                    image_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """ids [S] at positions pos0.. (image placeholders filled from image_embeds, in
        order) -> final hidden states [S, hidden]; writes k/v into cache."""
        t, w = self.config.text, self.weights
        is_image = ids == self.config.image_token_id
        safe_ids = torch.where(is_image, torch.full_like(ids, t.pad_id), ids)
        x = text.embed(w, t, safe_ids)
        blocks = None
        if image_embeds is not None:
            if int(is_image.sum()) != image_embeds.shape[0]:
                raise ValueError(f"{int(is_image.sum())} image tokens for {image_embeds.shape[0]} "
                                 "image embeddings")
            x = x.clone()
            x[is_image] = image_embeds.to(x.dtype)
            if t.bidirectional == "vision" and pos0 == 0:
                blocks = torch.where(is_image, 0, -1)
        ple = text.per_layer_inputs(w, t, safe_ids, x)
        return text.decoder(w, t, x, ple, pos0, cache, self.freqs, blocks)

    def greedy(self, ids: list[int], steps: int, image_embeds=None):
        """Prefill ids then `steps` greedy decode steps -> (logits [steps + 1, V], tokens).
        The plain reference loop (tests, benchmarks)."""
        cache = KVCache(self.config.text, len(ids) + steps, self.device, self.dtype)
        out, toks = [], []
        with torch.inference_mode():
            h = self.forward_ids(torch.tensor(ids, device=self.device), 0, cache, image_embeds)
            pos = len(ids)
            for s in range(steps + 1):
                lg = text.logits(self.weights, self.config.text, h[-1])
                out.append(lg.float().cpu())
                toks.append(int(lg.argmax()))
                if s == steps:
                    break
                h = self.forward_ids(torch.tensor([toks[-1]], device=self.device), pos, cache)
                pos += 1
        return torch.stack(out), toks

    # -- images ----------------------------------------------------------------------------
    def image_inputs(self, image):
        """image -> (rgb array, patches, positions, grid) as the HF image processor makes them."""
        array = to_rgb_array(image, self.max_image_side)
        patches, positions, grid = vision.preprocess(array, self.config.vision, self.max_soft_tokens)
        return array, patches, positions, grid

    def image_embeddings(self, patches, positions, grid, fast: bool = False) -> torch.Tensor:
        """Soft tokens in the text width; fast: the tower in its fast form (vision_fast.py)."""
        tower = None
        if fast:
            if self._fast_tower is None:
                from .vision_fast import FastTower
                self._fast_tower = FastTower(self.weights, self.config.vision)
            tower = self._fast_tower
        with torch.inference_mode():
            return vision.encode(self.weights, self.config.vision, patches, positions, grid,
                                 tower)

    def prefix_ids(self, n_image_tokens: int) -> list[int]:
        c = self.config
        return (self.prompter.head + [c.boi_token_id] + [c.image_token_id] * n_image_tokens
                + [c.eoi_token_id])

    # encode_image (SplitEncode) in three parts: fast/graphed_reference_encoder.py replays the
    # body as a CUDA graph per layout
    encoded_type = EncodedImage

    def encode_inputs(self, image) -> EncodeInputs:
        """Decode on the host; the prefix's ids (image placeholders as the pad id for the
        embeddings) and the bidirectional image block of each position. The uint8 frame goes
        to the device as it is: encode_body resizes it there (pil_resize.ResizePlan, PIL's
        BICUBIC pixels) and makes the patches (vision.patches_torch): image_inputs' patches
        bit for bit, with no host pass over the pixels."""
        t0 = time.perf_counter()
        array = to_rgb_array(image, self.max_image_side)
        vc, dev = self.config.vision, self.device
        th, tw = vision.target_size(array.shape[0], array.shape[1], vc.patch_size, vc.pool,
                                    self.max_soft_tokens)
        grid = (th // vc.patch_size, tw // vc.patch_size)
        plan = self._resize_plans.for_size(array.shape[0], array.shape[1], th, tw)
        positions = self._positions.get(grid, lambda: vision.grid_positions(*grid, dev))
        if self._pixel_table is None:
            self._pixel_table = vision.pixel_table().to(dev)
        n = (grid[0] // vc.pool) * (grid[1] // vc.pool)
        length, first, prefix_tensors = self._prefix.get(n, lambda: self._prefix_layout(n))
        if length >= self.max_context:
            raise ValueError(f"the image prefix ({length} tokens) does not fit the "
                             f"{self.max_context}-token context")
        tensors = {"image": upload_frame(array, dev),
                   "table": self._pixel_table, "positions": positions, **prefix_tensors}
        info = {"grid": grid, "first": first, "n_image": n, "length": length,
                "width": array.shape[1], "height": array.shape[0], "resize": plan}
        return EncodeInputs((tuple(grid), length, tuple(array.shape)), tensors, info, t0)

    def _prefix_layout(self, n: int) -> tuple:
        """The prefix of n image tokens, the same for every frame with n: (length, first image
        position, {"safe_ids": the ids with the pad id at the image positions, "blocks": the
        bidirectional image block of each position (when the model has one)} on the
        device)."""
        t, dev = self.config.text, self.device
        ids = self.prefix_ids(n)
        first = ids.index(self.config.image_token_id)
        is_image = torch.tensor([i == self.config.image_token_id for i in ids], device=dev)
        ids_t = torch.tensor(ids, device=dev)
        tensors = {"safe_ids": torch.where(is_image, torch.full_like(ids_t, t.pad_id), ids_t)}
        if t.bidirectional == "vision":
            tensors["blocks"] = torch.where(is_image, 0, -1)
        return len(ids), first, tensors

    def encode_body(self, inp: EncodeInputs, fast: bool = False) -> KVCache:
        """The vision tower and the decoder's pass over the image prefix (device work only):
        forward_ids' math with the image tokens' rows as one slice (the prefix's image
        placeholders are contiguous) and no host-side count check. fast: the vision tower
        in its fast form (vision_fast.py: the engine's encoder "fast"; not bitwise)."""
        t, w, info, d = self.config.text, self.weights, inp.info, inp.tensors
        image = info["resize"](d["image"]) if info["resize"] is not None else d["image"]
        patches = vision.patches_torch(image, d["table"], self.config.vision.patch_size)
        emb = self.image_embeddings(patches, d["positions"], info["grid"], fast)
        if emb.shape[0] != info["n_image"]:
            raise ValueError(f"{info['n_image']} image tokens for {emb.shape[0]} image "
                             "embeddings")
        x = text.embed(w, t, d["safe_ids"]).clone()
        first = info["first"]
        x[first:first + emb.shape[0]] = emb.to(x.dtype)
        ple = text.per_layer_inputs(w, t, d["safe_ids"], x)
        cache = KVCache(t, info["length"], self.device, self.dtype)
        # the prefix's k/v only: the KV-shared layers, which store none, do not run; the
        # fast form's norms / gated GELUs as Triton kernels on CUDA
        text.prefix_kv(w, t, x, ple, cache, self.freqs, d.get("blocks"),
                       text.fast_ops_on(x) if fast else text.REFERENCE)
        return cache

    def encode_body_fast(self, inp: EncodeInputs) -> KVCache:
        """encode_body with the fast vision tower (FastEngine's encoder "fast")."""
        return self.encode_body(inp, fast=True)

    def encode_result(self, cache: KVCache, inp: EncodeInputs, copy: bool,
                      setup_ms: float = 0.0, gpu_timing=None) -> EncodedImage:
        """gpu_timing (the graphed encoder's sync=False): no host wait; encode_ms is the
        host's time, gpu_encode_ms() the GPU's."""
        info = inp.info
        if copy:                       # a graph's static cache: this image owns a copy
            own = KVCache.__new__(KVCache)
            own.capacity = cache.capacity
            own.k = [None if a is None else a.clone() for a in cache.k]
            own.v = [None if a is None else a.clone() for a in cache.v]
            cache = own
        if gpu_timing is None:
            _sync(self.device)
        return EncodedImage(cache=cache, length=info["length"], n_image_tokens=info["n_image"],
                            width=info["width"], height=info["height"],
                            encode_ms=(time.perf_counter() - inp.t0) * 1e3,
                            model_id=self.model_id, setup_ms=setup_ms, gpu_timing=gpu_timing)

    # -- tasks -----------------------------------------------------------------------------
    max_runs = None     # the reference engine holds any number of runs (engine.Engine)

    def count_prompt_tokens(self, task: Task) -> int:
        """Tokens a task prefills after the image prefix (the scheduler's cost model)."""
        return len(self.prompter.task_tail(task.skill, task.target))

    @staticmethod
    def check_skill(skill: str) -> None:
        CAPABILITIES.check_skill(skill)

    def start(self, enc, task: Task, stream: Callable[[str], None] | None = None,
              ignore_eos: bool = False, record_logits: bool = False) -> TaskRun:
        task.validate()
        self.check_skill(task.skill)          # before any encode work
        enc = self.encode_image(enc)
        if enc.model_id != self.model_id or enc.cache.k[0].dtype != self.dtype:
            raise ValueError("this EncodedImage was made by a different model")
        return TaskRun(self, enc, task, stream, ignore_eos, record_logits)

    def step_batch(self, runs: list[TaskRun]) -> list[bool]:
        return [r.step() for r in runs]


HUB_PATTERNS = ["config.json", "generation_config.json", "processor_config.json",
                "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "model.safetensors", "model.safetensors.index.json",
                "model-*.safetensors"]


def resolve(path_or_id: str, revision: str | None = None) -> Path:
    """A local folder, or a Hugging Face repo id (snapshot of the files above only)."""
    p = Path(os.path.expanduser(str(path_or_id)))
    if p.is_dir():
        return p
    if p.exists() or str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") != 1:
        raise CheckpointNotFound(f"model folder {path_or_id!r} not found (and it is not a "
                                 "Hugging Face repo id like 'google/gemma-4-E2B-it')")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(str(path_or_id), revision=revision,
                                      allow_patterns=HUB_PATTERNS))
    except Exception as e:
        raise CheckpointNotFound(f"cannot get {path_or_id}@{revision or 'main'} from the Hugging "
                                 f"Face Hub or its local cache: {type(e).__name__}: {e}") from None


def soft_token_budget(folder: Path) -> int:
    """max_soft_tokens of the checkpoint's image processor config, else the default (280)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        f = folder / name
        if f.is_file():
            try:
                d = json.loads(f.read_text())
            except ValueError:
                continue
            for scope in (d, d.get("image_processor") or {}):
                if isinstance(scope, dict) and isinstance(scope.get("max_soft_tokens"), int):
                    return scope["max_soft_tokens"]
    return vision.DEFAULT_SOFT_TOKENS


def load_model(path_or_id: str, device: str = "cpu", dtype="fp32", revision: str | None = None,
               max_soft_tokens: int | None = None,
               max_context: int = DEFAULT_MAX_CONTEXT, ple_on_cpu: bool = False,
               **_ignored) -> Gemma4Model:
    """Load a Gemma 4 image-text checkpoint (HF layout, safetensors only).
    ple_on_cpu: keep the per-layer embedding table (E2B: 262144 x 35 x 256, 4.7 GB in bf16)
    in host memory; each forward gathers its tokens' rows there and moves them over."""
    torch_dtype = parse_dtype(dtype)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    folder = resolve(path_or_id, revision)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointNotFound(f"{folder} has no config.json")
    cfg = parse_config(json.loads(cfg_file.read_text()))
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointNotFound(f"{folder} has no tokenizer.json")
    weights = load_weights(shard_files(folder), cfg, device, torch_dtype,
                           cpu_keys=frozenset({PER_LAYER_TABLE}) if ple_on_cpu else frozenset())
    eos = list(cfg.text.eos_ids)
    gen = folder / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text()).get("eos_token_id")
        eos += g if isinstance(g, list) else ([g] if g is not None else [])
    prompter = Prompter(folder / "tokenizer.json", read_chat_template(folder), cfg.image_token_id,
                        cfg.text.bos_id, tuple(eos))
    model_id = str(path_or_id) + (f"@{revision}" if revision else "")
    budget = max_soft_tokens or soft_token_budget(folder)
    if budget not in vision.SOFT_TOKEN_BUDGETS:
        raise ValueError(f"max_soft_tokens {budget} is not one of {vision.SOFT_TOKEN_BUDGETS}")
    return Gemma4Model(cfg, weights, prompter, model_id, budget, max_context)
