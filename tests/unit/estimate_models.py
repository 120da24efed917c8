"""Small real models for the estimator tests and benchmarks (importable as ``estimate_models:<factory>``)."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (h // self.heads) ** -0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn = self.drop(scores.masked_fill(~mask, float("-inf")).softmax(-1))
        y = (attn @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    """A GPT-style decoder with the output head tied to the token embedding."""

    def __init__(self, vocab: int = 128, seq: int = 32, hidden: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpt() -> nn.Module:
    return TinyGPT()


class TiedAutoencoder(nn.Module):
    """Decoder reuses the encoder's weight (transposed): one parameter, two uses."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(64, 16)
        self.dec_bias = nn.Parameter(torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(self.enc(x))
        return torch.nn.functional.linear(z, self.enc.weight.t(), self.dec_bias)


def tied() -> nn.Module:
    return TiedAutoencoder()


class SdpaBlock(nn.Module):
    """Attention through ``scaled_dot_product_attention``: the kernel choice decides what is saved."""

    def __init__(self, hidden: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(h, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


def sdpa() -> nn.Module:
    return SdpaBlock()


def broken() -> nn.Module:
    return nn.Linear(7, 3)  # fails on an input whose last dimension is not 7


INPUTS: dict[str, tuple[tuple[int, ...], str]] = {
    "mlp": ((32, 100), "float32"),
    "cnn": ((8, 3, 16, 16), "float32"),
    "gpt": ((4, 32), "int64"),
    "tied": ((16, 64), "float32"),
}
