"""RNG and numerics-settings snapshots: capture (cheap, at every step entry) and scoped restore.

Capturing reads state only: it consumes no random numbers, changes no setting and never initialises
CUDA as a side effect. Restoring happens inside context managers that put the caller's own state
back in ``finally``.
"""

from __future__ import annotations

import base64
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import xxhash

# Environment variables that change numerics or how kernels are chosen.
ENV_VARS = ("CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "NVIDIA_TF32_OVERRIDE", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")


# -- RNG ------------------------------------------------------------------------------------------
def rng_parts() -> dict[str, tuple[Any, Any]]:
    """Every generator's state as {part: (cheap key, raw state)}; keys let a writer skip re-encoding
    states it has already stored. Parts: torch (CPU), cuda:N (initialised devices only), numpy, python."""
    parts: dict[str, tuple[Any, Any]] = {}
    cpu = torch.get_rng_state()
    parts["torch"] = (xxhash.xxh3_64_intdigest(cpu.numpy().data), cpu)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            parts[f"cuda:{i}"] = (xxhash.xxh3_64_intdigest(state.numpy().data), state)
    np_state = np.random.get_state()
    parts["numpy"] = ((xxhash.xxh3_64_intdigest(np_state[1].data), *np_state[2:]), np_state)
    py_state = random.getstate()
    parts["python"] = (hash(py_state), py_state)
    return parts


def encode_rng_part(name: str, state: Any) -> dict[str, Any]:
    """JSON form of one generator's state."""
    if name == "numpy":
        kind, key, pos, has_gauss, gauss = state
        return {"kind": kind, "key": _b64(np.ascontiguousarray(key, dtype="<u4").tobytes()), "pos": int(pos),
                "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    if name == "python":
        version, internal, gauss_next = state
        return {"version": version, "state": _b64(np.asarray(internal, dtype="<u4").tobytes()),
                "gauss_next": gauss_next}
    return {"bytes": _b64(state.numpy().tobytes())}  # torch and cuda:N: uint8 state tensors


def decode_rng_part(name: str, doc: dict[str, Any]) -> Any:
    if name == "numpy":
        key = np.frombuffer(base64.b64decode(doc["key"]), dtype="<u4").astype(np.uint32)
        return (doc["kind"], key, doc["pos"], doc["has_gauss"], doc["cached_gaussian"])
    if name == "python":
        internal = tuple(int(v) for v in np.frombuffer(base64.b64decode(doc["state"]), dtype="<u4"))
        return (doc["version"], internal, doc["gauss_next"])
    return torch.frombuffer(bytearray(base64.b64decode(doc["bytes"])), dtype=torch.uint8)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@contextmanager
def applied_rng(parts: dict[str, Any]) -> Iterator[None]:
    """Run a block with the given generator states ({part: decoded state}), then restore the
    caller's. CUDA parts are applied only to devices that exist; the caller's CUDA state is saved
    only where CUDA was already initialised (or is initialised by the block itself)."""
    saved_cpu, saved_np, saved_py = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda_parts = {int(k.split(":")[1]): v for k, v in parts.items() if k.startswith("cuda:")}
    saved_cuda = None
    if cuda_parts and torch.cuda.is_available():
        saved_cuda = torch.cuda.get_rng_state_all()
    try:
        if "torch" in parts:
            torch.set_rng_state(parts["torch"])
        if "numpy" in parts:
            np.random.set_state(parts["numpy"])
        if "python" in parts:
            random.setstate(parts["python"])
        for device, state in cuda_parts.items():
            if saved_cuda is not None and device < len(saved_cuda):
                torch.cuda.set_rng_state(state, device)
        yield
    finally:
        torch.set_rng_state(saved_cpu)
        np.random.set_state(saved_np)
        random.setstate(saved_py)
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)


# -- settings -------------------------------------------------------------------------------------
def _safe(get: Any) -> Any:
    try:
        value = get()
    except Exception:  # a backend this build lacks
        return None
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def settings() -> dict[str, Any]:
    """Everything that changes numerics, as plain JSON values (None where this build lacks it)."""
    b = torch.backends
    s: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_enabled": _safe(lambda: b.cudnn.enabled),
        "cudnn_deterministic": _safe(lambda: b.cudnn.deterministic),
        "cudnn_benchmark": _safe(lambda: b.cudnn.benchmark),
        "cudnn_allow_tf32": _safe(lambda: b.cudnn.allow_tf32),
        "cuda_matmul_allow_tf32": _safe(lambda: b.cuda.matmul.allow_tf32),
        "cuda_matmul_fp16_reduced_precision": _safe(lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cuda_matmul_bf16_reduced_precision": _safe(lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp32_precision": _safe(lambda: b.fp32_precision),
        "cuda_matmul_fp32_precision": _safe(lambda: b.cuda.matmul.fp32_precision),
        "cudnn_fp32_precision": _safe(lambda: b.cudnn.fp32_precision),
        "mkldnn_fp32_precision": _safe(lambda: b.mkldnn.fp32_precision),
        "sdp_flash": _safe(b.cuda.flash_sdp_enabled),
        "sdp_mem_efficient": _safe(b.cuda.mem_efficient_sdp_enabled),
        "sdp_math": _safe(b.cuda.math_sdp_enabled),
        "sdp_cudnn": _safe(b.cuda.cudnn_sdp_enabled),
        "default_dtype": _safe(torch.get_default_dtype),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": _safe(b.cpu.get_cpu_capability),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
    }
    for device in ("cpu", "cuda"):
        s[f"autocast_{device}"] = _safe(lambda d=device: torch.is_autocast_enabled(d))
        s[f"autocast_{device}_dtype"] = _safe(lambda d=device: torch.get_autocast_dtype(d))
    s["env"] = {k: os.environ.get(k) for k in ENV_VARS}
    return s
