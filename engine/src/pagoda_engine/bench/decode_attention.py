"""`python -m pagoda_engine.bench.decode_attention`: the ways of attending one new token per
request over a paged KV cache, at serving batch sizes, each as µs per layer and the KV bandwidth
it reaches beside the GPU's measured copy bandwidth. The engine's ways: FlashInfer's
`BatchDecodeWithPagedKVCacheWrapper` on tensor cores (FA2; the first column), and the Triton
kernels of `worker/attention/decode_triton.py` where they serve (one or two requests of up to
`SHORT_CONTEXT` tokens; `LARGE_BATCH` requests or more of up to `LARGE_CONTEXT`, started longest
first; also run here outside those ranges, and in batch order, for comparison). The others are
what it could use instead: FlashInfer's decode with split-KV off or planned as a CUDA graph plans
it, FA3, CUDA cores, and the prefill wrapper given one query token per request. `--min-len 100
--max-len 2048` gives contexts as spread as N1's, where the large-batch kernel's order matters.

Pages are scattered over the pool as a long-running server's are; every layer has a cache of its
own, so small batches do not read from L2."""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from pagoda_engine.bench.offline import measure_copy_bandwidth

# name -> (wrapper kind, wrapper keywords, plan keywords)
VARIANTS = {
    "decode TC fa2 (engine)": ("decode", dict(use_tensor_cores=True), {}),
    "decode TC fa2, no split-KV": ("decode", dict(use_tensor_cores=True), dict(disable_split_kv=True)),
    "decode TC fa2, graph plan": ("graph", dict(use_tensor_cores=True), {}),
    "decode TC fa3": ("decode", dict(use_tensor_cores=True, backend="fa3"), {}),
    "decode CUDA cores": ("decode", dict(use_tensor_cores=False), {}),
    "prefill fa2, 1 token": ("prefill", dict(backend="fa2"), {}),
    "prefill fa3, 1 token": ("prefill", dict(backend="fa3"), {}),
    "triton small batch": ("triton-small", {}, {}),
    "triton large batch, longest first": ("triton-large", {}, dict(longest_first=True)),
    "triton large batch, batch order": ("triton-large", {}, dict(longest_first=False)),
}
LAYERS = 6


def _page_table(lens: list[int], page_size: int, num_pages: int, rng: np.random.Generator):
    counts = [-(-n // page_size) for n in lens]
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    indices = (rng.permutation(num_pages - 1)[:indptr[-1]] + 1).astype(np.int32)
    last = np.array([n - (c - 1) * page_size for n, c in zip(lens, counts)], dtype=np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last)


class TritonDecode:
    """A `decode_triton` kernel with its page table on the device, run as a FlashInfer wrapper is
    (`run(q, cache)`); the large-batch one started in `longest_first` order or in batch order."""

    def __init__(self, kind: str, table, heads, page_size: int, longest_first: bool = True):
        from pagoda_engine.worker.attention import decode_triton

        indptr, _, last = table
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.csr = tuple(a.to(dev) for a in table)
        batch = len(last)
        if kind == "triton-small":  # it refuses more requests than the engine gives it
            self.kernel = decode_triton.SmallBatchDecode(decode_triton.MAX_BATCH, *heads, page_size, dev)
        else:
            self.kernel = decode_triton.LargeBatchDecode(*heads, page_size)
            lens = ((indptr[1:] - indptr[:-1] - 1) * page_size + last).tolist()
            order = decode_triton.longest_first(lens) if longest_first else np.arange(batch, dtype=np.int32)
            self.csr = (*self.csr, torch.from_numpy(order).to(dev))
        self.out = None

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        if self.out is None or self.out.shape != q.shape:
            self.out = torch.empty_like(q)
        self.kernel(q, *cache.unbind(1), *self.csr, out=self.out)
        return self.out


def _wrapper(kind: str, kw: dict, plan_kw: dict, table, heads, page_size: int, workspace, num_pages: int):
    if kind.startswith("triton"):
        return TritonDecode(kind, table, heads, page_size, **plan_kw)
    import flashinfer

    indptr, indices, last = table
    hq, hkv, d = heads
    dtypes = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    if kind == "prefill":
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", **kw)
        qo = torch.arange(len(last) + 1, dtype=torch.int32)
        w.plan(qo, indptr, indices, last, hq, hkv, d, page_size, causal=True, **dtypes)
        return w
    if kind == "graph":
        dev = workspace.device
        kw = dict(kw, use_cuda_graph=True, paged_kv_indptr_buffer=indptr.to(dev),
                  paged_kv_indices_buffer=torch.zeros(num_pages, dtype=torch.int32, device=dev),
                  paged_kv_last_page_len_buffer=last.to(dev))
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **kw)
    w.plan(indptr, indices, last, hq, hkv, d, page_size, **dtypes, **plan_kw)
    return w


def _us_per_layer(w, q, caches, reps: int = 20) -> float:
    for c in caches[:2]:
        w.run(q, c)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        for c in caches:
            w.run(q, c)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(caches))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim (default Llama-3.1-8B's)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batches", default="1,8,32,64,128,192,256,320,384")
    p.add_argument("--min-len", type=int, default=1024, help="contexts are drawn uniformly from [min, max]")
    p.add_argument("--max-len", type=int, default=1152)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    dev = torch.device("cuda")
    num_pages = max(batches) * -(-args.max_len // args.page_size) + 64
    caches = [torch.randn(num_pages, 2, args.page_size, heads[1], heads[2], dtype=torch.bfloat16, device=dev)
              for _ in range(LAYERS)]
    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device=dev)
    copy_tbs = measure_copy_bandwidth(dev) / 1e12
    print(f"GPU {torch.cuda.get_device_name()}; heads {heads}; pages of {args.page_size}; contexts "
          f"{args.min_len}-{args.max_len}; copy bandwidth {copy_tbs:.2f} TB/s")
    print("| batch | " + " | ".join(VARIANTS) + " |")
    print("|---" * (len(VARIANTS) + 1) + "|")
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        lens = rng.integers(args.min_len, args.max_len + 1, size=b).tolist()
        table = _page_table(lens, args.page_size, num_pages, rng)
        q = torch.randn(b, heads[0], heads[2], dtype=torch.bfloat16, device=dev)
        kv_bytes = sum(lens) * heads[1] * heads[2] * 2 * 2
        row = {"batch": b, "kv_bytes_per_layer": kv_bytes}
        for name, (kind, kw, plan_kw) in VARIANTS.items():
            try:
                us = _us_per_layer(_wrapper(kind, kw, plan_kw, table, heads, args.page_size, workspace, num_pages),
                                   q, caches)
                row[name] = {"us": round(us, 1), "tbs": round(kv_bytes / us / 1e6, 2)}
            except Exception as exc:  # a variant this FlashInfer build lacks; the others still run
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        rows.append(row)
        cells = [f"{row[n]['us']:.0f} µs, {row[n]['tbs']:.2f} TB/s" if "us" in row[n] else "n/a" for n in VARIANTS]
        print(f"| {b} | " + " | ".join(cells) + " |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"copy_tbs": copy_tbs, "heads": heads, "page_size": args.page_size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
