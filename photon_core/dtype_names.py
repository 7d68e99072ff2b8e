"""The dtype names load_model accepts ("fp32", "bf16", "fp16" and their long forms), for every
family's loader."""
from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype) -> torch.dtype:
    """A dtype name (or a torch.dtype) -> torch.dtype; a ValueError for anything else."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected fp32, bf16 or fp16")
    return DTYPES[dtype]
