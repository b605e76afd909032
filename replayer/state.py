"""The numerics a step ran under, put back for a replay and taken away afterwards; and what about
this machine differs from the one that recorded.

``applied(step_settings, rng)`` is a context manager: it applies the recorded generator states,
determinism and precision flags, default dtype and thread count, and restores the caller's own in
``finally``. Only settings that differ from the caller's are touched. What cannot be changed inside
a running process (CPU capability, inter-op threads, environment variables read at start-up) is
reported instead.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import platform
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from recorder import skeleton, snapshot
from recorder.errors import NotOnThisMachine, ReplayError
from recorder.payload import dtype_from_name

# setting -> (setter from the recorded value, getter of the current value as the recorder stores it)
Setter = Callable[[Any], None]


def _setters() -> dict[str, Setter]:
    b = torch.backends

    def det(value: bool) -> None:
        torch.use_deterministic_algorithms(value, warn_only=torch.is_deterministic_algorithms_warn_only_enabled())

    def warn_only(value: bool) -> None:
        torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled(), warn_only=value)

    def attr(obj: Any, name: str) -> Setter:
        return lambda value: setattr(obj, name, value)

    return {
        "deterministic_algorithms": det,
        "deterministic_warn_only": warn_only,
        "cudnn_enabled": attr(b.cudnn, "enabled"),
        "cudnn_deterministic": attr(b.cudnn, "deterministic"),
        "cudnn_benchmark": attr(b.cudnn, "benchmark"),
        "mkldnn_enabled": attr(b.mkldnn, "enabled"),
        "cudnn_allow_tf32": attr(b.cudnn, "allow_tf32"),
        "cuda_matmul_allow_tf32": attr(b.cuda.matmul, "allow_tf32"),
        "cuda_matmul_fp16_reduced_precision": attr(b.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
        "cuda_matmul_bf16_reduced_precision": attr(b.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
        "float32_matmul_precision": torch.set_float32_matmul_precision,
        "default_dtype": lambda value: torch.set_default_dtype(dtype_from_name(value)),
        "num_threads": torch.set_num_threads,
        "sdp_flash": b.cuda.enable_flash_sdp,
        "sdp_mem_efficient": b.cuda.enable_mem_efficient_sdp,
        "sdp_math": b.cuda.enable_math_sdp,
        "sdp_cudnn": getattr(b.cuda, "enable_cudnn_sdp", lambda value: None),
        "flush_denormal": _flush_denormal,
        "distributions_validate_args": torch.distributions.Distribution.set_default_validate_args,
    }


def _flush_denormal(value: bool) -> None:
    """Flush denormals to zero on this thread, or stop (``torch.set_flush_denormal``)."""
    if not isinstance(value, bool):
        raise ValueError("not a bool")
    if not torch.set_flush_denormal(bool(value)) and value:
        raise RuntimeError("this CPU cannot flush denormals to zero")


# Settings set per call rather than globally (grad mode, autocast) and ones a process cannot change.
_PER_CALL = ("grad_enabled", "inference_mode", "autocast_cpu", "autocast_cpu_dtype", "autocast_cuda",
             "autocast_cuda_dtype")
_FIXED = ("num_interop_threads", "cpu_capability")
_PRECISION_API = ("fp32_precision", "cuda_matmul_fp32_precision", "cudnn_fp32_precision", "mkldnn_fp32_precision")


def _restore_precision(before: dict[str, Any]) -> None:
    """Put torch's newer precision settings back as ``before`` had them: setting the legacy flags
    (``allow_tf32``, ``set_float32_matmul_precision``), even back to their old values, moves them
    ('none' becomes 'ieee')."""
    b = torch.backends
    owners = {"fp32_precision": b, "cuda_matmul_fp32_precision": getattr(b.cuda, "matmul", None),
              "cudnn_fp32_precision": b.cudnn, "mkldnn_fp32_precision": b.mkldnn}
    after = snapshot.settings()
    for name in _PRECISION_API:  # the generic one first: the others may follow it
        if before.get(name) is not None and after.get(name) != before[name]:
            with contextlib.suppress(Exception):  # restore as much as possible
                owners[name].fp32_precision = before[name]


MAX_THREADS = 4096  # more than any machine's cores: a recorded count beyond is damage


@contextlib.contextmanager
def applied(settings: dict[str, Any], rng: dict[str, Any], *, threads: int | None = None,
            notes: list[str] | None = None, seed: int | None = None) -> Iterator[None]:
    """Run a block under recorded settings and RNG states; the caller's come back afterwards.

    Args:
        settings: the step's settings snapshot (``Step.settings``).
        rng: decoded generator states (``Step.rng``).
        threads: force this intra-op thread count instead of the recorded one.
        notes: receives one line per setting that could not be applied.
        seed: seed torch (every device), numpy and random with it instead of applying ``rng``.
    """
    notes = notes if notes is not None else []
    wanted = dict(settings)
    if threads is not None:
        wanted["num_threads"] = threads
    now = snapshot.settings()
    setters = _setters()
    try:
        for name, setter in setters.items():
            value = wanted.get(name)
            if value is None or now.get(name) == value or now.get(name) is None:
                continue
            if name == "num_threads" and not (isinstance(value, int) and 1 <= value <= MAX_THREADS):
                notes.append(f"setting num_threads={str(value)[:40]} is no thread count this replay can use; "
                             "not applied")  # (a billion threads is a billion stacks: the process dies)
                continue
            try:
                setter(value)
            except Exception as exc:  # noqa: BLE001 - a backend this build lacks: say so
                notes.append(f"setting {name}={value!r} could not be applied ({type(exc).__name__}: {exc})")
        for name in _PRECISION_API:  # the new precision API only where the legacy flags did not already agree
            value, current = wanted.get(name), snapshot.settings().get(name)
            if value is not None and current is not None and value != current:
                notes.append(f"setting {name} was {value!r} when recorded and is {current!r} now")
        for name in _FIXED:
            value = wanted.get(name)
            if value is not None and now.get(name) is not None and now.get(name) != value:
                notes.append(f"{name} was {value!r} when recorded and is {now.get(name)!r} here; it cannot be "
                             "changed in a running process" + (" (set ATEN_CPU_CAPABILITY before starting)"
                                                               if name == "cpu_capability" else ""))
        start_threads()
        with snapshot.applied_rng(rng if seed is None else {}, cuda=seed is not None), isolated():
            if seed is not None:
                torch.manual_seed(seed)  # seeds every CUDA device too; restored with the rest
                np.random.seed(seed % 2**32)
                random.seed(seed)
            yield
    finally:
        # The caller's settings come back: those applied here, and those the replayed code changed
        # itself (a step that sets the default dtype or its thread count and leaves it so).
        after = snapshot.settings()
        for name, setter in reversed(setters.items()):
            if now.get(name) is not None and after.get(name) != now[name]:
                with contextlib.suppress(Exception):  # restore as much as possible
                    setter(now[name])
        _restore_precision(now)


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Run a block without what the calling process set around every call and every backward: its
    hooks on every module's calls (``register_module_forward_hook`` and the like; the recorder's
    own stay) and autograd's anomaly mode (its NaN checks raise inside the replay's backward). They
    come back afterwards, as they were."""
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    try:
        for _, attr in skeleton.GLOBAL_HOOKS:
            hooks = getattr(torch.nn.modules.module, attr, None)
            if hooks:
                saved.append((hooks, dict(hooks)))
                for key in [k for k, h in hooks.items() if not skeleton.is_recorders(h)]:
                    del hooks[key]
        if anomaly[0]:
            torch.autograd.set_detect_anomaly(False)
        yield
    finally:
        for hooks, before in saved:
            added = {k: h for k, h in hooks.items() if k not in before}
            hooks.clear()
            hooks.update(before)
            hooks.update(added)
        if anomaly[0]:
            torch.autograd.set_detect_anomaly(True, check_nan=anomaly[1])


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Run a block that may change torch's global settings and generators (a training script's top
    level, loaded for its definitions: ``torch.set_num_threads(1)``, ``torch.manual_seed(0)``); the
    caller's come back afterwards."""
    before = snapshot.settings()
    try:
        with snapshot.applied_rng({}, cuda=True), torch.set_grad_enabled(torch.is_grad_enabled()):
            yield
    finally:
        after = snapshot.settings()
        for name, setter in _setters().items():
            if before.get(name) is not None and after.get(name) != before[name]:
                with contextlib.suppress(Exception):  # restore as much as possible
                    setter(before[name])
        _restore_precision(before)


