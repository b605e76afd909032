"""A GPT-like training script that defines its own model in ``__main__`` (the usual case).

    python gpt_train.py [ITERATIONS]

Paper steps: ``Block`` (Algorithm 1, step 5) and ``Attention`` (Eq. 1) are decorated classes,
``smooth_relu`` (Eq. 2) a decorated function. ``Attention`` and ``Block`` take a config dataclass;
``Gate`` stores ints, floats, a tuple and a flag; ``Mixer`` keeps ``self.f = lambda x: ...`` over a
submodule and takes a plain (non-dataclass) config object, so only its constructor can rebuild it.
Every ``__init__`` counts its calls in ``INIT_CALLS``. Dropout is on (train mode); torch runs on 2
threads.
"""

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import recorder

INIT_CALLS = {"Attention": 0, "Gate": 0, "Block": 0, "Mixer": 0}


@dataclass
class GPTConfig:
    vocab: int = 32
    d: int = 16
    heads: int = 2
    layers: int = 2
    seq: int = 8
    dropout: float = 0.1


class MixerConfig:
    """A plain config class (not a dataclass)."""

    def __init__(self, d: int, scale: float) -> None:
        self.d, self.scale = d, scale


@recorder.paper_step("Eq. 2", description="SmoothReLU(x) = log(1 + exp(x + beta)) / gamma")
def smooth_relu(x, beta=1.0, gamma=1.0):
    return torch.log1p(torch.exp(x + beta)) / gamma  # EDIT-MARKER


@recorder.paper_step("Eq. 1", description="causal self-attention")
class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        INIT_CALLS["Attention"] += 1
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        b, t, d = x.shape
        h = self.cfg.heads
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.proj((self.drop(att) @ v).transpose(1, 2).reshape(b, t, d))


class Gate(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        INIT_CALLS["Gate"] += 1
        self.width, self.eps, self.shape, self.use_bias = d, 1e-5, (1, 1, d), True
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        y = x * self.scale.view(self.shape)
        return y + self.eps if self.use_bias else y


@recorder.paper_step("Algorithm 1", step=5, equation="Eq. 7", description="transformer block")
class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        INIT_CALLS["Block"] += 1
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d), nn.LayerNorm(cfg.d)
        self.attn = Attention(cfg)
        self.fc, self.out = nn.Linear(cfg.d, 4 * cfg.d), nn.Linear(4 * cfg.d, cfg.d)
        self.gate = Gate(cfg.d)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.gate(self.out(smooth_relu(self.fc(self.ln2(x)), beta=0.5)))


class Mixer(nn.Module):
    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        INIT_CALLS["Mixer"] += 1
        self.sub = nn.Linear(cfg.d, cfg.d)
        self.f = lambda x: self.sub(x) * cfg.scale

    def forward(self, x):
        return x + self.f(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.d))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.mixer = Mixer(MixerConfig(cfg.d, 0.5))
        self.ln = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(self.mixer(x)))


def main(iterations: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)  # fixed, so that replays with another thread count differ wherever it runs
    cfg = GPTConfig()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for i in range(iterations):
        idx = torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=data)
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("TRAINED", i, float(loss.detach()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
