"""Random weights for the test models (CPU and GPU): larger than transformers' default init, norms
away from 1 and a unit-variance embedding, so greedy choices are clear rather than ties and a
misplaced weight shows. Not a test module: test modules anywhere under tests/ import it by name."""

import torch


def randomise(model: torch.nn.Module, std: float, norm_spread: float = 0.2) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + norm_spread * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0, 1.0)
            else:
                p.normal_(0, std)