# Above ATen's grain size (32,768 elements): an op on it runs on every intra-op thread.
_WARM = torch.ones(1 << 17, device="cpu")


def start_threads() -> None:
    """Run one small parallel op before a replayed step, so that the step is not the first parallel
    region of this process (or of its thread count). The first one was seen to give different bits:
    in fresh processes at 2 threads, ~1 replay in 10 of a recorded ``nn.Linear`` (256x512 by
    512x512, MKL) mismatched, always the first replay of the process and never one after it, and
    never once any parallel op had run (60 of 60); the recording process had long been warm."""
    if torch.get_num_threads() > 1:
        torch.tanh(_WARM)


@contextlib.contextmanager
def per_call(settings: dict[str, Any], *, grad: bool | None = None) -> Iterator[None]:
    """Grad mode, inference mode and autocast as they were around the recorded call (``grad``
    overrides grad mode, and leaves inference mode off), inside ``neutral`` (which turned the
    caller's inference mode and autocast off)."""
    enabled = settings.get("grad_enabled", True) if grad is None else grad
    with contextlib.ExitStack() as stack:
        if settings.get("inference_mode") and grad is None:  # (first: entering it sets grad mode too)
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(bool(enabled)))
        for device in ("cpu", "cuda"):
            if settings.get(f"autocast_{device}") and (device == "cpu" or torch.cuda.is_available()):
                # (CUDA's autocast changes only CUDA operations: without a GPU torch turns it off, warning)
                dtype = settings.get(f"autocast_{device}_dtype")
                stack.enter_context(torch.autocast(device, dtype=_recorded(dtype_from_name, f"autocast_{device}_dtype",
                                                                           dtype) if dtype else None))
        yield


