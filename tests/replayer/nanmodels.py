"""Small models whose NaNs are born in known places (importable, so replay finds them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

import recorder


@recorder.paper_step("Eq. 2", description="SmoothReLU(x) = log(1 + exp(x + beta)) / gamma")
def smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    return torch.log1p(torch.exp(x + beta)) / gamma


@recorder.paper_step("Eq. 3", description="scaled block")
class Scaled(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return smooth_relu(self.fc(x) * scale)


@recorder.paper_step("Eq. 4", description="root of the energy")
def root_energy(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x * x)


class StepSizeGrad(torch.autograd.Function):
    """An LSQ-style quantizer: finite forward; its hand-written backward divides by the step size."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, s)
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, s = ctx.saved_tensors
        q = x / s  # a zero step size: Inf, then NaN in the grad of s
        return g, (g * (q.round() - q)).sum().reshape(s.shape)


@recorder.paper_step("Eq. 6", description="quantize with a learned step size")
def quantize_lsq(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return StepSizeGrad.apply(x, s)


def stable_smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    """The same function, computed without overflow (softplus switches to x for large x)."""
    return torch.nn.functional.softplus(x + beta) / gamma


class StableScaled(nn.Module):
    """Scaled with the stable function and a different parameter layout (``proj`` instead of ``fc``,
    plus a ``gain`` the original lacks)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return stable_smooth_relu(self.proj(x) * scale) * self.gain


class StableFc(nn.Module):
    """Same parameter names as Scaled (``fc``), stable function."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return stable_smooth_relu(self.fc(x) * scale)


@recorder.paper_step("Model", description="two scaled blocks")
class Stack(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.first, self.second = Scaled(d), Scaled(d)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.second(self.first(x, scale), 1.0)


def record_scales(path: object, model: nn.Module, scales: tuple[float, ...]) -> None:
    """Record ``model(x, scale)`` forward and backward once per scale, one iteration each; the
    inputs come from torch's global generator (seed it before building the model)."""
    with recorder.record(path, model=model) as run:
        for scale in scales:
            model(torch.randn(3, 4), scale).sum().backward()
            run.next_iteration()


class NaiveSoftmax(nn.Module):
    """softmax without subtracting the maximum: exp overflows once scores pass ~88."""

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        e = torch.exp(s)
        return e / e.sum(-1, keepdim=True)


class MaskedAttention(nn.Module):
    """Causal self-attention with an additive -inf mask, given as an argument (as GPT code does);
    ``boost`` scales the scores, so that they overflow the naive softmax where it is large."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)
        self.softmax = NaiveSoftmax()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, boost: float) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        return self.softmax(q @ k.transpose(-1, -2) * boost + mask) @ x


class MaskedModel(nn.Module):
    def __init__(self, d: int = 8, build_mask: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MaskedAttention(d) for _ in range(2)])
        self.build_mask = build_mask
        self.masker = CausalMask()

    def forward(self, x: torch.Tensor, boost: float) -> torch.Tensor:
        t = x.shape[1]
        if self.build_mask:  # made by a recorded step: its output holds -inf at every call
            mask = self.masker(x)
        else:
            mask = torch.full((t, t), float("-inf")).triu(1)
        for block in self.blocks:
            x = block(x, mask, boost)
        return x


class CausalMask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))


def record_masked(path: object, boosts: tuple[float, ...], build_mask: bool = False) -> None:
    """One iteration per boost; modules recorded by glob (the model written without PaperDebugger)."""
    torch.manual_seed(0)
    model = MaskedModel(build_mask=build_mask)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    globs = ["blocks.*", "**.softmax"] + (["masker"] if build_mask else [])
    with recorder.record(path, model=model, optimizer=opt, modules=globs):
        for i, boost in enumerate(boosts):
            x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(i))
            model(x, boost).square().mean().backward()
            opt.step()
            opt.zero_grad()


class PaddedAttention(nn.Module):
    """nn.MultiheadAttention given a bool key_padding_mask, which it turns into -inf itself
    (masked_fill_ in _canonical_mask) at every call; a sequence that is all padding makes its
    softmax NaN (every key -inf)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, key_padding_mask=pad)[0]


class PaddedModel(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attn = PaddedAttention(d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, pad)


def record_padded(path: object, empty_at: int = 2, iterations: int = 3) -> None:
    """One padded batch an iteration, with an empty sequence (all padding) at ``empty_at``."""
    torch.manual_seed(0)
    model = PaddedModel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with recorder.record(path, model=model, optimizer=opt, modules=["attn"]):
        for i in range(iterations):
            x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(i))
            lengths = torch.tensor([5, 3, 0 if i == empty_at else 2])
            pad = torch.arange(5)[None, :] >= lengths[:, None]
            model(x, pad).square().mean().backward()
            opt.step()
            opt.zero_grad()


@recorder.paper_step("Eq. 9", description="q(z|x) = N(mu(x), diag(sigma(x)^2))")
class Encoder(nn.Module):
    """A VAE encoder that returns a torch.distributions Independent(Normal), a Generic[D]."""

    def __init__(self, d: int = 16, z: int = 4) -> None:
        super().__init__()
        self.net = nn.Linear(d, 2 * z)

    def forward(self, x: torch.Tensor) -> torch.distributions.Independent:
        mu, logvar = self.net(x).chunk(2, -1)
        return torch.distributions.Independent(torch.distributions.Normal(mu, torch.exp(0.5 * logvar)), 1)


@recorder.paper_step("Eq. 10", description="reparameterised sample z = mu + sigma * eps")
def reparam(q: torch.distributions.Independent) -> torch.Tensor:
    return q.rsample()


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder()
        self.dec = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.enc(x)
        xhat = self.dec(reparam(q))
        return (xhat - x).square().sum(-1).mean() + q.base_dist.scale.square().mean()


def record_vae(path: object, lr: float = 1e-2, outlier_at: int | None = None, iterations: int = 3) -> None:
    """A VAE trained with Adam at ``lr``; at ``outlier_at`` one sample of the batch is 1000 times too large,
    and the encoder's exp(0.5 * logvar) overflows."""
    torch.manual_seed(0)
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with recorder.record(path, model=model, optimizer=opt):
        for i in range(iterations):
            x = torch.randn(8, 16)
            if i == outlier_at:
                x[3] *= 1e3
            model(x).backward()
            opt.step()
            opt.zero_grad()


@recorder.paper_step("Eq. 1", description="negative log-likelihood of z under a prior given as an argument")
def prior_nll(z: torch.Tensor, prior: torch.distributions.Distribution) -> torch.Tensor:
    return -prior.log_prob(z).mean()


@recorder.paper_step("Eq. 5", description="CTC loss of a batch of two utterances")
def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths)


