"""The Moondream 2 engine (reference path): load, encode an image once, run tasks on it."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ...engine import Capabilities, PrefixState
from ...dtype_names import parse_dtype
from ...engine_conveniences import EngineConveniences
from ...split_encode import EncodeInputs, SplitEncode, upload_frame
from ...task import Task
from ...task import SKILLS as ALL_SKILLS
from . import crops as crop_ops
from . import hub, text, vision
from .config import MoondreamConfig
from ...encode_request import crop_budget, unwrap
from ...ops._triton import HAVE_TRITON
from ...ops.crop_normalize import pixel_lut
from .crops import GLOBAL_TILING, CropPlan, crop_geometry, global_crop, overlap_crops
from .image_input import MAX_SIDE, to_rgb_array
from .kv_cache import KVCache
from .layers import Weights
from .run import TaskRun, _sync
from .tokenizer import Tokenizer
from .weights import TEST_MODEL_KEY, load_safetensors, random_weights, read_metadata

# what the family serves (photon_core.engine.Capabilities): every skill natively, and the
# "global" and "overlap:N" crop modes (photon_core/encode_request.py)
CAPABILITIES = Capabilities("moondream2", "Moondream 2", frozenset(ALL_SKILLS),
                            crop_modes=("overlap", "global", "overlap:N"))


def parse_device(device) -> torch.device:
    """"cpu", "cuda", "cuda:N" (or a torch.device) -> torch.device; a ValueError otherwise."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {device!r}; expected cpu, cuda or cuda:N") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; expected cpu, cuda or cuda:N")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} "
                             "CUDA device(s)")
    return d


@dataclass(frozen=True, kw_only=True)
class EncodedImage(PrefixState):
    """Moondream 2's prefix state: the image after the vision encoder AND the text decoder's
    pass over its prefix.

    kv: the k/v of [BOS, 729 image tokens] for every layer, [n_layers, 2, 1, Hkv, 730, D].
    Read-only: every task copies it into its own cache, so one handle serves many tasks.
    tiling: the local crops' grid (n_crops = 1 global + rows x cols).
    crops: "overlap" (the global view + the local crops) or "global" (the global view alone,
      standing in for a (1, 1) local grid: n_crops = 1; photon_core/encode_request.py).
    """
    tiling: tuple[int, int] = (0, 0)
    crops: str = "overlap"

    def __post_init__(self):
        n = 1 if self.crops == "global" else 1 + int(self.tiling[0]) * int(self.tiling[1])
        object.__setattr__(self, "n_crops", n)