@contextlib.contextmanager
def neutral(settings: dict[str, Any]) -> Iterator[None]:
    """Around a whole replay (rebuilding its module and loading its tensors included): the caller's
    inference mode, no_grad and autocast off, and the recorded call's default dtype and default device
    (``settings``: the step's), so that one called inside ``torch.inference_mode()``,
    ``torch.no_grad()``, ``torch.autocast(...)``, ``torch.device("cuda")`` or after ``torch.set_default_dtype(...)``
    runs the step as the recording did (``per_call`` then applies the recorded call's modes)."""
    with contextlib.ExitStack() as stack:
        if torch.is_inference_mode_enabled():  # (entering inference_mode(False) turns grad mode on too)
            stack.enter_context(torch.inference_mode(False))
        if not torch.is_grad_enabled():  # a caller's no_grad: the inputs' copies must still take gradients
            stack.enter_context(torch.enable_grad())
        for device in ("cpu", "cuda"):
            if _autocast_on(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        dtype = settings.get("default_dtype")
        if dtype is not None and torch.get_default_dtype() != _recorded(dtype_from_name, "default_dtype", dtype):
            stack.callback(torch.set_default_dtype, torch.get_default_dtype())
            torch.set_default_dtype(dtype_from_name(dtype))
        device = settings.get("default_device")  # (absent from recordings made before it was recorded)
        if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
            raise NotOnThisMachine(f"the step ran with {device} as the default device (torch.set_default_device, "
                                   "or a `with torch.device(...)` block), and this machine has no GPU; replay it on a "
                                   "machine with one")
        if device is not None and str(torch.get_default_device()) != device:
            # innermost: above a caller's own torch.device(...)
            stack.enter_context(_recorded(torch.device, "default_device", device))
        yield


def _recorded(make: Callable[[Any], Any], name: str, value: Any) -> Any:
    """``make(value)`` for a recorded setting, or a one-line ReplayError when the recording holds
    something no torch setting is (it is damaged, or was not made by PaperDebugger)."""
    try:
        return make(value)
    except (TypeError, ValueError, RuntimeError):
        raise ReplayError(f"the recorded setting {name} is {str(value)[:80]!r}, which is no torch {name}; the "
                          "recording is damaged") from None


def _autocast_on(device: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device))
    except TypeError:  # torch before 2.4's device argument
        return bool(torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled())


