"""A real NaN crash, recorded: a small Transformer whose attention uses the paper's SmoothReLU (Eq. 2)
instead of softmax, normalising each row by its sum (Eq. 3). With a learning rate that is too high
the attention scores blow up within a few iterations: SmoothReLU saturates (to 0 for very negative
scores, and ``exp`` overflows for very large ones), a row of weights becomes 0/0 or inf/inf, and the
loss turns NaN.

Run it:   python examples/nan_smooth_relu.py [--out runs/nan_smooth_relu.zarr]

It trains under ``recorder.record``, stops at the first non-finite loss (as a training script with a
NaN guard would), then reads the recording back and shows where the non-finite values came from:
the first step whose outputs went non-finite while its inputs were all finite.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import recorder

VOCAB, SEQ, D, HEADS = 64, 16, 32, 2


@recorder.paper_step("Eq. 2", description="SmoothReLU(x) = log(1 + exp(x + beta)) / gamma")
def smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    return torch.log(1 + torch.exp(x + beta)) / gamma


@recorder.paper_step("Eq. 3", algorithm="Algorithm 1", step=2,
                     description="attention weights: SmoothReLU(QK^T / sqrt(d)), normalised per row")
class SmoothAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, 2))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        weights = smooth_relu(scores)
        weights = weights / weights.sum(-1, keepdim=True)
        recorder.watch(weights, "attention_weights", expected_range=(0.0, 1.0), reference="Eq. 3")
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))


@recorder.paper_step("Algorithm 1", algorithm="Algorithm 1", step=1, description="pre-norm Transformer block")
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SmoothAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.Sequential(Block(D, HEADS), Block(D, HEADS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tok(idx)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Predict the previous token: solvable only by attending sharply, which drives scores up."""
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    return idx, idx.roll(1, dims=1)


def train(out: Path, iterations: int, lr: float) -> int | None:
    """Train under the recorder; returns the iteration whose loss went non-finite, if any."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with recorder.record(out, model=model, optimizer=opt, mode="full"):
        for it in range(iterations):
            x, y = batch(it)
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            if not torch.isfinite(loss):
                print(f"iteration {it}: loss is {loss.item()} - training stopped")
                return it
            loss.backward()
            opt.step()
            opt.zero_grad()
            if it % 5 == 0:
                print(f"iteration {it}: loss {loss.item():.3f}")
    return None


def origin(path: Path) -> None:
    """Print the first step that produced non-finite values from finite inputs, and what followed."""
    from recorder.store.reader import RunReader

    rank = RunReader(path).rank(0)
    status, parents = rank.column("steps/status"), rank.column("steps/parent")

    def produced_it(i: int) -> bool:  # non-finite outputs from finite inputs
        inputs = [r for r in rank.tensor_records(i) if r.role in ("input", "param", "buffer", "grad_output")]
        return status[i] == 2 and all(not r.nonfinite for r in inputs)

    def inside(j: int, i: int) -> bool:
        while j != -1:
            j = int(parents[j])
            if j == i:
                return True
        return False

    candidates = [i for i in range(len(rank)) if produced_it(i)]
    if not candidates:
        print("no recorded step produced a non-finite value from finite inputs")
        return
    i = candidates[0]
    while inner := [j for j in candidates if inside(j, i)]:  # the innermost step that produced it
        i = inner[0]
    records = rank.tensor_records(i)
    col = lambda n: rank.column(f"steps/{n}")[i]  # noqa: E731
    definition = rank.doc(int(col("definition")))
    paper = definition["paper"]
    phase = ("forward", "backward")[int(col("phase"))]
    print(f"\nfirst non-finite step: #{i} {definition['name']} ({phase}), iteration {int(col('iteration'))}, "
          f"module {rank.doc(int(col('module_path'))) or '<root>'}")
    print(f"  paper: {paper['label']} - {paper['description']}")
    print(f"  code:  {definition['file']}:{definition['line']}")
    for r in records:
        s = r.stats
        print(f"  {r.role:<11} {r.name:<18} {str(list(r.shape)):<15} min {s['min']:>10.4g}  max {s['max']:>10.4g}"
              f"  nan {int(s['nan']):>5}  inf {int(s['inf']):>5}")
    later = [j for j in range(i + 1, len(rank)) if status[j] == 2 and not inside(i, j)][:5]
    for j in (j for j in range(i + 1, len(rank)) if int(parents[j]) == i):  # the steps it called
        out = next((r for r in rank.tensor_records(j) if r.role == "output"), None)
        if out is not None:
            s = out.stats
            print(f"  inside it: #{j} {rank.doc(int(rank.column('steps/name')[j]))} output min {s['min']:.4g} "
                  f"max {s['max']:.4g} nan {int(s['nan'])} inf {int(s['inf'])}")
    names = ", ".join(f"#{j} {rank.doc(int(rank.column('steps/name')[j]))}" for j in later)
    print(f"  then non-finite: {names or 'nothing else recorded (training stopped)'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/nan_smooth_relu.zarr"))
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    crashed_at = train(args.out, args.iterations, args.lr)
    print(f"recording: {args.out}")
    origin(args.out)
    return 0 if crashed_at is not None else 1


if __name__ == "__main__":
    sys.exit(main())
