"""GPU check at the real Moondream 2 shapes (bf16, random weights): the graphed prompt prefill
gives the same last hidden state in two FastEngines built in one process, and stays within
bf16 rounding of the eager reference prefill. Prints max |diff| per pair.

    PYTHONPATH=. python3 bench/check_prefill_engines.py
"""
import numpy as np
import torch

from photon_core.fast import FastEngine
from photon_core.moondream.config import MoondreamConfig
from photon_core.moondream.model import build_random_model
from photon_core.task import Task


def main() -> None:
    m = build_random_model(MoondreamConfig(), device="cuda", dtype="bf16", seed=0)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    enc = m.encode_image(frame)
    for task in (Task("detect", object="person", max_objects=5),
                 Task("query", question="What is in front of the robot?", max_tokens=32)):
        ref = m.start(enc, task).hidden[0, 0].float()
        hs = []
        for graphed in (True, True, False):
            fe = FastEngine(m, max_batch=4, graphed_prefill=graphed)
            run = fe.start(enc, task)
            torch.cuda.synchronize()
            hs.append(fe.state.hidden[run.row].float().clone())
            run.cancel()
            fe.close()
        d = lambda a, b: (a - b).abs().max().item()  # noqa: E731
        print(f"{task.skill}: |ref| max {ref.abs().max().item():.2f}; graphed engine A vs B "
              f"{d(hs[0], hs[1]):.3g}; graphed vs eager prefill {d(hs[0], hs[2]):.3g}; "
              f"graphed vs reference {d(hs[0], ref):.3g}; eager vs reference {d(hs[2], ref):.3g}")


if __name__ == "__main__":
    main()
