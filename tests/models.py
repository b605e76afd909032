"""Small models used across the tests: a transformer with two decorated classes and one decorated
function, trained with dropout; a student and its EMA teacher of one class."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import recorder


@recorder.paper_step("Eq. 2", description="SmoothReLU(x) = log(1 + exp(x + beta)) / gamma")
def smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    return torch.log1p(torch.exp(x + beta)) / gamma


@recorder.paper_step("Eq. 1", description="scaled tanh")
def scaled_tanh(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    return torch.tanh(x) * scale


@recorder.paper_step("Algorithm 1", description="embed, project, squash")
class Tiny(nn.Module):
    """The smallest model with a module step and a function step (embedding: integer inputs)."""
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return scaled_tanh(self.fc(self.embed(idx)))


@recorder.paper_step("Eq. 1", algorithm="Algorithm 1", step=3, description="causal self-attention")
class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        recorder.watch(att, "attention_weights", expected_shape=(None, self.heads, t, t),
                       expected_range=(0.0, 1.0), reference="Eq. 1")
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(smooth_relu(self.fc(x), beta=0.5))


@recorder.paper_step("Algorithm 1", algorithm="Algorithm 1", step=5, equation="Eq. 7",
                     description="transformer block")
class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, dropout)
        self.mlp = MLP(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.h:
            x = block(x)
        return self.head(self.ln(x))


def batch(step: int, vocab: int = 32, seq: int = 8, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch that does not touch the global RNG."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, vocab, (size, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> torch.Tensor:
    """One training iteration on batch ``i``: forward, cross-entropy, backward, optimizer step."""
    x, y = batch(i)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach().clone()


def record_training(path: Any, iterations: int, before: Callable[[int, nn.Module], None] | None = None) -> None:
    """Record ``iterations`` training steps of a fresh TinyGPT (seed 0, AdamW) into ``path``;
    ``before(i, model)`` runs at the start of each iteration, outside any step."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with recorder.record(path, model=model, optimizer=opt, mode="full") as run:
        for i in range(iterations):
            if before is not None:
                before(i, model)
            train_step(model, opt, i)
    assert run.status == "complete" and run.failure is None


def poison_at(iteration: int) -> Callable[[int, nn.Module], None]:
    """A ``before`` for record_training that writes a NaN into ``h.1.ln1.weight`` at the start of
    ``iteration``, outside every recorded step (as a bad optimizer update would)."""
    def before(i: int, model: nn.Module) -> None:
        if i == iteration:
            with torch.no_grad():
                model.h[1].ln1.weight[0] = float("nan")

    return before


@recorder.paper_step("Eq. 3", description="projection head, run by the student and its EMA teacher")
class ProjectionHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(self.fc(x), -1, keepdim=True) * self.fc(x).exp()


def record_ema(path: Path, blow_up: int, iterations: int = 5) -> Path:
    """Record a student ProjectionHead trained towards its EMA teacher (a deepcopy, called first each
    iteration, under no_grad); the teacher's weights blow up (x 1e30) after iteration ``blow_up``'s update,
    so that its next call's exp overflows: one step name and module path, two module objects."""
    torch.manual_seed(0)
    student = ProjectionHead()
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with recorder.record(path, model=student, optimizer=opt, mode="full"):
        for it in range(iterations):
            x = torch.randn(4, 8)
            with torch.no_grad():
                target = teacher(x)
            loss = (student(x) - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), student.parameters()):
                    t.mul_(0.9).add_(s, alpha=0.1)
                    if it == blow_up:
                        t.mul_(1e30)
    return path


@recorder.paper_step("Eq. 4", description="RMSprop without eps, old style: the update written through .data")
def rmsprop_data_update(p: torch.Tensor, sq: torch.Tensor, lr: float, alpha: float, eps: float) -> None:
    g = p.grad.data
    sq.mul_(alpha).addcmul_(g, g, value=1 - alpha)
    p.data.addcdiv_(g, sq.sqrt().add(eps), value=-lr)


