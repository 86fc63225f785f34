"""`python -m pagoda_engine.bench.gemv_sweep`: the decode projections' cuts (`model/gemv_triton.py`),
timed at Llama-3.1-8B's shapes on one GPU, to choose each shape's cut.

For each shape (q/k/v and gate+up with the RMSNorm folded in, the output and down projections, the
bf16 LM head), weight dtype (FP8 e4m3 with row scales, bf16) and row count (1; 2, 4 and 8 for
speculation and small batches), every candidate cut of the kernel the layers use there is checked
against float32 products of the (dequantized) weights, then timed as decode runs it: launches
back to back in a CUDA graph, with programmatic dependent launch where the engine uses it, each
launch on another copy of the weights (copies enough that a copy is out of L2 when its turn comes
again). Printed: µs and TB/s of weight bytes per cut, then the best per shape beside the cut the
engine picks today (`one_row_config`, `norm_config`, `rows_config`).

Cuts:
- one row, plain (output, down, LM head): `_gemv_kernel`'s columns a program × K tile × warps, and
  split-K (slices of K summed by programs of their own, the last adding them in order); also
  `_rows_kernel` at one row;
- one row with the norm (q/k/v; gate+up with SiLU): `_gemv_rmsnorm_kernel`'s columns a block ×
  warps × blocks a program;
- one FP8 row, plain: also `_gemv_mma_kernel` (rows a program × warps), the tensor-core
  experiment the engine does not launch yet;
- 2, 4, 8 rows: `_rows_kernel`'s columns × K tile × stages × warps, FP8 also with float16 products.

Compiling hundreds of kernels is most of the time: `--jobs` processes compile them first, into
Triton's cache, which the timing process then reads. `--max-seconds` stops the timing where it is
and prints what was measured (a device call has a time limit)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda_engine.bench.graph_timing import replay_us

# (N, K, kind): "norm" folds the RMSNorm in at one row; "gated" is silu(gate) × up over N gate
# rows and N up rows.
SHAPES = {
    "qkv": (6144, 4096, "norm"),
    "o": (4096, 4096, "plain"),
    "gate_up": (14336, 4096, "gated_norm"),
    "down": (4096, 14336, "plain"),
    "lm_head": (128256, 4096, "plain"),
}
L2_BYTES = 60 << 20  # H100/H200: 50 MB; a copy is read again after at least twice this much


@dataclass(frozen=True)
class Candidate:
    shape: str
    dtype: str  # "fp8" | "bf16"
    kernel: str  # "one" | "norm" | "rows"
    config: tuple
    rows: tuple[int, ...]  # row counts timed with this compile

    def label(self) -> str:
        names = {"one": ("bn", "bk", "w", "splitk"), "norm": ("bn", "w", "blocks"),
                 "rows": ("bn", "bk", "stages", "w", "f16"), "mma": ("bn", "w")}[self.kernel]
        return f"{self.kernel}(" + " ".join(f"{n}={int(v)}" for n, v in zip(names, self.config)) + ")"


def _p2(k: int) -> int:
    return 1 << (k - 1).bit_length()


def candidates(shapes: list[str], dtypes: list[str], rows: list[int]) -> list[Candidate]:
    """Every cut to try, FP8 first (the target), then bf16 (which must not regress)."""
    out: list[Candidate] = []
    few = tuple(r for r in rows if r > 1)
    for dtype in dtypes:
        elem = 1 if dtype == "fp8" else 2
        for shape in shapes:
            n, k, kind = SHAPES[shape]
            if shape == "lm_head" and dtype == "fp8":
                continue  # the LM head stays bf16 under --quantization fp8
            gated = kind == "gated_norm"
            if 1 in rows and "norm" in kind:
                for bn, warps, blocks in itertools.product((1, 2, 4, 8, 16, 32), (4, 8, 16), (1, 2, 4)):
                    # The whole rows sit in registers: at most 256 bytes of weights a thread.
                    per_thread = bn * (2 if gated else 1) * _p2(k) * elem / (32 * warps)
                    if 32 <= per_thread <= 256 and (blocks == 1 or dtype == "fp8" or blocks == 2):
                        out.append(Candidate(shape, dtype, "norm", (bn, warps, blocks), (1,)))
            if 1 in rows and kind == "plain":
                for bn, bk, warps in itertools.product((1, 2, 4, 8, 16), (1024, 2048, 4096), (4, 8)):
                    # float32 partial sums of the tile: at most 64 a thread.
                    if bk <= _p2(k) and bn * bk <= 64 * 32 * warps and bn * bk >= 32 * warps * 4:
                        out.append(Candidate(shape, dtype, "one", (bn, bk, warps, 1), (1,)))
                if shape != "lm_head":
                    for bn, bk, split in itertools.product((2, 4), (1024, 2048), (2, 4)):
                        out.append(Candidate(shape, dtype, "one", (bn, bk, 4, split), (1,)))
                if dtype == "fp8":  # the tensor-core one-row kernel (an experiment: the engine does not launch it)
                    for bn, warps in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4)):
                        out.append(Candidate(shape, dtype, "mma", (bn, warps), (1,)))
            if shape == "lm_head":
                continue
            # bf16: the few-row cuts were swept on an H100 already; here the nearest ones.
            f16s, stage_counts = ((False, True), (3, 5)) if dtype == "fp8" else ((False,), (5,))
            for bn, bk, stages, warps, f16 in itertools.product((32, 64, 128), (128, 256), stage_counts, (4, 8), f16s):
                # 128-wide blocks want 8 warps; smem: stages × (bn × bk weight + bk × 16 rows)
                if (bn == 128) != (warps == 8) or stages * (bn * bk * elem + bk * 16 * 2) > 228 * 1024:
                    continue
                timed = few + ((1,) if 1 in rows and kind == "plain" else ())
                if timed:
                    out.append(Candidate(shape, dtype, "rows", (bn, bk, stages, warps, f16), timed))
    return out


@dataclass
class Weights:
    """A shape's weight copies (L2-cold rotation), the row scales, and what the kernels must give."""
    copies: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    dense: torch.Tensor = field(repr=False)  # float32 weight of copy 0, for the reference
    norm_weight: torch.Tensor | None = None


