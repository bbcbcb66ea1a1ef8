"""The seed's model (Flatten + Linear(784, 10)) and a small CNN for comparison."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def seed_model() -> nn.Module:
    """The listing's model: flatten the 28 x 28 image, one linear layer to 10 class scores."""
    # nn.Flatten does what the listing's hand-written Flatten module does: x.view(x.size(0), -1).
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def small_cnn() -> nn.Module:
    """Two convolutions and a linear layer: a few times the seed model's accuracy headroom."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 14 x 14
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 7 x 7
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )


def param_count(model: nn.Module) -> int:
    """Number of trainable parameters (7,850 for the seed model)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter (a tied one once) as one float32 CPU vector, in `parameters()` order:
    a snapshot the parent can compare bit for bit."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def param_digest(model: nn.Module) -> str:
    """A short hash of every parameter's bytes: equal on two ranks only if the weights are equal."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def param_sum(model: nn.Module) -> float:
    """The sum of all parameters in float64: a readable checksum next to the digest."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def deep_mlp(width: int = 512, depth: int = 6) -> nn.Module:
    """`depth` linear layers on MNIST's pixels (1.46M parameters by default, in 1 MB weight
    tensors): enough separate gradients for DDP to split them into several buckets."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


# The one registry of models by name (the MNIST command's --model, lesson 07, bench/scaling).
MODELS = {"linear": seed_model, "cnn": small_cnn, "mlp": deep_mlp}


def build_model(name: str) -> nn.Module:
    """A fresh model by name: "linear" (the seed's), "cnn" or "mlp" (several DDP buckets)."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}") from None
