"""photon_core/graph_fills.py's logic on a fake CUDA graph (the driver calls need a GPU:
test_encode_crops_in_graph_gpu.py checks the real encode graph's bits): which memset nodes a
call reports (only its own, only the exact spans), and how dropping them keeps every other
node's order; ops/sdpa.attention is F.scaled_dot_product_attention's result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from photon_core import graph_fills
from photon_core.ops import sdpa

KERNEL = 0


class FakeGraph:
    """A graph as the driver would hold it: node -> (type, memset (dst, bytes)), edges."""

    def __init__(self):
        self.kinds: dict[int, int] = {}
        self.spans: dict[int, tuple[int, int]] = {}
        self.edges: set[tuple[int, int]] = set()
        self.added: list[tuple[int, int]] = []

    def node(self, n: int, after=(), memset=None) -> int:
        self.kinds[n] = graph_fills.MEMSET if memset else KERNEL
        if memset:
            self.spans[n] = memset
        for p in after:
            self.edges.add((p, n))
        return n

    # the driver calls graph_fills uses
    def preds(self, n):
        return sorted(a for a, b in self.edges if b == n)

    def succs(self, n):
        return sorted(b for a, b in self.edges if a == n)

    def kind(self, n):
        return self.kinds[n]

    def memset(self, n):
        return self.spans[n]

    def add_edge(self, graph, a, b):
        assert graph == "g" and (a, b) not in self.edges, "an edge added twice"
        self.edges.add((a, b))
        self.added.append((a, b))

    def destroy(self, n):
        del self.kinds[n]
        self.edges = {(a, b) for a, b in self.edges if n not in (a, b)}

    def reaches(self, a, b) -> bool:
        todo, seen = [a], set()
        while todo:
            x = todo.pop()
            if x == b:
                return True
            seen.add(x)
            todo += [s for s in self.succs(x) if s not in seen]
        return False


def _cudnn_call_graph():
    """A chain as a stream capture makes it: an earlier zero fill at the seed's address
    (another tensor that lived there first), the GEMM, the attention call's two fills and
    kernel, the next GEMM."""
    g = FakeGraph()
    g.node(1, memset=(0x1000, 8))              # not the call's: must stay
    g.node(2, after=[1])                        # qkv GEMM (the capture end before the call)
    g.node(3, after=[2], memset=(0x1000, 8))   # seed
    g.node(4, after=[3], memset=(0x1200, 8))   # offset
    g.node(5, after=[4], memset=(0x1400, 64))  # a fill of another size at a listed address
    g.node(6, after=[5])                        # the attention kernel
    g.node(7, after=[6])                        # the next GEMM
    return g


def test_a_call_reports_only_its_own_exact_fills():
    g = _cudnn_call_graph()
    nodes = graph_fills.call_nodes(g, before=(2,), after=(6,))
    assert nodes == [3, 4, 5, 6]
    spans = {0x1000: 8, 0x1200: 8, 0x1400: 8}
    assert graph_fills.fills_in(g, nodes, spans) == [3, 4]
    # the whole graph as the "call": the earlier fill at the seed's address would be taken
    assert 1 in graph_fills.fills_in(g, graph_fills.call_nodes(g, (), (6,)), spans)


def test_dropping_fills_keeps_every_other_order():
    g = _cudnn_call_graph()
    order = [(a, b) for a in (1, 2, 5, 6, 7) for b in (1, 2, 5, 6, 7) if g.reaches(a, b)]
    assert graph_fills.drop(g, "g", [3, 4]) == 2
    assert set(g.kinds) == {1, 2, 5, 6, 7}
    assert g.preds(5) == [2]                    # the GEMM now runs right before
    for a, b in order:
        assert g.reaches(a, b), (a, b)


def test_dropping_a_node_joins_every_predecessor_to_every_successor_once():
    g = FakeGraph()
    for n in (1, 2):
        g.node(n)
    g.node(3, after=[1, 2], memset=(0x2000, 8))
    g.node(4, after=[3, 1])                     # already after 1: that edge is not re-added
    g.node(5, after=[3])
    graph_fills.drop(g, "g", [3])
    assert sorted(g.added) == [(1, 5), (2, 4), (2, 5)]
    assert g.preds(4) == [1, 2] and g.preds(5) == [1, 2]


def test_collectors_nest_and_close():
    assert not graph_fills.collecting()
    outer = graph_fills.Collector()
    with outer as nodes:
        assert graph_fills.collecting() and graph_fills._active[-1] is nodes
        inner = graph_fills.Collector()
        inner.open()
        assert graph_fills._active[-1] is inner.nodes
        inner.close()
        assert graph_fills._active[-1] is nodes
        with graph_fills.Collector(on=False) as off:     # (a graph that is not kept)
            assert graph_fills._active[-1] is nodes and off == []
    assert not graph_fills.collecting()
    with graph_fills.Collector(on=False):
        assert not graph_fills.collecting()


@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_is_torchs_attention(gqa):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g)
    k, v = (torch.randn(2, 2 if gqa else 4, 9, 8, generator=g) for _ in range(2))
    with graph_fills.Collector():              # collecting changes nothing off the GPU
        out = sdpa.attention(q, k, v, scale=0.3, enable_gqa=gqa)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=0.3,
                                                           enable_gqa=gqa))
