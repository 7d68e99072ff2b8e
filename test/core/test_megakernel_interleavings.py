"""The megakernel's schedule under adversarial interleavings of the SM queues (CPU, the Python
twin python_vm.py): the GPU runs the programs concurrently, so any instruction whose counters
are at their targets may run next, in any order. Here, many random orders of the ready queue
heads (seeded), each must give the same bits as the round-robin order (instructions are atomic
in the VM: a dependency missing from the counters, a read-after-write, write-after-read or
write-after-write between two instructions without a wait path, shows as a difference).
What this cannot see: races inside one instruction's execution on the GPU (memory ordering of
the acquire/release protocol, loads issued before the wait, the per-program LayerNorm
scratch): the VM does not model them."""
from __future__ import annotations

import random

import pytest
import torch

from test_megakernel import FIELDS, _restore, _setup, _snapshot  # noqa: E402

from photon_core.megakernel.python_vm import Deadlock, PythonVM  # noqa: E402


def polls(ins):
    """The waits the kernel polls for ins (the table's: compiler.elide_waits may drop the
    ones its program already made)."""
    return ins.waits if ins.polled is None else ins.polled


class RandomOrderVM(PythonVM):
    """Runs one ready queue head at a time, picked at random (seeded); also counts how many
    steps had more than one ready queue (the interleaving freedom actually exercised)."""

    def __init__(self, compiled, lowering, seed: int):
        super().__init__(compiled, lowering)
        self.rng = random.Random(seed)
        self.choices = 0

    def run(self):
        self.heads_done = {}
        queues = self.c.queues()
        counters = [0] * len(self.c.ops)
        heads = [0] * len(queues)
        done = []
        while len(done) < len(self.c.instrs):
            ready = [p for p, q in enumerate(queues) if heads[p] < len(q) and
                     all(counters[w] >= t for w, t in polls(q[heads[p]]))]
            if not ready:
                raise Deadlock(f"no queue can move after {len(done)} instructions")
            self.choices += len(ready) > 1
            p = self.rng.choice(ready)
            ins = queues[p][heads[p]]
            self.execute(ins)
            counters[ins.signal] += 1
            heads[p] += 1
            done.append(ins)
        return done


@pytest.mark.parametrize("b,n_sm,attn_per,elide", [(2, 7, None, False), (2, 13, 1, False),
                                                   (1, 5, 2, False), (2, 7, None, True)])
def test_random_queue_interleavings_give_the_same_bits(b, n_sm, attn_per, elide):
    from photon_core.megakernel.megakernel_step import MegakernelStep

    m, st, fd = _setup(b=b)
    s0 = _snapshot(st, fd)
    mk = MegakernelStep(fd, st, b, n_sm=n_sm, variant="auto/elide" if elide else None,
                        **({"attn_per": attn_per} if attn_per else {}))
    # (elide: the queues poll only the waits their program has not made yet)
    assert elide == any(polls(i) != i.waits for i in mk.compiled.instrs)
    mk.run_vm()
    ref = _snapshot(st, fd)
    freedom = 0
    for seed in range(12):
        _restore(st, fd, s0)
        vm = RandomOrderVM(mk.compiled, mk.low, seed)
        order = vm.run()
        freedom += vm.choices
        got = _snapshot(st, fd)
        for f in FIELDS:
            assert torch.equal(got[f], ref[f]), (seed, f, [i.op_name for i in order][:40])
    assert freedom > 0, "no interleaving freedom: the test exercised nothing"
    # the check can fail: drop the attention wait of the layers' second GEMVs (x += [a | g]
    # W2^T may then read the attention output before it is written) -> some order differs
    names = [op.name for op in mk.compiled.ops]
    for ins in mk.compiled.instrs:
        if ins.op_name.startswith("w2."):
            ins.waits, ins.polled = (None if ws is None else tuple(
                w for w in ws if not names[w[0]].startswith("attn."))
                for ws in (ins.waits, ins.polled))
    differs = 0
    for seed in range(12):
        _restore(st, fd, s0)
        RandomOrderVM(mk.compiled, mk.low, seed).run()
        got = _snapshot(st, fd)
        differs += any(not torch.equal(got[f], ref[f]) for f in FIELDS)
    assert differs, "a missing dependency went unnoticed"
