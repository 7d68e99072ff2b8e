"""A model's encode_image in three parts, so the runtime can replay the device part as a CUDA
graph per input layout (fast/graphed_reference_encoder.py); the families' reference engines
(Qwen 3.5, Gemma 4) mix in SplitEncode and provide:
  encode_inputs(image) -> EncodeInputs: the host part (decode; Moondream 2: the crops) and
      the device tensors the device part reads (the frame, the prefix's ids: per-layout ones
      kept by the model); `key` names the layout - one key, the same shapes and host-side
      values (a camera's frames share one);
  encode_body(inputs)  -> the prefix state, computed on the device only (no host sync);
  encode_result(state, inputs, copy) -> the EncodedImage (copy: owning a copy of the state).
encode_image is their composition (`encode_split`; Moondream 2's encode_image adds its crop
modes around it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def upload_frame(array: np.ndarray, device) -> torch.Tensor:
    """HxWx3 uint8 array -> the same uint8 tensor on device (C order). CUDA: through pinned
    host memory with non_blocking, so the host does not wait for the device's queued work (a
    pageable copy synchronizes the stream: Qwen 3.5 0.8B back-to-back queued 640x480 encodes
    spent ~12 ms per call in it, H200 session 14); the caching host allocator keeps the
    pinned block until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(np.require(array, requirements=["C", "W"])).to(device)
    staging = torch.empty(array.shape, dtype=torch.uint8, pin_memory=True)
    np.copyto(staging.numpy(), array)
    return staging.to(device, non_blocking=True)


@dataclass
class EncodeInputs:
    key: tuple
    tensors: dict[str, torch.Tensor]        # on the model's device; the body reads these
    info: dict = field(default_factory=dict)  # host-side values (equal for equal keys)
    t0: float = 0.0                         # perf_counter at the encode's start


class SplitEncode:
    encoded_type: type                      # the family's EncodedImage

    def is_encoded(self, image) -> bool:
        return isinstance(image, self.encoded_type)

    def encode_image(self, image):
        """numpy HxWx3 uint8 RGB | PIL image | path -> the family's EncodedImage (one given is
        returned as is)."""
        if self.is_encoded(image):
            return image
        return self.encode_split(image)

    def encode_split(self, image):
        """The three parts, eagerly: the reference encode."""
        inp = self.encode_inputs(image)
        with torch.inference_mode():
            return self.encode_result(self.encode_body(inp), inp, copy=False)