class MoondreamModel(SplitEncode, EngineConveniences):
    def __init__(self, config: MoondreamConfig, weights: Weights, tokenizer: Tokenizer,
                 model_id: str = "moondream2", max_image_side: int = MAX_SIDE):
        self.config, self.weights, self.tokenizer = config, weights, tokenizer
        self.model_id = model_id
        self.max_image_side = max_image_side
        self.prefix_len = config.prefix_len
        self.test_model_note: str | None = None   # set when the weights are a random test model
        self._bos = None                  # the BOS id on the weights' device (encode_inputs)
        # where image_crops makes the overlap crops: None = on the model's device when that is
        # CUDA (torch LANCZOS, bit-identical to PIL; H200, 640x480 frame: 0.6-0.7 ms vs 15-21
        # ms with PIL), else with PIL on the CPU (faster there); True / False force the torch /
        # PIL path (EngineOptions.crops_on_device)
        self.crops_on_device: bool | None = None
        self._pixel_lut = None            # device_crops' normalize table (ops/crop_normalize)
        # the default crop mode of encode_image / encode_batch ("overlap" | "overlap:N" | "global";
        # EngineOptions.crops); a frame's EncodeRequest or the crops keyword overrides it
        self.crops = "overlap"

    max_runs = None     # the reference engine holds any number of runs (engine.Engine)
    capabilities = CAPABILITIES

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    # -- images ---------------------------------------------------------------------------
    def image_crops(self, image, crops: str = "overlap"
                    ) -> tuple[np.ndarray, torch.Tensor, tuple[int, int]]:
        """image -> (the RGB array, normalized crops [N, 3, crop, crop] on the model's device,
        tiling): everything of encode_image before the vision encoder (shared with the fast
        path's graphed encoder). The crops are the same pixels on either path (see
        crops_on_device). crops="global": the global view alone (N = 1), tiling
        GLOBAL_TILING (see batched_encode.py)."""
        array = to_rgb_array(image, self.max_image_side)
        v, w = self.config.vision, self.weights
        on_device = (w.device.type == "cuda" if self.crops_on_device is None
                     else self.crops_on_device)
        with torch.inference_mode():
            if on_device:
                plan = self.crop_plan(array.shape[0], array.shape[1], crops)
                return array, self.device_crops(upload_frame(array, w.device), plan), \
                    plan.tiling
            if crops == "global":
                pixels, tiling = global_crop(array, v.crop_size), GLOBAL_TILING
            else:
                pixels, tiling = overlap_crops(array, v.crop_size, v.enc_patch_size,
                                               v.overlap_margin,
                                               crop_budget(crops, v.max_crops))
            return array, vision.normalize(pixels, w.device, w.dtype), tiling

    def crop_count(self, height: int, width: int, crops: str | None = None) -> int:
        """Crops the vision encoder runs for a height x width frame in crop mode `crops`
        (None: self.crops), by the tiling rule itself, without any pixel work: the
        scheduler's encode cost hint before the frame is encoded (a frame past MAX_SIDE is
        shrunk first; its tiling is at max_crops either way)."""
        v = self.config.vision
        return crop_geometry(int(height), int(width), crops or self.crops, v.crop_size,
                             v.enc_patch_size, v.overlap_margin, v.max_crops)[1]

    def crop_plan(self, height: int, width: int, crops: str = "overlap") -> CropPlan:
        """The torch crops of height x width frames in this crop mode on the model's device
        (crops.CropPlan: its tables uploaded now; tiling and n_crops without any crop)."""
        v = self.config.vision
        return CropPlan(height, width, crops, v.crop_size, v.enc_patch_size, v.overlap_margin,
                        v.max_crops, self.weights.device)

    def device_crops(self, frame: torch.Tensor, plan: CropPlan,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [H, W, 3] frame on the model's device -> its normalized crops [N, 3, crop,
        crop] (image_crops' on-device path; tensor ops only, so the graphed encoder runs it
        inside its CUDA graph: the same pixels either way), written into out when given.
        On CUDA (crops.TRITON_CROPS) cut and normalized by one Triton launch
        (CropPlan.normalized: the same bits)."""
        w = self.weights
        if crop_ops.TRITON_CROPS and frame.is_cuda and HAVE_TRITON:
            if self._pixel_lut is None:
                self._pixel_lut = pixel_lut(vision.normalize, w.device, w.dtype)
            return plan.normalized(frame, self._pixel_lut, out)
        x = vision.normalize(plan(frame), w.device, w.dtype)
        return x if out is None else out.copy_(x)

    def encode_image(self, image, crops: str | None = None) -> EncodedImage:
        """numpy HxWx3 uint8 RGB | PIL image | path | EncodeRequest -> EncodedImage (vision +
        prefix prefill). crops: "overlap" | "overlap:N" | "global"
        (photon_core/encode_request.py); None: the EncodeRequest's, else self.crops."""
        if isinstance(image, EncodedImage):
            return image
        image, mode = unwrap(image, crops, self.crops)
        if mode != "overlap":
            return self.encode_batch([image], crops=mode)[0]
        return self.encode_split(image)

    # the "overlap" encode in three parts (split_encode.py; fast/graphed_reference_encoder.py
    # replays the body as one CUDA graph per crop tiling)
    encoded_type = EncodedImage

    def encode_inputs(self, image) -> EncodeInputs:
        """The crops (image_crops: on the GPU for a CUDA model) and the BOS id."""
        t0 = time.perf_counter()
        array, x, tiling = self.image_crops(image)
        if self._bos is None:                # made once, not copied to the device per frame
            self._bos = torch.tensor([self.config.tokenizer.bos_id], device=self.weights.device)
        bos = self._bos
        info = {"tiling": tiling, "width": array.shape[1], "height": array.shape[0]}
        return EncodeInputs((tuple(tiling), tuple(x.shape)), {"crops": x, "bos": bos}, info,
                            t0)

    def encode_body(self, inp: EncodeInputs) -> KVCache:
        """Vision encoder, projection, then [BOS, image tokens] through the text decoder."""
        v, w, t = self.config.vision, self.weights, self.config.text
        features = vision.encoder(w, v, inp.tensors["crops"])
        tokens = vision.project(w, v, features, inp.info["tiling"])
        prefix = torch.cat([text.embed(w, inp.tensors["bos"]), tokens], dim=0)[None]
        cache = KVCache(t.n_layers, t.n_kv_heads, prefix.shape[1], t.head_dim, w.device,
                        w.dtype)
        text.decoder(w, t, prefix, 0, cache, self.prefix_len)
        return cache

    def encode_result(self, cache: KVCache, inp: EncodeInputs, copy: bool,
                      setup_ms: float = 0.0, gpu_timing=None) -> EncodedImage:
        """gpu_timing (the graphed encoder's sync=False): no host wait; encode_ms is the
        host's time, gpu_encode_ms() the GPU's."""
        info = inp.info
        kv = cache.data.clone() if copy else cache.data
        if gpu_timing is None:
            _sync(self.weights.device)
        return EncodedImage(kv=kv, width=info["width"], height=info["height"],
                            tiling=info["tiling"], encode_ms=(time.perf_counter() - inp.t0) * 1e3,
                            model_id=self.model_id, setup_ms=setup_ms, gpu_timing=gpu_timing)

    def encode_batch(self, images: list, crops: str | None = None) -> list[EncodedImage]:
        """Several images in one vision pass (all their crops) and one batched image-prefix
        prefill; one EncodedImage each, in order, per frame bit-identical to encode_image on
        the CPU (batched_encode.py). Each image may be an EncodeRequest (its own crops)."""
        from .batched_encode import encode_batch
        return encode_batch(self, images, crops)

    # -- tasks ----------------------------------------------------------------------------
    def start(self, enc, task: Task, stream: Callable[[str], None] | None = None,
              ignore_eos: bool = False) -> TaskRun:
        """Prefill the task's prompt after the shared image prefix; step() the returned run.
        ignore_eos (tests, benchmarks) makes it run to max_tokens / max_objects."""
        enc = self.encode_image(enc)
        if enc.kv.shape[0] != self.config.text.n_layers or enc.kv.dtype != self.dtype:
            raise ValueError("this EncodedImage was made by a different model")
        return TaskRun(self, enc, task, stream, ignore_eos)

    def step_spec(self):
        """The runtime's plugin view of this model: step program, phase table, feedback
        tables (program.py, skill_protocol.py)."""
        from .program import step_spec
        return step_spec(self)

    def fast_family(self):
        """The runtime's plugin view of this model (photon_core/fast/fast_family.py)."""
        fam = self.__dict__.get("_fast_family")
        if fam is None:
            from .fast_family import MoondreamFast
            fam = self._fast_family = MoondreamFast(self)
        return fam

    def count_prompt_tokens(self, task: Task) -> int:
        return len(self.tokenizer.prompt(task.skill, task.target))

    def step_batch(self, runs: list[TaskRun]) -> list[bool]:
        """One step of every run (the reference path steps them one after another)."""
        return [r.step() for r in runs]


