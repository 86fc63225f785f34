"""`python -m pagoda_engine.bench.lora_kernels`: the multi-LoRA kernels (`worker/model/lora_triton.py`)
at Llama-3.1-8B's projection shapes, µs per call as CUDA-graph replays: the split-K shrink alone,
the expand alone, and the base projection without and with the adapters' part added as the engine
runs them (gate/up with the activation; a lone row's shrink in the matrix-vector kernel's extra
programs), whose difference is what LoRA adds to a decode step per projection (a layer has four;
the engine also folds the norms into q/k/v and gate/up, alike with and without adapters). Rows: a
lone decode (1 row) and a small batch (16 rows, each on a random one of the adapters, as
`pagoda bench --num-loras` draws them).

Each figure runs the call over `--layers` copies of the weights in one graph and divides: the base
weights stream from memory as in a model's step, the LoRA weights are small enough to stay in L2
when timed alone (their time is then the kernels' latency, which is what a decode step pays)."""

from __future__ import annotations

import argparse
import random
import sys

import torch

from pagoda_engine.bench.graph_timing import replay_us

# Llama-3.1-8B's projections: (input width, output slices), as tests/gpu/test_lora_gpu.py.
SHAPES = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (the slots' width)")
    p.add_argument("--slots", type=int, default=8, help="device slots, each holding a random adapter")
    p.add_argument("--rows", default="1,16", help="decode rows per step, comma-separated")
    p.add_argument("--layers", type=int, default=8, help="weight copies a graph runs through")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("lora_kernels: needs a CUDA device")
    if a.rank < 1 or a.slots < 1 or a.layers < 1:
        sys.exit("lora_kernels: --rank, --slots and --layers must be >= 1")
    from pagoda_engine.worker.model import gemv_triton, lora_triton
    from pagoda_engine.worker.model.layers import SiluAndMul, linear
    from pagoda_engine.worker.model.lora import LoRABatch, LoRALayer, _Slice

    device, dtype = torch.device("cuda"), torch.bfloat16
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    batch = LoRABatch(a.slots, 16384, device)
    batch.scales.fill_(2.0)
    act = SiluAndMul()
    layers_per_step = 32  # Llama-3.1-8B
    print(f"{torch.cuda.get_device_name()}: Llama-3.1-8B projections, {a.slots} adapters of rank {a.rank}, "
          f"{a.layers} weight copies; µs per call")
    print("projection  rows  K-splits  shrink  expand  base  base+LoRA  LoRA adds")
    added: dict[int, float] = {}
    for name, (k, sizes) in SHAPES.items():
        slices, offset = [], 0
        for i, n in enumerate(sizes):
            slices.append(_Slice(f"m{i}", offset, n, (0, n, n)))
            offset += n
        loras = [LoRALayer(slices, k, None, k, batch, a.rank, dtype) for _ in range(a.layers)]
        for lora in loras:
            lora.lora_a.normal_(0, k ** -0.5)
            lora.lora_b.normal_(0, a.rank ** -0.5)
        weights = [torch.empty(offset, k, dtype=dtype, device=device).normal_(0, k ** -0.5)
                   for _ in range(a.layers)]
        gated = name == "gate_up"
        for rows in (int(r) for r in a.rows.split(",")):
            slots = [0] if rows == 1 else [rng.randrange(a.slots) for _ in range(rows)]
            batch.set([1] * rows, slots)
            x = torch.randn(rows, k, device=device).to(dtype)
            y = torch.zeros(rows, offset, device=device, dtype=dtype)
            shrunk = [lora_triton.shrink(x, lora.lora_a, batch) for lora in loras]

            # What the engine runs for this projection (the MLP's gate/up with its activation): a
            # lone row shrinks in the matrix-vector kernel's extra programs, more rows apart.
            def base():
                for w in weights:
                    if gated:
                        gemv_triton.gemv_silu_and_mul(x, w)
                    else:
                        linear(x, w)

            def with_lora():
                for w, lora in zip(weights, loras):
                    if rows == 1:
                        out, s = gemv_triton.gemv(x, w, lora=lora.one_row(x))
                        if gated:
                            lora.expand_act(s, out, act)
                        else:
                            lora.expand(s, out)
                    else:
                        out = lora_triton.add_lora(x, linear(x, w), lora, batch)
                        if gated:
                            act(out)

            times = [
                replay_us(lambda: [lora_triton.shrink(x, lora.lora_a, batch) for lora in loras], a.layers),
                replay_us(lambda: [lora_triton.expand_all(s, y, lora, batch) for s, lora in zip(shrunk, loras)],
                           a.layers),
                replay_us(base, a.layers),
                replay_us(with_lora, a.layers),
            ]
            added[rows] = added.get(rows, 0.0) + times[3] - times[2]
            print(f"{name:10s} {rows:5d} {shrunk[0].shape[0]:8d} " + " ".join(f"{t:7.1f}" for t in times)
                  + f" {times[3] - times[2]:8.1f}")
    for rows, us in added.items():
        print(f"{rows} rows: LoRA adds {us:.1f} µs a layer, {us * layers_per_step / 1e3:.3f} ms a decode step "
              f"of {layers_per_step} layers")


if __name__ == "__main__":
    main()