def record_skipping_ctc(path: object, bad: tuple[int, ...], batches: int = 4, on_anomaly: str = "record") -> list[int]:
    """A CTC head trained on ``batches`` batches of 6 frames each, in a loop that skips a batch whose loss is not
    finite (ESPnet/fairseq style: no backward, no optimizer step, so the skipped batch and the next one share
    an iteration); at the batches in ``bad`` the first utterance's transcript has 9 labels, more than its frames:
    an infeasible alignment, a loss of +inf. Returns the batches skipped."""
    torch.manual_seed(0)
    head = nn.Linear(8, 5)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    skipped = []
    with recorder.record(path, model=head, optimizer=opt, on_anomaly=on_anomaly):
        for b in range(batches):
            log_probs = head(torch.randn(6, 2, 8)).log_softmax(-1)
            lengths = torch.tensor([9 if b in bad else 3, 2])
            loss = ctc_loss(log_probs, torch.randint(1, 5, (2, 9)), torch.tensor([6, 6]), lengths)
            if not torch.isfinite(loss):
                skipped.append(b)
                continue
            loss.backward()
            opt.step()
            opt.zero_grad()
    return skipped


@recorder.paper_step("Eq. 2", description="log-mel features: log(mel + eps)")
def log_mel(power: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.log(power + eps)


@recorder.paper_step("Eq. 3", description="masked CMVN over the frames")
def masked_cmvn(feats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (feats * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    return (feats - mean) * mask


def record_log_mel(path: object, iterations: int) -> None:
    """Log-mel features with eps 0: the zero-padded frames of the shorter clip have no energy, so log_mel holds
    -inf on part of its output at every call, and the masked CMVN makes NaN of it (-inf * 0)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with recorder.record(path, model=lin, optimizer=opt):
        for _ in range(iterations):
            power = torch.rand(2, 4, 6) + 0.1
            power[1, :, 4:] = 0
            mask = torch.ones(2, 1, 6)
            mask[1, :, 4:] = 0
            feats = masked_cmvn(log_mel(power, 0.0), mask)
            lin(feats.transpose(1, 2)).sum().backward()
            opt.step()
            opt.zero_grad()


class RunningBN(nn.Module):
    """A hand-written BatchNorm: it normalises by the biased variance and keeps the unbiased one in
    ``running_var``, which a batch of one value per channel in train mode makes NaN (n / (n - 1) = 1 / 0),
    in place, its output finite; the next call in eval mode returns NaN."""

    def __init__(self, c: int, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean, var = x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3), unbiased=False)
            with torch.no_grad():
                n = x.numel() / x.shape[1]
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        else:
            mean, var = self.running_mean, self.running_var
        xh = (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + self.eps)
        return xh * self.weight[None, :, None, None] + self.bias[None, :, None, None]


@recorder.paper_step("Eq. 7", description="batch normalisation, unbiased running variance")
class PaperBN(RunningBN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class ImagePool(nn.Module):
    """An ASPP image-pooling branch: global average, 1x1 convolution, ``bn``."""

    def __init__(self, c: int, bn: nn.Module) -> None:
        super().__init__()
        self.pool, self.conv, self.bn = nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c, 1), bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(self.pool(x)))


def record_bn(path: object, model: nn.Module, batches: tuple[int, ...], modules: list[str] | None = None,
              between: Callable[[int, nn.Module], None] | None = None) -> None:
    """One iteration per batch size: a train-mode step on a batch of that many 3-channel images, then
    ``between(i, model)``, then an evaluation under inference_mode."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(path, model=model, optimizer=opt, modules=modules):
        for i, size in enumerate(batches):
            model.train()
            model(torch.randn(size, 3, 4, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if between is not None:
                between(i, model)
            model.eval()
            with torch.inference_mode():
                model(torch.randn(4, 3, 4, 4))