def make_weights(shape: str, dtype: str, device: torch.device, timing: bool = True) -> Weights:
    """Random weights (FP8: quantized per row) and their float32 values; with `timing`, copies of
    them enough for the L2-cold rotation, else (compiling) one copy of no particular values."""
    from pagoda_engine.worker.model.fp8_math import quantize_rows

    n, k, kind = SHAPES[shape]
    rows = 2 * n if kind == "gated_norm" else n
    elem = 1 if dtype == "fp8" else 2
    torch_dtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    nw = torch.ones(k, device=device, dtype=torch.bfloat16) if "norm" in kind else None
    if not timing:
        scale = torch.ones(rows, device=device) if dtype == "fp8" else None
        return Weights([torch.zeros(rows, k, device=device, dtype=torch_dtype)], [scale], torch.empty(0), nw)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(rows, k, device=device, generator=gen) * k ** -0.5
    q, s = quantize_rows(w) if dtype == "fp8" else (w.bfloat16(), None)
    del w
    dense = q.float() * s[:, None] if s is not None else q.float()
    count = min(64, max(2, math.ceil(2 * L2_BYTES / (rows * k * elem)) + 1))
    copies = [q] + [q.clone() for _ in range(count - 1)]  # the timing copies: their bytes matter
    scales = [s] + [s.clone() if s is not None else None for _ in range(count - 1)]
    if nw is not None:
        nw = (1 + 0.2 * torch.randn(k, device=device, generator=gen)).bfloat16()
    return Weights(copies, scales, dense, nw)


def runner(c: Candidate, m: int, w: Weights, x: torch.Tensor, residual: torch.Tensor):
    """A function of the copy index that launches the candidate once (its output returned)."""
    from pagoda_engine.worker.model import gemv_triton as g

    n, k, kind = SHAPES[c.shape]
    gated = kind == "gated_norm"
    if c.kernel == "norm":
        cfg = g.NormConfig(*c.config)
        return lambda i: g.gemv_rmsnorm(x, residual, w.norm_weight, 1e-5, w.copies[i], gated=gated,
                                        scale=w.scales[i], config=cfg)[0]
    if c.kernel == "one":
        cfg = g.OneRowConfig(*c.config)
        return lambda i: g._launch_one(x, w.copies[i], w.scales[i], None, n, gated, cfg)
    if c.kernel == "mma":
        cfg = g.MmaConfig(*c.config)
        return lambda i: g._launch_mma(x, w.copies[i], w.scales[i], n, cfg)
    cfg = g.RowsConfig(*c.config)
    return lambda i: g._launch_rows(x, w.copies[i], w.scales[i], None, n, gated, cfg)


def reference(c: Candidate, w: Weights, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    n, k, kind = SHAPES[c.shape]
    a = x.float()
    if c.kernel == "norm":
        h = x.float() + residual.float()
        a = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.norm_weight.float()).bfloat16().float()
    y = a @ w.dense.T
    if kind == "gated_norm":
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def graph_us(launch, copies: int, launches: int = 48, replays: int = 5) -> float:
    """µs a launch: `launches` launches (copy after copy) in one CUDA graph, replayed."""
    return replay_us(lambda: [launch(j % copies) for j in range(launches)], launches, replays)


