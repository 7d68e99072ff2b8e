"""The megakernel backend: a decode step compiled into one persistent Triton kernel.

instructions.py  instruction dataclasses and the int64 table layout
lowering_moondream.py  Moondream 2's decode step as a program of ops (over the fused
                 backend's prepared weights)
compiler.py      program -> instructions (row tiles) -> static per-SM schedule -> tensors
python_vm.py     the schedule executed with torch ops (readable ground truth)
kernel.py        the persistent kernel and its launch
"""