def load_model(path_or_id: str, device: str = "cpu", dtype="fp32", revision: str | None = None,
               progress: bool = True) -> MoondreamModel:
    """Load Moondream 2 from a local folder or a Hugging Face repo id (safetensors only)."""
    torch_dtype = parse_dtype(dtype)
    device = parse_device(device)
    files = hub.resolve(path_or_id, revision)
    config = MoondreamConfig.from_file(files["config"]) if files["config"] else MoondreamConfig()
    weights = load_safetensors(files["weights"], config, device, torch_dtype, progress)
    try:
        tokenizer = Tokenizer(files["tokenizer"], config.tokenizer)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
        raise ValueError(f"{files['tokenizer']}: not a readable tokenizer.json "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    model_id = str(path_or_id) + (f"@{revision}" if revision else "")
    model = MoondreamModel(config, weights, tokenizer, model_id)
    # make_test_model marks its weights; callers (CLI, demo, node) say so loudly
    model.test_model_note = read_metadata(files["weights"]).get(TEST_MODEL_KEY)
    return model


def build_random_model(config: MoondreamConfig | None = None, device="cpu", dtype="fp32",
                       seed: int = 0, tokenizer: Tokenizer | None = None,
                       eos_bias: float = 0.0) -> MoondreamModel:
    """A model with random weights built directly in memory (benchmarks, tests)."""
    from .test_model import build_test_tokenizer

    config = config or MoondreamConfig()
    weights = random_weights(config, torch.device(device), parse_dtype(dtype), seed, eos_bias)
    if tokenizer is None:
        tokenizer = Tokenizer(build_test_tokenizer(), config.tokenizer)
    return MoondreamModel(config, weights, tokenizer, model_id=f"random-moondream2-seed{seed}")
