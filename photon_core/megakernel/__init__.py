"""The megakernel backend: a decode step compiled into one persistent Triton kernel.

instructions.py  op codes, instruction dataclasses, the int64 table layout
lowering.py      a step program (Moondream 2's block pattern) as megakernel ops, over the
                 fused backend's own tensors; the GEMV block-shape choices
compiler.py      ops -> instructions (row tiles, attention split groups) -> static per-SM
                 schedule -> tensors (table, queues, counters)
python_vm.py     the schedule executed with torch ops (readable ground truth)
kernel.py        the persistent kernel and its launch
megakernel_step.py  one decode step (feedback launch + the megakernel) over a StepState
megakernel_backend.py  the engine backend (EngineOptions.megakernel): the fused backend with
                 its forward piece as the megakernel, or the fused backend and the reason
Measured by bench/bench_megakernel.py (H200); sm_90 builds without a GPU:
bench/compile_megakernel.py.
"""
