"""`pagoda bench throughput|latency --num-loras N --lora-rank R`: the workload with every request
on a random one of N random LoRA adapters of rank R on all seven projections (q/k/v/o,
gate/up/down), written in PEFT's format for the benchmarked model's shapes, so T1 and L1 can be
measured with adapters against the base model alone.

The adapters' weights are random (the model's are dummy too): A ~ N(0, 1/in), B ~ N(0, 1/r), alpha = r.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from pagoda_engine.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TARGET_MODULES, LoRARequest


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-loras", type=int, default=0,
                   help="run every request on a random one of this many random LoRA adapters (all seven "
                        "projections; turns on --enable-lora, --max-loras this many unless given)")
    p.add_argument("--lora-rank", type=int, default=16, help="with --num-loras: the adapters' rank (default 16)")


def apply_lora_arguments(args: argparse.Namespace) -> None:
    """--num-loras turns on the engine's LoRA flags it needs. ValueError for a bad value."""
    num = getattr(args, "num_loras", 0) or 0
    if num < 0:
        raise ValueError(f"--num-loras must be >= 0, got {num}")
    if not num:
        return
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {args.lora_rank}")
    if args.data_parallel_size > 1:
        raise ValueError("--num-loras runs one engine core: leave out --data-parallel-size")
    args.enable_lora = True
    if args.max_loras == 1:  # the flag's default: every adapter resident, as the T1/L1 targets assume
        args.max_loras = num
    args.max_lora_rank = max(args.max_lora_rank, args.lora_rank)


def _module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection, from config.json."""
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = (cfg.get("num_key_value_heads") or heads) * head_dim
    inter = cfg["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_random_adapters(model_dir: str, num: int, rank: int, out_dir: str, seed: int = 0) -> list[LoRARequest]:
    """`num` adapters of rank `rank` on every target projection of every layer, PEFT's files."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = _module_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for n in range(num):
        path = Path(out_dir) / f"lora-{n}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module in TARGET_MODULES:
                d_in, d_out = shapes[module]
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=gen) * d_in ** -0.5).bfloat16()
                tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=gen) * rank ** -0.5).bfloat16()
        save_file(tensors, str(path / ADAPTER_WEIGHTS))
        (path / ADAPTER_CONFIG).write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGET_MODULES),
            "bias": "none", "base_model_name_or_path": str(model_dir)}))
        requests.append(LoRARequest(f"lora-{n}", n + 1, str(path)))
    return requests


class RandomAdapters:
    """The adapters of a run and each request's draw (seeded: every run of a bench draws alike)."""

    def __init__(self, args: argparse.Namespace, model_dir: str):
        self.dir = tempfile.TemporaryDirectory(prefix="pagoda-bench-loras-")
        self.requests = write_random_adapters(model_dir, args.num_loras, args.lora_rank, self.dir.name)
        self.rank = args.lora_rank
        self.rng = random.Random(args.seed)

    def draw(self) -> LoRARequest:
        return self.rng.choice(self.requests)

    def describe(self) -> dict:
        return {"num_loras": len(self.requests), "lora_rank": self.rank}