def weight_bytes(shape: str, dtype: str) -> int:
    n, k, kind = SHAPES[shape]
    rows = 2 * n if kind == "gated_norm" else n
    return rows * k * (1 if dtype == "fp8" else 2) + (rows * 4 if dtype == "fp8" else 0)


def default_label(shape: str, dtype: str, m: int) -> str:
    """The cut the engine picks for this shape today, as `Candidate.label` writes it."""
    from pagoda_engine.worker.model import gemv_triton as g

    n, k, kind = SHAPES[shape]
    gated, fp8 = kind == "gated_norm", dtype == "fp8"
    if m == 1 and "norm" in kind:
        return Candidate(shape, dtype, "norm", tuple(g.norm_config(n, k, gated, fp8)), (1,)).label()
    if m == 1:
        return Candidate(shape, dtype, "one", tuple(g.one_row_config(n, k, gated, fp8)), (1,)).label()
    cfg = tuple(g.rows_config(n, k, gated, fp8))
    return Candidate(shape, dtype, "rows", cfg[:4] + (cfg[4] and fp8,), (m,)).label()


def compile_worker(cands: list[Candidate], device: torch.device) -> None:
    """Launch each candidate once (compiling it into Triton's cache); values do not matter."""
    cache: dict = {}
    for c in cands:
        key = (c.shape, c.dtype)
        if key not in cache:
            cache.clear()
            cache[key] = make_weights(c.shape, c.dtype, device, timing=False)
        w = cache[key]
        k = SHAPES[c.shape][1]
        # Triton compiles a row count of 1 apart (it specialises integer arguments equal to 1).
        for m in sorted({min(c.rows), max(c.rows)}):
            x = torch.randn(m, k, device=device).bfloat16()
            try:
                runner(c, m, w, x, torch.randn_like(x))(0)
            except Exception as e:  # noqa: BLE001 - reported again, with the reason, by the timing pass
                print(f"compile {c.shape} {c.dtype} {c.label()}: {type(e).__name__}", file=sys.stderr)
    torch.cuda.synchronize()


def check(c: Candidate, m: int, w: Weights, device: torch.device):
    """(status, launch): "ok" and a function of the copy index that launches the cut, when its
    output is the float32 product within 2 % of the largest value (split-K: the same bits twice);
    else what went wrong."""
    k = SHAPES[c.shape][1]
    gen = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, k, device=device, generator=gen).bfloat16()
    residual = torch.randn(m, k, device=device, generator=gen).bfloat16()
    try:
        launch = runner(c, m, w, x, residual)
        got = launch(0).float()
        expected = reference(c, w, x, residual)
        err = ((got - expected).abs().max() / expected.abs().max().clamp(min=1e-6)).item()
        if not err < 2e-2:
            return f"WRONG (max error {err:.3g} of the largest value)", None
        if c.kernel == "one" and c.config[3] > 1 and not torch.equal(launch(0), launch(0)):
            return "WRONG (split-K not the same bits twice)", None
        return "ok", launch
    except Exception as e:  # noqa: BLE001 - a cut that does not compile or fit is a result too
        return f"FAILED ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})", None


def measure(c: Candidate, m: int, w: Weights, device: torch.device) -> tuple[str, float]:
    """(status, µs a launch) of a cut at m rows; µs only when `check` passes."""
    status, launch = check(c, m, w, device)
    return status, graph_us(launch, len(w.copies)) if launch is not None else float("nan")