@recorder.paper_step("Eq. 5", description="a lookup that only reads its table")
def lookup(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return table[rows].sum(0)


@recorder.paper_step("Eq. 1", description="a linear map of one wide weight")
class WideLinear(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(rows, 512) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def record_data_write(path: Path, rows: int) -> Path:
    """Two iterations of a ``rows`` x 512 float32 weight (``rows`` 1024: 2 MiB, over the 1 MiB up to which the
    recorder sees a write through .data) updated by ``rmsprop_data_update`` with eps 0: row 0 of the weight never
    gets a gradient, so the update writes 0/0 = NaN into it, through .data. ``lookup`` reads the weight each
    iteration and changes nothing."""
    torch.manual_seed(0)
    model = WideLinear(rows)
    sq = torch.zeros_like(model.w)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (only to count iterations)
    with recorder.record(path, model=model, optimizer=opt, mode="full"):
        for _ in range(2):
            x = torch.randn(2, rows)
            x[:, 0] = 0  # row 0 of the weight gets no gradient
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                lookup(model.w, torch.tensor([1, 2]))
                rmsprop_data_update(model.w, sq, 0.01, 0.9, 0.0)
            opt.step()
    return path


@recorder.paper_step("Eq. 4", description="a head fine-tuned on a frozen embedding and backbone")
class FineTuned(nn.Module):
    """Fine-tuning: an embedding and a backbone frozen (requires_grad=False), a head trained."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.backbone = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(self.embed(idx))))


def record_fine_tuning(path: Path, iterations: int = 3, unfreeze_at: int = 2) -> Path:
    """Record FineTuned with its embedding and backbone frozen, the backbone unfrozen from iteration
    ``unfreeze_at`` on (a schedule that thaws layers one by one)."""
    torch.manual_seed(0)
    model = FineTuned()
    model.embed.requires_grad_(False)
    model.backbone.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(path, model=model, optimizer=opt, mode="full"):
        for it in range(iterations):
            if it == unfreeze_at:
                model.backbone.requires_grad_(True)
            loss = model(torch.randint(0, 16, (4, 3))).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return path


# A model of the user's own module file, recorded with record(modules=...) in a fresh process: each Block holds
# an MLP and a Gate of that file (and torch's LayerNorm and Linear); edit_mlp changes MLP's code afterwards.
SUBMODEL = '''
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x)))


class Gate(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d)
        self.gate = Gate()

    def forward(self, x):
        return x + self.gate(x) * self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
'''

SUBMODEL_TRAIN = '''
import sys
import torch
import recorder
from submodel import Net

torch.manual_seed(0)
model = Net(4, 2)
with recorder.record(sys.argv[1], model=model, modules="blocks.*", mode="full"):
    model(torch.randn(2, 4)).sum().backward()
'''


def record_submodel(where: Path, name: str = "run.zarr") -> Path:
    """Write ``submodel.py`` (SUBMODEL) and ``train.py`` into ``where``, unless there, and record two Blocks'
    calls (forward and backward) into ``where / name`` in a fresh process."""
    import subprocess
    import sys

    from tests.cli import env

    if not (where / "submodel.py").exists():
        (where / "submodel.py").write_text(SUBMODEL)
        (where / "train.py").write_text(SUBMODEL_TRAIN)
    res = subprocess.run([sys.executable, "train.py", name], cwd=where, capture_output=True, text=True, timeout=300,
                         check=False, env=env())
    assert res.returncode == 0, res.stderr
    return where / name


def edit_mlp(where: Path) -> Path:
    """Change MLP's forward in ``where / "submodel.py"`` (a bug fixed after recording), its modification time
    left as it was (a checkout that keeps times, a copy with rsync -t): only the code tells. Returns the file."""
    import os

    module = where / "submodel.py"
    times = module.stat()
    module.write_text(module.read_text().replace("torch.relu(self.fc(x))", "torch.relu(self.fc(x) + 0.01)"))
    os.utime(module, ns=(times.st_atime_ns, times.st_mtime_ns))
    return module
