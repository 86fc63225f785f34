"""PEFT adapters for the LoRA tests, written with PEFT itself, and PEFT's greedy tokens as the
reference. Not a test module: test modules anywhere under tests/ import it by name."""

from __future__ import annotations

import torch
import transformers

# name -> (rank, alpha, rsLoRA, target modules): every served projection, the attention's q and v
# alone under rsLoRA's scaling, and the output and MLP projections.
ADAPTERS = {
    "all7": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qv": (4, 8, True, ["q_proj", "v_proj"]),
    "mlp": (16, 32, False, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def write_adapter(model_dir, out_dir, rank: int, alpha: float, rslora: bool, targets: list[str], seed: int,
                  std: float = 0.5) -> str:
    """A PEFT LoRA adapter of the model in `model_dir`, saved by PEFT into `out_dir`: A and B
    random of deviation `std` (PEFT's zero B would make it a no-op)."""
    import peft

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, lora_dropout=0.0,
                          task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0, std)
    model.save_pretrained(out_dir)
    return str(out_dir)


def peft_greedy(model_dir, adapter_dir: str | None, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers + PEFT `generate`, greedy, exactly `new_tokens` per prompt (EOS masked)."""
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        out.append(gen[0, len(prompt):].tolist())
    return out
