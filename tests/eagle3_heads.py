"""EAGLE-3 heads for tests: a random head written in the format its authors publish and vLLM loads
(config.json naming LlamaForCausalLMEagle3; `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`
in safetensors), and an independent plain-torch reading of what such a head computes and drafts
(no paged KV, no engine code: the whole sequence recomputed each step, the target's hidden states
from transformers). Not a test module: test modules anywhere under tests/ import it by name."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

EPS, THETA = 1e-6, 10000.0


def write_eagle3_head(out_dir, target_dir, draft_vocab_size: int, seed: int = 0, hidden: int = 64, heads: int = 4,
                      kv_heads: int = 2, head_dim: int = 16, intermediate: int = 128) -> Path:
    """A random EAGLE-3 head for the target in `target_dir` (its vocabulary and hidden size):
    `draft_vocab_size` target tokens in its draft vocabulary, no embedding of its own."""
    HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = hidden, heads, kv_heads, head_dim, intermediate
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_dir) / "config.json").read_text())
    vocab, target_hidden = target["vocab_size"], target["hidden_size"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    def norm(n):
        return (1 + 0.2 * torch.randn(n, generator=g)).contiguous()

    draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {
        "fc.weight": w(HIDDEN, 3 * target_hidden),
        "midlayer.input_layernorm.weight": norm(HIDDEN),
        "midlayer.hidden_norm.weight": norm(HIDDEN),
        "midlayer.post_attention_layernorm.weight": norm(HIDDEN),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
        "norm.weight": norm(HIDDEN),
        "lm_head.weight": w(draft_vocab_size, HIDDEN, std=0.5),
        "d2t": (draft_ids - torch.arange(draft_vocab_size)).to(torch.int64),
        "t2d": t2d,
    }
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 2048,
              "rms_norm_eps": EPS, "rope_theta": THETA, "vocab_size": vocab, "draft_vocab_size": draft_vocab_size,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config))
    return out


class ReferenceEagle3:
    """What the head in `head_dir` drafts after a request's tokens, read with plain torch."""

    def __init__(self, head_dir, target_dir):
        from safetensors.torch import load_file

        self.w = load_file(str(Path(head_dir) / "model.safetensors"))
        config = json.loads((Path(head_dir) / "config.json").read_text())
        self.heads, self.kv_heads, self.head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                                    config["head_dim"])
        self.target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        n = self.target.config.num_hidden_layers
        self.layers = (2, n // 2, n - 3)  # vLLM's choice of the target's layers
        self.embed = self.target.model.embed_tokens.weight

    @staticmethod
    def _rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))

    def _rope(self, x, positions):
        d = self.head_dim
        inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = positions[:, None].float() * inv[None]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, token_ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a whole sequence of (token, input hidden state) pairs at positions 0..T-1,
        causally: (normalised, pre-norm) hidden states [T, H]."""
        w, t = self.w, len(token_ids)
        HEADS, KV_HEADS, HEAD_DIM = self.heads, self.kv_heads, self.head_dim
        p = "midlayer."
        emb = self._rms(self.embed[torch.tensor(token_ids)], w[p + "input_layernorm.weight"])
        residual = hidden
        x = torch.cat([emb, self._rms(hidden, w[p + "hidden_norm.weight"])], dim=-1)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM)
        positions = torch.arange(t)
        q, k = self._rope(q, positions), self._rope(k, positions)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        o = o.transpose(0, 1).reshape(t, HEADS * HEAD_DIM) @ w[p + "self_attn.o_proj.weight"].T
        residual = o + residual
        h = self._rms(residual, w[p + "post_attention_layernorm.weight"])
        mlp = (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        prenorm = mlp + residual
        return self._rms(prenorm, w["norm.weight"]), prenorm

    def target_features(self, tokens: list[int]) -> torch.Tensor:
        """fc of the target's hidden states entering its three layers, at every position of `tokens`."""
        out = self.target(torch.tensor([tokens]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in self.layers], dim=-1)  # hidden_states[i]: layer i's input
        return aux @ self.w["fc.weight"].T

    def draft_token(self, normed_row: torch.Tensor) -> int:
        best = int((normed_row @ self.w["lm_head.weight"].T).argmax())
        return best + int(self.w["d2t"][best])

    @torch.no_grad()
    def drafts(self, tokens: list[int], n: int) -> list[int]:
        """The head's n greedy drafts after `tokens`: position j pairs the target's features at j
        with token j + 1; each later step pairs the head's own pre-norm output with its draft."""
        hidden = list(self.target_features(tokens[:-1]))
        ids = list(tokens[1:])
        out = []
        for _ in range(n):
            normed, prenorm = self.forward(ids, torch.stack(hidden))
            out.append(self.draft_token(normed[-1]))
            hidden.append(prenorm[-1])
            ids.append(out[-1])
        return out