def chain_us(dtype: str, device: torch.device, layers: int = 32) -> float:
    """µs of one decode step's projections at one row, as the engine cuts them today: `layers`
    layers of q/k/v (norm folded in), output, gate+up (norm and SiLU folded in), down, each layer
    with weights of its own (so all come from HBM, as in decode), then the bf16 LM head; in one
    CUDA graph with programmatic dependent launch, as a decode step runs them, without the
    attention between them (the output projection reads the first rows of q/k/v's result)."""
    from pagoda_engine.worker.model import gemv_triton as g
    from pagoda_engine.worker.model.fp8_math import quantize_rows

    def weight(n: int, k: int):
        w = torch.randn(n, k, device=device) * k ** -0.5
        return quantize_rows(w) if dtype == "fp8" else (w.bfloat16(), None)

    hidden, inter = SHAPES["o"][0], SHAPES["gate_up"][0]
    stack = [(weight(SHAPES["qkv"][0], hidden), weight(hidden, hidden), weight(2 * inter, hidden),
              weight(hidden, inter)) for _ in range(layers)]
    lm_head = (torch.randn(SHAPES["lm_head"][0], hidden, device=device) * hidden ** -0.5).bfloat16()
    nw = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    x0 = torch.randn(1, hidden, device=device).bfloat16()

    def step():
        h, residual = x0, torch.zeros_like(x0)
        for (qkv, qkv_s), (o, o_s), (gate_up, gate_up_s), (down, down_s) in stack:
            q, residual = g.gemv_rmsnorm(h, residual, nw, 1e-5, qkv, scale=qkv_s)
            attn = g.gemv(q[:, :hidden], o, None, o_s)
            act, residual = g.gemv_rmsnorm(attn, residual, nw, 1e-5, gate_up, gated=True, scale=gate_up_s)
            h = g.gemv(act, down, None, down_s)
        return g.gemv(h, lm_head)

    return graph_us(lambda i: step(), 1, launches=1, replays=10)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head", help="of " + ",".join(SHAPES))
    p.add_argument("--dtypes", default="fp8,bf16")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="processes that compile the candidates first (1: compile while timing)")
    p.add_argument("--max-seconds", type=float, default=0.0, help="stop timing after this long (0: never)")
    p.add_argument("--json", default="", help="also write one JSON line per timed cut here")
    p.add_argument("--chain", action="store_true",
                   help="only time one decode step's projections (32 layers and the LM head) as the engine cuts them")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)  # "i/J": compile the i-th of J slices
    a = p.parse_args(argv)
    device = torch.device("cuda")
    cands = candidates(a.shapes.split(","), a.dtypes.split(","), [int(r) for r in a.rows.split(",")])
    if a.worker:
        i, j = (int(v) for v in a.worker.split("/"))
        compile_worker(cands[i::j], device)
        return
    if a.chain:
        for dtype in a.dtypes.split(","):
            floor = sum(weight_bytes(s, dtype) for s in ("qkv", "o", "gate_up", "down")) * 32
            floor += weight_bytes("lm_head", "bf16")
            us = chain_us(dtype, device)
            print(f"{dtype} decode step's projections (32 layers + LM head, {floor / 1e9:.2f} GB): {us:.0f} us, "
                  f"{floor / (us * 1e-6) / 1e12:.2f} TB/s", flush=True)
            torch.cuda.empty_cache()
        return
    t0 = time.monotonic()
    print(f"{torch.cuda.get_device_name()}: {len(cands)} cuts", flush=True)
    if a.jobs > 1:
        procs = [subprocess.Popen([sys.executable, "-m", "pagoda_engine.bench.gemv_sweep", *(argv or sys.argv[1:]),
                                   "--worker", f"{i}/{a.jobs}"]) for i in range(a.jobs)]
        # Past 60 % of the time allowed, what is left compiles as it is timed.
        deadline = t0 + 0.6 * a.max_seconds if a.max_seconds else None
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()) if deadline else None)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(f"compiled in {time.monotonic() - t0:.0f} s", flush=True)
    out = open(a.json, "w") if a.json else None
    results: dict[tuple, list[tuple[float, str]]] = {}
    w_cache: dict = {}
    stopped = False
    for c in cands:
        if a.max_seconds and time.monotonic() - t0 > a.max_seconds:
            stopped = True
            break
        key = (c.shape, c.dtype)
        if key not in w_cache:
            w_cache.clear()
            torch.cuda.empty_cache()
            w_cache[key] = make_weights(c.shape, c.dtype, device)
        w = w_cache[key]
        for m in c.rows:
            status, us = measure(c, m, w, device)
            tbs = weight_bytes(c.shape, c.dtype) / (us * 1e-6) / 1e12 if status == "ok" else float("nan")
            print(f"{c.shape:8s} {c.dtype:4s} rows={m} {c.label():48s} {us:8.2f} us {tbs:5.2f} TB/s  {status}",
                  flush=True)
            if status == "ok":
                results.setdefault((c.shape, c.dtype, m), []).append((us, c.label()))
            if out:
                out.write(json.dumps({"shape": c.shape, "dtype": c.dtype, "rows": m, "cut": c.label(), "us": us,
                                      "tbs": tbs, "status": status}) + "\n")
    if stopped:
        print(f"stopped after {a.max_seconds:.0f} s (--max-seconds)")
    print("\nbest per shape (µs, TB/s of weight bytes), against the engine's cut today:")
    for (shape, dtype, m), timed in sorted(results.items()):
        timed.sort()
        best_us, best = timed[0]
        now = default_label(shape, dtype, m)
        now_us = next((us for us, label in timed if label == now), float("nan"))
        tb = weight_bytes(shape, dtype) / 1e12 * 1e6
        print(f"{shape:8s} {dtype:4s} rows={m}: best {best} {best_us:.2f} us ({tb / best_us:.2f} TB/s); "
              f"now {now} {now_us:.2f} us ({tb / now_us:.2f} TB/s); runner-up "
              + (f"{timed[1][1]} {timed[1][0]:.2f}" if len(timed) > 1 else "-"))
    if out:
        out.close()


if __name__ == "__main__":
    main()
