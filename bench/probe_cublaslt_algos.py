"""Does cuBLASLt have a faster algorithm than the one torch runs for the encode's GEMMs?
(issue 13: the 9-crop 640x480 encode is ~10.5 ms of cuBLAS GEMMs; torch takes the first
of cuBLASLt's heuristic list, and TunableOp has no other CUDA solution to try.)

For each GEMM shape of Moondream 2's encode (vision tower at 9 crops, M = 6561; image-prefix
prefill, M = 730), bf16 with the bias (and the tanh-GELU) epilogue as the encoder runs it:
  - torch's form (F.linear / ops.linear_gelu), a CUDA graph of --calls calls (median of
    replays, bench_timing.graph_ms);
  - every algorithm of cublasLtMatmulAlgoGetHeuristic's list (up to --algos), called
    through ctypes with the same operands (y^T = W x^T: A = W "T", B = x "N", D [N, M]
    column-major = y [M, N] row-major, the bias per row of D), each timed the same way and
    checked against torch's output (max |diff| / max |y|; "bitwise" where equal).
Prints per shape torch's ms, the list's first, the fastest and its rank, wave count.

Usage (H200): PYTHONPATH=. python3 bench/probe_cublaslt_algos.py [--algos 48] [--calls 20]
                  [--encode-ab [--rounds 2]]
Writes $OUT/probe_cublaslt_algos.json when OUT is set.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_timing import graph_ms  # noqa: E402
from bench.out_dir import write_json  # noqa: E402
from photon_core.ops.linear_gelu import linear_gelu  # noqa: E402

# cublasLt.h / cublas_api.h / library_types.h values
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
EPI_BIAS, EPI_GELU_BIAS = 4, 36
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE = 64 << 20

# (name, M, K, N, gelu)
SHAPES = [("vision qkv", 6561, 1152, 3456, False), ("vision proj", 6561, 1152, 1152, False),
          ("vision fc1+gelu", 6561, 1152, 4304, True), ("vision fc2", 6561, 4304, 1152, False),
          ("prefill qkv", 730, 2048, 6144, False), ("prefill proj", 730, 2048, 2048, False),
          ("prefill fc1+gelu", 730, 2048, 8192, True), ("prefill fc2", 730, 8192, 2048, False),
          ("projection fc1+gelu", 729, 2304, 8192, True),
          ("projection fc2", 729, 8192, 2048, False)]


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_lt() -> ctypes.CDLL:
    """The cuBLASLt that torch loaded (its path from this process's maps, after a GEMM)."""
    a = torch.randn(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(a, a, a[0])
    torch.cuda.synchronize()
    paths = sorted({ln.split()[-1] for ln in open("/proc/self/maps")
                    if "libcublasLt" in ln and ln.split()[-1].startswith("/")})
    for p in paths + ["libcublasLt.so.13", "libcublasLt.so.12"]:
        try:
            return ctypes.CDLL(p)
        except OSError:
            continue
    raise SystemExit(f"no libcublasLt (maps: {paths})")


def declare(lt) -> None:
    """argtypes / restype of the entry points used (size_t / 64-bit arguments exact)."""
    c = ctypes
    vp, pvp, i, sz = c.c_void_p, c.POINTER(c.c_void_p), c.c_int, c.c_size_t
    sigs = {"cublasLtCreate": [pvp],
            "cublasLtMatmulDescCreate": [pvp, i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatrixLayoutCreate": [pvp, i, c.c_uint64, c.c_uint64, c.c_int64],
            "cublasLtMatmulPreferenceCreate": [pvp],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i,
                                               c.POINTER(HeuristicResult), c.POINTER(i)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                               c.POINTER(Algo), vp, sz, vp]}
    for name, args in sigs.items():
        f = getattr(lt, name)
        f.argtypes, f.restype = args, c.c_int
    lt.cublasLtGetVersion.argtypes, lt.cublasLtGetVersion.restype = [], c.c_size_t


class LtGemm:
    """One shape's descriptors; run(algo) launches y = act(x W^T + b) on torch's stream."""

    def __init__(self, lt, handle, x, w, b, y, gelu: bool, ws: torch.Tensor):
        self.lt, self.handle, self.x, self.w, self.b, self.y = lt, handle, x, w, b, y
        m, k = x.shape
        n = w.shape[0]
        c = ctypes
        self.desc = c.c_void_p()
        self._ok(lt.cublasLtMatmulDescCreate(c.byref(self.desc), COMPUTE_32F, R_32F))
        for attr, val in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = c.c_int32(val)
            self._ok(lt.cublasLtMatmulDescSetAttribute(self.desc, attr, c.byref(v), 4))
        epi = c.c_uint32(EPI_GELU_BIAS if gelu else EPI_BIAS)
        self._ok(lt.cublasLtMatmulDescSetAttribute(self.desc, DESC_EPILOGUE, c.byref(epi), 4))
        bp = c.c_void_p(b.data_ptr())
        self._ok(lt.cublasLtMatmulDescSetAttribute(self.desc, DESC_BIAS_POINTER, c.byref(bp),
                                                   8))
        self.a_l, self.b_l, self.d_l = c.c_void_p(), c.c_void_p(), c.c_void_p()
        self._ok(lt.cublasLtMatrixLayoutCreate(c.byref(self.a_l), R_16BF, c.c_uint64(k),
                                               c.c_uint64(n), c.c_int64(k)))
        self._ok(lt.cublasLtMatrixLayoutCreate(c.byref(self.b_l), R_16BF, c.c_uint64(k),
                                               c.c_uint64(m), c.c_int64(k)))
        self._ok(lt.cublasLtMatrixLayoutCreate(c.byref(self.d_l), R_16BF, c.c_uint64(n),
                                               c.c_uint64(m), c.c_int64(n)))
        self.ws = ws
        self.alpha, self.beta = c.c_float(1.0), c.c_float(0.0)

    @staticmethod
    def _ok(status):
        if status != 0:
            raise RuntimeError(f"cublasLt status {status}")

    def close(self) -> None:
        """Destroy the descriptors (cuBLASLt read them when each call was made)."""
        for lay in (self.a_l, self.b_l, self.d_l):
            self.lt.cublasLtMatrixLayoutDestroy(lay)
        self.lt.cublasLtMatmulDescDestroy(self.desc)

    def heuristics(self, count: int) -> list:
        c = ctypes
        pref = c.c_void_p()
        self._ok(self.lt.cublasLtMatmulPreferenceCreate(c.byref(pref)))
        wsz = c.c_uint64(WORKSPACE)
        self._ok(self.lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES,
                                                              c.byref(wsz), 8))
        res = (HeuristicResult * count)()
        got = c.c_int(0)
        self._ok(self.lt.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, self.a_l, self.b_l, self.d_l, self.d_l, pref, count, res,
            c.byref(got)))
        self.lt.cublasLtMatmulPreferenceDestroy(pref)
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def run(self, r: HeuristicResult):
        c = ctypes
        stream = c.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.lt.cublasLtMatmul(
            self.handle, self.desc, c.byref(self.alpha), c.c_void_p(self.w.data_ptr()),
            self.a_l, c.c_void_p(self.x.data_ptr()), self.b_l, c.byref(self.beta),
            c.c_void_p(self.y.data_ptr()), self.d_l, c.c_void_p(self.y.data_ptr()), self.d_l,
            c.byref(r.algo), c.c_void_p(self.ws.data_ptr()), c.c_size_t(WORKSPACE), stream))
        return self.y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--algos", type=int, default=48)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--encode-ab", action="store_true",
                    help="then the encode graph with torch's GEMMs vs the picked algorithms "
                         "(those > 1.02x torch's), ABBA --rounds")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    lt = load_lt()
    declare(lt)
    handle = ctypes.c_void_p()
    LtGemm._ok(lt.cublasLtCreate(ctypes.byref(handle)))
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cublasLt_version": int(lt.cublasLtGetVersion()), "shapes": {}}
    print(f"cublasLt {out['cublasLt_version']}", flush=True)
    g = torch.Generator("cuda").manual_seed(0)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    picks = {}
    for name, m, k, n, gelu in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
        ref_fn = (lambda: linear_gelu(x, w, b)) if gelu else (lambda: F.linear(x, w, b))
        ref = ref_fn()
        scale = ref.float().abs().max().item()
        flop = 2 * m * k * n
        row = {"torch_ms": graph_ms(ref_fn, calls=args.calls), "algos": []}
        row["torch_tflops"] = round(flop / row["torch_ms"] / 1e9, 1)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        lg = LtGemm(lt, handle, x, w, b, y, gelu, ws)
        try:
            found = lg.heuristics(args.algos)
        except RuntimeError as e:
            found, row["error"] = [], repr(e)
        for i, r in enumerate(found):
            rec = {"rank": i, "waves": round(r.wavesCount, 3), "ws": int(r.workspaceSize),
                   "algo": [int(v) for v in r.algo.data[:4]]}
            try:
                y.zero_()
                lg.run(r)
                torch.cuda.synchronize()
                rec["bitwise"] = bool(torch.equal(y, ref))
                rec["rel_diff"] = round((y.float() - ref.float()).abs().max().item() / scale, 5)
                rec["ms"] = graph_ms(lambda r=r: lg.run(r), calls=args.calls)
                rec["vs_torch"] = round(row["torch_ms"] / rec["ms"], 3)
            except Exception as e:  # noqa: BLE001
                rec["error"] = repr(e)[:200]
            row["algos"].append(rec)
        ok = [a for a in row["algos"] if "ms" in a and a["rel_diff"] < 0.02]
        best = min(ok, key=lambda a: a["ms"]) if ok else None
        first = row["algos"][0] if row["algos"] else {}
        print(f"{name:20s} M {m} K {k} N {n}: torch {row['torch_ms']:.4f} ms "
              f"({row['torch_tflops']} TFLOP/s); heuristic #0 {first.get('ms')} "
              f"(bitwise {first.get('bitwise')}); best "
              f"{best and best['ms']} (rank {best and best['rank']}, x{best and best['vs_torch']},"
              f" waves {best and best['waves']}); {len(row['algos'])} algos, "
              f"{len(row['algos']) - len(ok)} failed / off", flush=True)
        out["shapes"][name] = row
        if best is not None and best["vs_torch"] > 1.02:
            picks[(m, k, n, gelu)] = found[best["rank"]]
        lg.close()
        del x, w, b, ref, y, lg
    write_json("probe_cublaslt_algos.json", out)
    if args.encode_ab:
        out["encode_ab"] = encode_ab(lt, handle, ws, picks, args.rounds)
        write_json("probe_cublaslt_algos.json", out)