_ARCHITECTURES = {"AMD64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "ARM64": "aarch64"}


def _system(platform_text: Any) -> str | None:
    """The operating system a ``platform.platform()`` text names (``Linux-6.1...``, ``Windows-10-...``,
    ``macOS-14.2-arm64-...``): its first word; None if it says none."""
    if not isinstance(platform_text, str) or not platform_text:
        return None
    return platform_text.split("-", 1)[0]


def _torch_build(run_info: dict[str, Any]) -> Any:
    """torch's version with its build: a pip wheel's says it (2.3.0+cu121, 2.3.0+cpu); another
    build's (conda's 2.3.0) gets the CUDA it was built for added, where the information names it."""
    version, cuda = run_info.get("torch"), run_info.get("torch_cuda")
    if isinstance(version, str) and "+" not in version and isinstance(cuda, str):
        return f"{version} (CUDA {cuda})"
    return version


def machine_facts(run_info: dict[str, Any]) -> list[tuple[str, Any]]:
    """The software and hardware a run's information names that can change numerics, as comparable
    values (Windows' AMD64 is x86_64; the operating system from ``platform``): versions, the
    machine, the operating system and the CPU capability; None where it names none (a recording
    names no PaperDebugger version: a bundle's verification does)."""
    machine = run_info.get("machine")
    return [("PaperDebugger version", run_info.get("paperdebugger")), ("torch version", _torch_build(run_info)),
            ("numpy version", run_info.get("numpy")), ("python version", run_info.get("python")),
            ("machine", _ARCHITECTURES.get(machine, machine) if isinstance(machine, str) else machine),
            ("operating system", _system(run_info.get("platform"))),
            ("CPU capability", run_info.get("cpu_capability"))]


@functools.cache
def paperdebugger_version() -> str | None:
    """The installed paperdebugger's version; None where it runs from a checkout that is not installed."""
    try:
        return importlib.metadata.version("paperdebugger")
    except importlib.metadata.PackageNotFoundError:
        return None


def this_machine() -> dict[str, Any]:
    """What ``machine_facts`` reads, as this process has it (the keys of a run's information)."""
    return {"paperdebugger": paperdebugger_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "numpy": np.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "platform": platform.platform(), "cpu_capability": snapshot.settings().get("cpu_capability")}


def gpus() -> list[dict[str, Any]]:
    """This machine's GPUs as a run's information lists them (``cuda``): name and SM count; [] without one."""
    if not torch.cuda.is_available():
        return []
    return [{"name": torch.cuda.get_device_name(i),
             "sm_count": torch.cuda.get_device_properties(i).multi_processor_count}
            for i in range(torch.cuda.device_count())]


def environment_differences(run_info: dict[str, Any], settings: dict[str, Any] | None = None, *,
                            verified: bool = False) -> list[str]:
    """Every difference between the recording machine and this one that can change numerics.
    ``verified``: ``run_info`` is what verified a bundle when it was made (its ``verified``
    ``environment``), and each difference says "verified with" instead of "recorded"."""
    out = []
    then_word = "verified with" if verified else "recorded"
    for (what, then), (_, now) in zip(machine_facts(run_info), machine_facts(this_machine()), strict=True):
        if then is not None and then != now:
            out.append(f"{what}: {then_word} {then}, here {now if now is not None else 'unknown'}")
    cuda_then = [g for g in run_info.get("cuda") or [] if isinstance(g, dict)] if isinstance(
        run_info.get("cuda"), list) else []
    cuda_now = gpus()
    if cuda_then and not cuda_now:
        out.append(f"GPU: {'verified' if verified else 'recorded'} on {cuda_then[0].get('name')}, this machine has "
                   "none")
    for i, (then, now) in enumerate(zip(cuda_then, cuda_now)):
        if then.get("name") != now["name"] or then.get("sm_count") != now["sm_count"]:
            out.append(f"GPU {i}: {then_word} {then.get('name')} ({then.get('sm_count')} SMs), here {now['name']} "
                       f"({now['sm_count']} SMs)")
    now_settings = snapshot.settings()
    if settings:
        recorded_env = settings.get("env") if isinstance(settings.get("env"), dict) else {}
        for name in ("num_threads", "num_interop_threads"):
            then, now = settings.get(name), now_settings.get(name)
            if then is not None and now is not None and then != now:
                out.append(f"{name}: recorded {then}, here {now} (replay sets intra-op threads as recorded)"
                           if name == "num_threads" else f"{name}: recorded {then}, here {now}")
        for key in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG",
                    "NVIDIA_TF32_OVERRIDE"):
            then, now = recorded_env.get(key), os.environ.get(key)
            if then != now:
                out.append(f"environment variable {key}: recorded {then!r}, here {now!r}")
    return out
