"""A broken paper expectation, caught as an alert: a small ViT that fuses a shallow feature map with
its deep Transformer features. The paper's Algorithm 1, step 5 (Eq. 7) re-weights the shallow
feature C1 channel by channel,

    A = sigmoid(W2 relu(W1 GAP(C1)))  in (0, 1)^{C x 1 x 1},      C1' = A * C1,

but the code below squashes with ``tanh`` instead of ``sigmoid``: the weights land in (-1, 1), and a
negative weight flips a channel's sign instead of damping it. Training runs on; no NaN, no
exception. The ``recorder.watch`` expectations written from Eq. 7 notice: the
range check on the attention weights breaks at every call, while the shape and norm checks hold.

Run it:   python examples/multiscale_fusion.py [--out runs/multiscale_fusion.zarr] [--iterations 4]

It trains a few iterations under ``recorder.record``, then reads the recording back with
``replayer.open``, lists the steps whose status is ``alert`` and prints each broken expectation,
expected against actual, and the command that shows the same in the TUI.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import recorder

IMAGE, PATCH, CHANNELS, D, HEADS, DEPTH, CLASSES, BATCH = 32, 4, 3, 32, 2, 3, 10, 8
GRID = IMAGE // PATCH

#: What Eq. 7 promises about the attention weights and the re-weighted feature.
WEIGHT_RANGE = (0.0, 1.0)
C1_NORM_RANGE = (1e-3, 1e4)

#: The recorder's name for each check (an alert's "check") and the watch() argument that declares it.
CHECKS = {"shape": "expected_shape", "range": "expected_range", "norm": "expected_norm_range",
          "mean": "expected_mean"}


@recorder.paper_step("Algorithm 1", step=5, equation="Eq. 7",
                     description="Apply channel attention to shallow feature C1")
class ChannelAttention(nn.Module):
    """Squeeze-and-excitation on a (B, C, H, W) feature map: one weight per channel."""

    def __init__(self, channels: int, reduction: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // reduction, 1)
        self.fc2 = nn.Conv2d(channels // reduction, channels, 1)

    def forward(self, c1: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool2d(c1, 1)
        weights = torch.tanh(self.fc2(F.relu(self.fc1(pooled))))  # BUG: Eq. 7 says sigmoid
        recorder.watch(weights, "channel_weights", expected_shape=(None, c1.shape[1], 1, 1),
                       expected_range=WEIGHT_RANGE, reference="Eq. 7")
        attended = weights * c1
        recorder.watch(attended, "attended_c1", expected_shape=tuple(c1.shape),
                       expected_norm_range=C1_NORM_RANGE, reference="Eq. 7")
        return attended


@recorder.paper_step("Algorithm 1", step=3, description="pre-norm Transformer block over the patch tokens")
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MultiscaleViT(nn.Module):
    """Patch embedding -> C1 (shallow, spatial); Transformer blocks -> deep tokens; fuse both, classify."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(CHANNELS, D, PATCH, stride=PATCH)
        self.pos = nn.Parameter(torch.zeros(1, GRID * GRID, D))
        self.blocks = nn.Sequential(*(Block(D, HEADS) for _ in range(DEPTH)))
        self.c1_attention = ChannelAttention(D)
        self.fuse = nn.Conv2d(2 * D, D, 1)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c1 = self.patch(images)  # (B, D, GRID, GRID)
        tokens = self.blocks(c1.flatten(2).transpose(1, 2) + self.pos)
        deep = tokens.transpose(1, 2).reshape_as(c1)
        fused = self.fuse(torch.cat([self.c1_attention(c1), deep], dim=1))
        return self.head(fused.mean(dim=(2, 3)))


def batch(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Small random images and labels, the same for a given iteration."""
    g = torch.Generator().manual_seed(iteration)
    return torch.randn(BATCH, CHANNELS, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def train(out: Path, iterations: int) -> None:
    """Train under the recorder, printing the loss of every iteration."""
    torch.manual_seed(0)
    model = MultiscaleViT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with recorder.record(out, model=model, optimizer=opt):
        for it in range(iterations):
            images, labels = batch(it)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"iteration {it}: loss {loss.item():.4f}")


def describe(alert: dict[str, Any]) -> str:
    """One broken expectation, expected against actual, in words."""
    check, expected, actual = alert["check"], alert["expected"], alert["actual"]
    if check == "range":
        text = f"values in [{expected[0]:g}, {expected[1]:g}], got [{actual[0]:.4g}, {actual[1]:.4g}]"
        if alert.get("nonfinite"):
            text += f" and {alert['nonfinite']} NaN/Inf"
    elif check == "norm":
        text = f"L2 norm in [{expected[0]:g}, {expected[1]:g}], got {actual:.4g}"
    elif check == "mean":
        text = f"mean {expected[0]:g} +- {expected[1]:g}, got {actual:.4g}"
    else:  # shape
        text = f"shape {expected}, got {actual}"
    reference = f" ({alert['reference']})" if alert.get("reference") else ""
    return f"watch {alert['watch']!r} {check}{reference}: expected {text}"


def checks(extra: dict[str, Any]) -> str:
    """Every expectation a step's watches declared, and whether it held."""
    broken = {(a["watch"], a["check"]) for a in extra.get("alerts", [])}
    parts = []
    for watch in extra.get("watches", []):
        declared = [check for check, key in CHECKS.items() if watch.get(key) is not None]
        held = ", ".join(f"{c} {'BROKEN' if (watch['name'], c) in broken else 'held'}" for c in declared)
        parts.append(f"{watch['name']}: {held}")
    return "; ".join(parts)


def report(path: Path) -> int:
    """Print the alert steps of a recording and what each broke; returns how many there were."""
    import replayer

    rec = replayer.open(path)
    alerts = rec.steps.filter(status="alert")
    print(f"\n{len(alerts)} of {len(rec)} steps raised alerts:")
    for step in alerts:
        paper = step.paper
        print(f"  #{step.index} {paper['label']} step {paper['step']} ({step.name}, {step.phase}), "
              f"iteration {step.iteration}, module {step.module_path or '<root>'}")
        for alert in step.extra.get("alerts", []):
            print(f"    {describe(alert)}")
    if len(alerts):
        print(f"  expectations at #{alerts[0].index}: {checks(alerts[0].extra)}")
    print(f"\nin the TUI: pdbg {path}   then press `a` for the alerts pane")
    return len(alerts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/multiscale_fusion.zarr"))
    parser.add_argument("--iterations", type=int, default=4)
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    train(args.out, args.iterations)
    print(f"recording: {args.out}")
    return 0 if report(args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