def routed(lt, handle, ws, picks):
    """F.linear and torch._addmm_activation replaced by forms that run the picked algorithm
    for a picked (M, K, N, gelu) shape of bf16 CUDA operands with a bias (else the original)."""
    lin, act = F.linear, torch._addmm_activation

    def lt_run(x2, w, b, gelu):
        r = picks.get((x2.shape[0], x2.shape[1], w.shape[0], gelu))
        if (r is None or b is None or x2.dtype != torch.bfloat16 or not x2.is_cuda
                or not x2.is_contiguous() or not w.is_contiguous() or b.dim() != 1):
            return None
        y = torch.empty(x2.shape[0], w.shape[0], device=x2.device, dtype=x2.dtype)
        g = LtGemm(lt, handle, x2, w, b, y, gelu, ws)
        g.run(r)
        g.close()
        return y

    def linear(x, w, b=None):
        y = lt_run(x.reshape(-1, x.shape[-1]), w, b, False) if x.dim() >= 2 else None
        return lin(x, w, b) if y is None else y.view(*x.shape[:-1], w.shape[0])

    def addmm_activation(bias, x, wt, beta=1, alpha=1, use_gelu=False):
        y = (lt_run(x, wt.t(), bias, True) if use_gelu and beta == 1 and alpha == 1
             and bias is not None and bias.dim() == 1 else None)
        return act(bias, x, wt, beta=beta, alpha=alpha, use_gelu=use_gelu) if y is None else y
    return lin, act, linear, addmm_activation


def encode_ab(lt, handle, ws, picks, rounds: int) -> dict:
    """The runtime's 9-crop encode graph with torch's GEMMs and with the picked algorithms
    routed in (ab_encode.moondream_encode_rounds)."""
    from bench.ab_encode import moondream_encode_rounds
    lin, act, linear, addmm_activation = routed(lt, handle, ws, picks)

    def switch(label):
        if label == "lt":
            F.linear, torch._addmm_activation = linear, addmm_activation

        def restore():
            F.linear, torch._addmm_activation = lin, act
        return restore
    res = moondream_encode_rounds(["torch", "lt"], switch, rounds)
    res["picked"] = [list(k) for k in picks]
    return res


if __name__ == "__main__":
    main()
