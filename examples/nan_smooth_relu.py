"""A real NaN crash, recorded and debugged: a small Transformer whose attention uses the paper's
SmoothReLU (Eq. 2, ``log(1 + exp(x + beta)) / gamma``) instead of softmax, normalising each row by
its sum (Eq. 3). With a learning rate that is too high the attention scores grow until ``exp``
overflows: SmoothReLU returns Inf, the row becomes inf/inf, and the loss turns NaN.

Run it:   python examples/nan_smooth_relu.py [--out runs/nan_smooth_relu.zarr] [--no-tui]

It trains under ``recorder.record`` and stops at the first non-finite loss (as a training script
with a NaN guard would). Then, from the recording alone: the origin (the first step whose outputs
went non-finite from finite inputs) and the operation inside it, what `pdbg bisect --ops` prints;
two fixes tried on the recorded step (a numerically stable SmoothReLU swapped in, and the input
clamped); a failure bundle to share; and the TUI opened at the origin when the terminal is
interactive (the command to open it otherwise).
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
from recorder.framework import pdbg_program

VOCAB, SEQ, D, HEADS = 64, 16, 32, 2


@recorder.paper_step("Eq. 2", description="SmoothReLU(x) = log(1 + exp(x + beta)) / gamma")
def smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    return torch.log(1 + torch.exp(x + beta)) / gamma


def stable_smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    """The same function without the overflow: softplus(x) = log(1 + exp(x)), computed stably."""
    return F.softplus(x + beta) / gamma


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
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-6)
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
    """Train under the recorder until the loss goes non-finite, which raises, as a training loop's
    guard does: the run dies, and its recording is marked crashed. Returns that iteration, if any."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    try:
        with recorder.record(out, model=model, optimizer=opt, mode="full"):
            for it in range(iterations):
                x, y = batch(it)
                loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"iteration {it}: loss is {loss.item()}")
                loss.backward()
                opt.step()
                opt.zero_grad()
                if it % 5 == 0:
                    print(f"iteration {it}: loss {loss.item():.3f}")
    except FloatingPointError as exc:
        print(f"{exc} - the training died (FloatingPointError)")
        return int(str(exc).split(":")[0].split()[-1])
    return None


def origin(path: Path) -> None:
    """Print the first step that produced non-finite values from finite inputs (what `pdbg bisect
    --ops` prints), the tensors it saw, and what followed."""
    import replayer

    rec = replayer.open(path)
    found = replayer.first_nonfinite(rec, ops=True)
    step = found.step
    if step is None:
        print(f"\n{found.cause}")
        return
    definition = step.definition
    where = step.module_path or "<root>"
    print(f"\nfirst non-finite step: #{step.index} {step.name} ({step.phase}), iteration {step.iteration}, "
          f"module {where}")
    print(f"  paper: {step.paper['label']} - {step.paper['description']}")
    print(f"  code:  {definition['file']}:{definition['line']}")
    for r in step.records:
        s = r.stats
        print(f"  {r.role:<11} {r.name:<18} {str(list(r.shape)):<15} min {s['min']:>10.4g}  max {s['max']:>10.4g}"
              f"  nan {int(s['nan']):>5}  inf {int(s['inf']):>5}")
    if found.op is not None:
        op = found.op
        print(f"  operation: {op.name} at {op.file}:{op.line}: {op.code}")
    for inner in rec.steps.filter(iteration=step.iteration):  # the steps it called
        if inner.parent == step.index:
            out = next(iter(inner.tensors("output")), None)
            if out is not None:
                s = out.stats
                print(f"  inside it: #{inner.index} {inner.name} output min {s['min']:.4g} max {s['max']:.4g} "
                      f"nan {int(s['nan'])} inf {int(s['inf'])}")
    names = ", ".join(f"#{s.index} {s.name}" for s in found.spread[:5])
    print(f"  then non-finite: {names or 'nothing else recorded (training stopped)'}")
    print(f"\nthe same from the command line: {pdbg_program()} bisect {path} --ops")


def try_fixes(path: Path) -> None:
    """Would a stable SmoothReLU, or clamping its input, have kept the values finite? Answered on
    the recorded origin step, without training again."""
    import replayer

    rec = replayer.open(path)
    origin = replayer.first_nonfinite(rec).step
    if origin is None:
        return
    print("\nfixes tried on the recorded step (non-finite values in its output: recorded -> replayed):")
    for label, kwargs in (("swap in a stable SmoothReLU", {"swap": {"smooth_relu": "__main__:stable_smooth_relu"}}),
                          ("clamp its input to [-50, 50]", {"edit": {"args.0": "x.clamp(-50, 50)"}})):
        res = replayer.replay(rec, origin, **kwargs)
        out = res.outputs[0]
        before, after = (int(s["nan"] + s["inf"]) for s in (out.recorded, out.replayed))
        print(f"  {label}: {before} -> {after}" + ("  (finite)" if after == 0 else ""))
    print(f"  the same from the command line: {pdbg_program()} replay {path} {origin.index} "
          "--edit 'args.0=x.clamp(-50, 50)'")


def share(path: Path) -> Path | None:
    """A failure bundle of the origin step, verified, with a repro script next to it."""
    import replayer

    rec = replayer.open(path)
    origin = replayer.first_nonfinite(rec).step
    if origin is None:
        return None
    out = path.with_suffix(".pdbg")
    info = replayer.bundle(rec, origin, out, verify=True, repro=True, overwrite=True)
    verdict = "bitwise match" if info.verified else "MISMATCH"
    print(f"\nbundle: {info.path} ({info.bytes // 1024} KB, verified: {verdict}); replay it anywhere with: "
          f"{pdbg_program()} replay {info.path}  (or python {info.script})")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/nan_smooth_relu.zarr"))
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--no-tui", action="store_true", help="print the command that opens the TUI instead")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    crashed_at = train(args.out, args.iterations, args.lr)
    print(f"recording: {args.out}")
    from tui.cli import main as pdbg

    print(f"\n$ pdbg bisect {args.out} --ops")
    sys.stdout.flush()
    pdbg(["bisect", str(args.out), "--ops"])
    origin(args.out)
    try_fixes(args.out)
    share(args.out)
    import replayer

    step = replayer.first_nonfinite(replayer.open(args.out)).step
    at = f" --at {step.index}" if step is not None else ""
    if sys.stdout.isatty() and sys.stdin.isatty() and not args.no_tui:
        from tui.app import run_app

        run_app(str(args.out), str(step.index) if step is not None else None)
        print(f"open it in the TUI again: {pdbg_program()} {args.out}{at}")
    else:
        print(f"\nopen it in the TUI: {pdbg_program()} {args.out}{at}")
    return 0 if crashed_at is not None else 1


if __name__ == "__main__":
    sys.exit(main())
