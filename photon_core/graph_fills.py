"""Zero fills a captured CUDA graph drops: memset nodes whose bytes nothing reads.

torch's cuDNN attention (aten._scaled_dot_product_cudnn_attention: what
F.scaled_dot_product_attention runs on Hopper for the encoders' shapes) zero-fills two
one-element tensors per call, the dropout seed and offset, which cuDNN reads only at dropout
> 0. Captured in a graph they are two memset nodes ahead of each attention kernel, and the
GPU idles ~3-4 us after each (session 21: ~100 of them in Moondream 2's 9-crop encode graph).

How: while a capture collects (`Collector`), ops/sdpa.py runs the cuDNN op itself and reports
the call (`note_fills(before, tensors)`): the memset nodes captured during that call - walked
back from the capture's end after it to `before`, its end when the call began - that write
exactly those tensors' bytes. Only nodes of that call are candidates, so another tensor that
later (or earlier) lives at the same address is never touched. After the capture ends,
`drop(graph, nodes)` deletes them, each one's predecessors joined to its successors: every
other node keeps its order. The graph is instantiated after that (fast/cuda_graph_runner.py
captures with torch.cuda.CUDAGraph(keep_graph=True)).

The CUDA driver API through ctypes (libcuda.so.1). The logic (call_nodes, fills_in, drop) takes
the API as an argument: the CPU tests drive it through a fake graph
(test/core/test_graph_fills.py); the GPU test checks the encode's bits and its node count.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

MEMSET = 2          # CU_GRAPH_NODE_TYPE_MEMSET


class _MemsetParams(ctypes.Structure):
    """CUDA_MEMSET_NODE_PARAMS."""
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t),
                ("value", ctypes.c_uint), ("elementSize", ctypes.c_uint),
                ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class DriverGraphs:
    """The few CUDA driver graph calls the pruning needs (handles as ints)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def _call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: CUresult {rc}")

    def _nodes(self, name: str, node: int) -> list[int]:
        n = ctypes.c_size_t(0)
        self._call(name, ctypes.c_void_p(node), None, ctypes.byref(n))
        arr = (ctypes.c_void_p * max(1, n.value))()
        self._call(name, ctypes.c_void_p(node), arr, ctypes.byref(n))
        return [int(arr[i] or 0) for i in range(n.value)]

    def capture_tail(self, stream: int) -> tuple[int, ...]:
        """The nodes the next captured work on stream will depend on."""
        status = ctypes.c_int(0)
        cid = ctypes.c_uint64(0)
        graph = ctypes.c_void_p()
        deps = ctypes.POINTER(ctypes.c_void_p)()
        n = ctypes.c_size_t(0)
        self._call("cuStreamGetCaptureInfo_v2", ctypes.c_void_p(stream), ctypes.byref(status),
                   ctypes.byref(cid), ctypes.byref(graph), ctypes.byref(deps),
                   ctypes.byref(n))
        if status.value != 1:       # CU_STREAM_CAPTURE_STATUS_ACTIVE
            raise RuntimeError("the stream is not capturing")
        return tuple(int(deps[i] or 0) for i in range(n.value))

    def nodes(self, graph: int) -> list[int]:
        return self._nodes("cuGraphGetNodes", graph)

    def preds(self, node: int) -> list[int]:
        return self._nodes("cuGraphNodeGetDependencies", node)

    def succs(self, node: int) -> list[int]:
        return self._nodes("cuGraphNodeGetDependentNodes", node)

    def kind(self, node: int) -> int:
        t = ctypes.c_int(-1)
        self._call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(t))
        return t.value

    def memset(self, node: int) -> tuple[int, int]:
        """(destination address, bytes) of a memset node."""
        p = _MemsetParams()
        self._call("cuGraphMemsetNodeGetParams", ctypes.c_void_p(node), ctypes.byref(p))
        return p.dst, p.elementSize * p.width * max(1, p.height)

    def add_edge(self, graph: int, a: int, b: int) -> None:
        self._call("cuGraphAddDependencies", ctypes.c_void_p(graph),
                   ctypes.byref(ctypes.c_void_p(a)), ctypes.byref(ctypes.c_void_p(b)),
                   ctypes.c_size_t(1))

    def destroy(self, node: int) -> None:
        self._call("cuGraphDestroyNode", ctypes.c_void_p(node))


def call_nodes(api, before, after) -> list[int]:
    """The nodes captured between two capture ends: walked back from `after` over
    predecessors, never past a node of `before`."""
    stop = set(before)
    seen: set[int] = set()
    todo = [n for n in after if n not in stop]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += [p for p in api.preds(n) if p not in stop and p not in seen]
    return sorted(seen)


def fills_in(api, nodes, spans: dict[int, int]) -> list[int]:
    """The memset nodes among `nodes` that write exactly one of spans {address: bytes}."""
    out = []
    for n in nodes:
        if api.kind(n) == MEMSET:
            dst, nbytes = api.memset(n)
            if spans.get(dst) == nbytes:
                out.append(n)
    return out


def drop(api, graph: int, nodes) -> int:
    """Delete memset nodes from graph, each one's predecessors joined to its successors
    (edges added before the node goes: the graph stays ordered at every point). Returns the
    number dropped."""
    for n in nodes:
        preds = api.preds(n)
        for s in api.succs(n):
            have = set(api.preds(s))
            for p in preds:
                if p not in have:
                    api.add_edge(graph, p, s)
        api.destroy(n)
    return len(nodes)


# ---- the capture-time collection ----------------------------------------------------------

_active: list[list[int]] = []     # the open collections (innermost last): nodes to drop
_api = None


def api() -> DriverGraphs:
    global _api
    if _api is None:
        _api = DriverGraphs()
    return _api


class Collector:
    """Collects the droppable fills of one capture: `with Collector() as nodes:` around the
    capture (or open() / close() around a part of it). on=False: collects nothing (the ops
    keep their plain form)."""

    def __init__(self, on: bool = True):
        self.nodes: list[int] = []
        self.on = on

    def open(self) -> list[int]:
        if self.on:
            _active.append(self.nodes)
        return self.nodes

    def close(self) -> list[int]:
        if _active and _active[-1] is self.nodes:
            _active.pop()
        return self.nodes

    __enter__ = open

    def __exit__(self, *exc) -> None:
        self.close()


def collecting() -> bool:
    """Whether a capture collects fills now (the ops ask before taking their cuDNN form)."""
    return bool(_active)


def _stream_tail(a) -> tuple[int, ...]:
    import torch
    return a.capture_tail(torch.cuda.current_stream().cuda_stream)


def capture_tail() -> tuple[int, ...] | None:
    """The current stream's capture end (None where the driver call fails: the op then runs
    its plain form, and the graph keeps its fills)."""
    try:
        return _stream_tail(api())
    except Exception as e:          # (no libcuda symbol, not capturing, ...)
        log.warning("CUDA graph capture: unread zero fills stay (%s)", e)
        return None


def note_fills(before, tensors) -> None:
    """The op captured since `before` (capture_tail() when it began) zero-filled tensors that
    nothing reads: their memset nodes of that call join the innermost collection (none where
    the driver calls fail: nothing is dropped then)."""
    spans = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    try:
        a = api()
        _active[-1].extend(fills_in(a, call_nodes(a, before, _stream_tail(a)), spans))
    except Exception as e:
        log.warning("CUDA graph capture: unread zero fills stay (%s)", e)
