"""Failure bundles: small, self-contained, replayable in a fresh process elsewhere; repro.py; code
drift and the bundled source; hostile bundles refused without running anything."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import zarr
from torch import nn

import recorder
import replayer
from recorder.errors import FormatError, NotOnThisMachine, ReplayError
from recorder.store import layout
from tests.cli import ROOT

MODULE = '''
import torch
import torch.nn as nn

import recorder


@recorder.paper_step("Eq. 1", description="projection")
class Projection(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(torch.tanh(self.lin(x)))  # EDIT


@recorder.paper_step("Eq. 2", description="scaled softplus")
def soft(x, beta=1.0):
    return torch.nn.functional.softplus(x * beta)
'''

TRAIN = '''
import sys
import torch
import recorder
import bundlemod

d, iterations = int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = bundlemod.Projection(d)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with recorder.record(sys.argv[1], model=model, optimizer=opt):
    for i in range(iterations):
        y = bundlemod.soft(model(torch.randn(256, d)), beta=2.0)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
'''


def env_with(code: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(code), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run(args: list[str], cwd: Path, code: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env_with(code), capture_output=True, text=True, timeout=300,
                          check=False)


def pdbg(*args: str, cwd: Path, code: Path) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "tui.cli", *args], cwd, code)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A ~50 MB recording of a 512-wide projection trained 13 iterations; returns (run, code dir)."""
    where = tmp_path_factory.mktemp("bundle")
    code = where / "code"
    code.mkdir()
    (code / "bundlemod.py").write_text(MODULE)
    (where / "train.py").write_text(TRAIN)
    res = run([sys.executable, "train.py", str(where / "run.zarr"), "512", "13"], where, code)
    assert res.returncode == 0, res.stderr
    return where / "run.zarr", code


def payload_bytes(step: replayer.Step) -> int:
    seen, total = set(), 0
    for r in step.records:
        if r.has_payload and r.payload not in seen:
            seen.add(r.payload)
            total += step.rec.rank.payload_units(r.payload)[0].nbytes
    return total


def test_a_bundle_is_small_and_replays_bitwise_in_an_empty_directory(recorded: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    run_path, code = recorded
    rec = replayer.open(run_path)
    assert rec.reader.nbytes() > 45e6
    step = rec.step("Eq. 1@iter=7")
    info = replayer.bundle(rec, step, tmp_path / "failure.pdbg", verify=True, script=True)
    assert info.verified is True and info.steps == 1
    own = payload_bytes(step)
    assert info.bytes <= 1.2 * own + 256 * 1024, (info.bytes, own)
    assert {i.compress_type for i in zipfile.ZipFile(info.path).infolist()} == {zipfile.ZIP_STORED}
    plain = zarr.open_group(zarr.storage.ZipStore(info.path, mode="r"), mode="r")  # readable by plain zarr
    assert plain["rank0/steps/phase"].shape[0] == 1 and "paperdebugger" in plain.attrs

    empty = tmp_path / "elsewhere"
    empty.mkdir()
    shutil.copy(info.path, empty / "failure.pdbg")
    res = pdbg("replay", "failure.pdbg", "--json", cwd=empty, code=code)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["match"] is True and doc["step"]["name"] == "Projection" and doc["step"]["iteration"] == 7
    info_res = pdbg("info", "failure.pdbg", cwd=empty, code=code)
    assert info_res.returncode == 0 and "verified when made: bitwise match" in info_res.stdout
    assert "environment: same as where it was recorded" in info_res.stdout
    assert "code of Projection (bundlemod:Projection): unchanged" in info_res.stdout


def test_backward_and_iteration_bundles(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    run_path, code = recorded
    rec = replayer.open(run_path)
    back = replayer.bundle(rec, "Eq. 1@iter=3:backward", tmp_path / "back.pdbg")
    assert back.steps == 2  # the backward step and its forward call
    assert pdbg("replay", str(back.path), cwd=tmp_path, code=code).returncode == 0
    whole = replayer.bundle(rec, "Eq. 2@iter=3", tmp_path / "iter.pdbg", iteration=True)
    res = pdbg("verify", str(whole.path), "--json", cwd=tmp_path, code=code)
    assert res.returncode == 0 and json.loads(res.stdout) == {"replayed": 4, "matched": 4, "mismatches": [],
                                                              "not_replayed": [], "environment_differences": []}
    refused = pdbg("bundle", str(run_path), "Eq. 2@iter=3", "-o", str(whole.path), cwd=tmp_path, code=code)
    assert refused.returncode == 2 and "already exists" in refused.stderr
    for directory in (tmp_path / "out", run_path):  # a directory, a recording: never replaced, also with --force
        directory.mkdir(exist_ok=True)
        before = sorted(directory.rglob("*"))
        refused = pdbg("bundle", str(run_path), "Eq. 2@iter=3", "-o", str(directory), "--force", cwd=tmp_path,
                       code=code)
        assert refused.returncode == 2 and refused.stderr == (
            f"pdbg: error: {directory} is a directory; give the path of the bundle file to write, such as "
            f"{directory / 'failure.pdbg'}\n"), refused.stderr
        assert sorted(directory.rglob("*")) == before


def test_repro_script_and_code_drift(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """repro.py exits 0 on a match; after the user's code changed, 1, and pdbg info names the drift;
    --use-bundled-source replays with the code the bundle carries."""
    run_path, code = recorded
    mine = tmp_path / "code"
    shutil.copytree(code, mine)
    res = pdbg("bundle", str(run_path), "Eq. 1@iter=2", "-o", "failure.pdbg", "--script", cwd=tmp_path, code=mine)
    assert res.returncode == 0, res.stderr
    assert run([sys.executable, "repro.py"], tmp_path, mine).returncode == 0
    # the bundle was made from the original code dir; now the user's copy of it changes
    module = mine / "bundlemod.py"
    module.write_text(module.read_text().replace("torch.tanh(self.lin(x))", "torch.tanh(self.lin(x) * 1.01)"))
    bundle_code = json.loads(zipfile.ZipFile(tmp_path / "failure.pdbg").read("bundle.json"))["sources"]
    assert any(path.endswith("bundlemod.py") for path in bundle_code)
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(tmp_path / "failure.pdbg", moved)
    shutil.copy(tmp_path / "repro.py", moved)
    (code / "bundlemod.py").rename(code / "bundlemod.py.orig")  # only the changed copy is importable now
    try:
        repro = run([sys.executable, "repro.py"], moved, mine)
        assert repro.returncode == 1 and "MISMATCH" in repro.stdout and "changed since recording" in repro.stdout
        info = pdbg("info", "failure.pdbg", cwd=moved, code=mine)
        assert "code of Projection (bundlemod:Projection): changed since recording" in info.stdout
        bundled = pdbg("replay", "failure.pdbg", "--use-bundled-source", cwd=moved, code=mine)
        assert bundled.returncode == 0, bundled.stdout + bundled.stderr
    finally:
        (code / "bundlemod.py.orig").rename(code / "bundlemod.py")


def test_repro_script_piped_into_a_reader_that_left_answers_by_its_exit_status(tmp_path: Path) -> None:
    """``python repro.py | head -3``: repro.py ended with a BrokenPipeError traceback (exit 1 for a replay
    that matched) where pdbg ends its output quietly. Its stdout a pipe closed before it writes: no
    traceback, and the exit status is still the answer."""
    from tests.models import smooth_relu

    with recorder.record(tmp_path / "run.zarr"):
        smooth_relu(torch.linspace(-2.0, 2.0, 64))
    replayer.bundle(replayer.open(tmp_path / "run.zarr"), 0, tmp_path / "failure.pdbg", repro=True)
    for unbuffered in ([], ["-u"]):  # (-u: each line written at once; else all of it at exit)
        read, write = os.pipe()
        os.close(read)  # the reader left before the first line
        try:
            res = subprocess.run([sys.executable, *unbuffered, "repro.py"], cwd=tmp_path, env=env_with(tmp_path),
                                 stdout=write, stderr=subprocess.PIPE, text=True, timeout=300, check=False)
        finally:
            os.close(write)
        assert res.returncode == 0 and "Traceback" not in res.stderr and "BrokenPipeError" not in res.stderr, \
            res.stderr
    res = run([sys.executable, "repro.py"], tmp_path, tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("step 0 (smooth_relu, forward): bitwise match"), res.stdout


def test_a_verified_bundle_says_what_verified_it_and_what_differs_here(recorded: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """bundle.json's verification said match or not, never what replayed it: a receiver whose replay
    differed could not tell whether it was verified on the recording's machine, nor compare it with
    theirs. It names PaperDebugger, torch (with its build), Python, the machine, CPU capability, the
    devices and the host; pdbg info, replay, bundle, repro.py, the TUI and the notebook show it, and
    what here differs from it. A bundle made before says it is not recorded."""
    import asyncio
    import importlib.metadata
    import platform
    import socket

    from tui.app import open_app

    run_path, code = recorded
    made = pdbg("bundle", str(run_path), "Eq. 1@iter=2", "-o", "failure.pdbg", "--verify", "--repro", cwd=tmp_path,
                code=code)
    assert made.returncode == 0, made.stdout + made.stderr
    env = json.loads(zipfile.ZipFile(tmp_path / "failure.pdbg").read("bundle.json"))["verified"]["environment"]
    here = {"paperdebugger": importlib.metadata.version("paperdebugger"), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "hostname": socket.gethostname(),
            "devices": ["cpu"], "cuda": None}
    assert {k: env.get(k) for k in here} == here
    said = (f"PaperDebugger {here['paperdebugger']}, torch {torch.__version__}, numpy ")
    host = f"CPU capability {here['cpu_capability']}, tensors on cpu, host {here['hostname']} (the machine that " \
        "recorded it)"
    assert f"verified with: {said}" in made.stdout and host in made.stdout, made.stdout
    info = pdbg("info", "failure.pdbg", cwd=tmp_path, code=code)
    assert f"verified with: {said}" in info.stdout and host in info.stdout, info.stdout
    assert "here: the same as where it was verified\n" in info.stdout
    assert "here the same" in run([sys.executable, "repro.py"], tmp_path, code).stdout

    elsewhere = {"torch": "2.4.0", "torch_cuda": "12.1", "cpu_capability": "NO AVX", "hostname": "gpu-7",
                 "devices": ["cuda:0"], "cuda": [{"name": "NVIDIA H100 80GB HBM3", "sm_count": 132}]}

    def verified_elsewhere(name: str, data: bytes) -> bytes:
        if name != "bundle.json":
            return data
        doc = json.loads(data)
        doc["verified"]["environment"].update(elsewhere)
        return json.dumps(doc).encode()

    rewrite(tmp_path / "failure.pdbg", tmp_path / "other.pdbg", verified_elsewhere)
    differ = (f"torch version: verified with 2.4.0 (CUDA 12.1), here {torch.__version__}; CPU capability: verified "
              f"with NO AVX, here {here['cpu_capability']}")
    info = pdbg("info", "other.pdbg", cwd=tmp_path, code=code)
    assert f"host gpu-7 (not the machine that recorded it, {here['hostname']})" in info.stdout, info.stdout
    assert "tensors on cuda:0 (NVIDIA H100 80GB HBM3)" in info.stdout
    assert f"here: differs from where it was verified: {differ}" in info.stdout, info.stdout
    doc = json.loads(pdbg("info", "other.pdbg", "--json", cwd=tmp_path, code=code).stdout)["bundle"]
    assert doc["verified_environment_differences"][:2] == differ.split("; ")
    replayed = pdbg("replay", "other.pdbg", cwd=tmp_path, code=code)
    assert replayed.returncode == 0 and f"here differs: {differ}" in replayed.stdout, replayed.stdout
    repro = run([sys.executable, "repro.py", "other.pdbg"], tmp_path, code)
    assert repro.returncode == 0 and "note: bundle verified when made: bitwise match, with PaperDebugger" in \
        repro.stdout and f"here differs: {differ}" in repro.stdout, repro.stdout

    async def opened(path: Path) -> str:
        app = open_app(str(path))
        async with app.run_test(size=(150, 40)) as pilot:
            await pilot.pause()
            return str(app.panel_text)

    assert f"here differs: {differ}" in asyncio.run(opened(tmp_path / "other.pdbg"))

    def made_before(name: str, data: bytes) -> bytes:
        if name != "bundle.json":
            return data
        doc = json.loads(data)
        del doc["verified"]["environment"]
        return json.dumps(doc).encode()

    rewrite(tmp_path / "failure.pdbg", tmp_path / "before.pdbg", made_before)
    info = pdbg("info", "before.pdbg", cwd=tmp_path, code=code)
    assert info.returncode == 0 and "verified when made: bitwise match" in info.stdout
    assert "verified with: not recorded (the bundle was made before bundles recorded what verified them)" in \
        info.stdout and "here:" not in info.stdout
    assert json.loads(pdbg("info", "before.pdbg", "--json", cwd=tmp_path, code=code).stdout)["bundle"][
        "verified_environment_differences"] is None
    replayed = pdbg("replay", "before.pdbg", cwd=tmp_path, code=code)
    assert replayed.returncode == 0 and "bundle verified when made: bitwise match (with what PaperDebugger, torch " \
        "and machine is not recorded" in replayed.stdout, replayed.stdout + replayed.stderr

    from replayer import notebook

    made_here = replayer.bundle(replayer.open(run_path), "Eq. 1@iter=2", tmp_path / "nb.pdbg", verify=True)
    assert made_here.verified_with is not None and made_here.verified_with["torch"] == torch.__version__
    assert made_here.to_json()["verified_with"] == made_here.verified_with
    assert f"torch {torch.__version__}" in notebook.bundle_info(made_here)


def test_a_bundle_names_a_submodule_class_edited_here_or_in_its_carried_copy(tmp_path: Path) -> None:
    """Blocks holding an MLP of the user's module file, MLP edited after recording: pdbg info of a bundle
    named only Block's code, unchanged, and a bundle made after the edit carried the edited MLP and said
    nothing. Now info names MLP, changed here, and says whether the bundled copy is the recorded code; a
    bundle made after the edit warns that it carries a changed MLP, its verification names MLP as the likely
    cause, and a replay with its bundled source elsewhere names MLP too."""
    from tests.cli import pdbg_here
    from tests.models import edit_mlp, record_submodel

    run_path = record_submodel(tmp_path)
    made = pdbg_here("bundle", str(run_path), "0", "-o", "before.pdbg", "--verify", "--json", cwd=tmp_path)
    assert made.returncode == 0 and json.loads(made.stdout)["code_notes"] == [], made.stdout
    module = edit_mlp(tmp_path)
    info = pdbg_here("info", "before.pdbg", cwd=tmp_path).stdout
    assert f"code of MLP (submodel:MLP, a submodule of Block: blocks.0.mlp): changed since recording ({module}) - " \
        "bundled source available (--use-bundled-source)\n" in info, info
    assert f"code of Gate (submodel:Gate, a submodule of Block: blocks.0.gate): unchanged ({module}) - bundled " \
        "source available (--use-bundled-source)\n" in info, info
    carried = pdbg_here("replay", "before.pdbg", "--use-bundled-source", "--json", cwd=tmp_path)
    assert carried.returncode == 0 and json.loads(carried.stdout)["warnings"] == [], carried.stdout

    made = pdbg_here("bundle", str(run_path), "0", "-o", "after.pdbg", "--verify", cwd=tmp_path)
    assert made.returncode == 1 and "verified: MISMATCH when replayed from the bundle" in made.stdout
    assert f"warning: code of MLP (a submodule of Block: blocks.0.mlp) changed since recording ({module}:6): a " \
        "likely cause of the difference\n" in made.stdout, made.stdout
    assert f"warning: the carried {module} holds MLP (a submodule of Block: blocks.0.mlp) changed since recording: a " \
        "replay with --use-bundled-source runs that code\n" in made.stdout, made.stdout
    info = pdbg_here("info", "after.pdbg", cwd=tmp_path).stdout
    assert "code of MLP (submodel:MLP, a submodule of Block: blocks.0.mlp): changed since recording " \
        f"({module}) - bundled source available (--use-bundled-source), but the bundled copy changed since " \
        "recording\n" in info, info
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(tmp_path / "after.pdbg", elsewhere)
    res = pdbg_here("replay", "after.pdbg", "--use-bundled-source", "--json", cwd=elsewhere)
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and not doc["match"]
    assert doc["warnings"] == [f"code of MLP (a submodule of Block: blocks.0.mlp) changed since recording "
                               f"({module}:6): a likely cause of the difference"], doc["warnings"]


OP_SCRIPT = """
import sys

import torch
from torch import nn

import recorder

LIB = torch.library.Library("pdbg_bundled", "DEF")
LIB.define("soft(Tensor x) -> Tensor")


def _soft(x):
    return torch.log1p(torch.exp(x * 2.0)) / 2.0


LIB.impl("soft", _soft, "CPU")


@recorder.paper_step("Eq. 3")
class Soft(nn.Module):
    def forward(self, x):
        return torch.ops.pdbg_bundled.soft(x)


if __name__ == "__main__":
    with recorder.record(sys.argv[1]):
        Soft()(torch.linspace(-2, 2, 8))
"""


def test_a_bundle_verification_names_the_script_whose_operator_changed(tmp_path: Path) -> None:
    """The body of a custom operator the script defines (torch.library) edited after recording: bundle --verify
    said "verified: MISMATCH" with no reason (its code notes were empty), where pdbg replay of the step named the
    script modified since. Now the verification names it, with the operator's function its call ran; and the
    bundles made one after another in this process all load the script (its operator defined again)."""
    from tests.cli import pdbg_here

    script = tmp_path / "train.py"
    script.write_text(OP_SCRIPT)
    assert run([sys.executable, "train.py", "run.zarr"], tmp_path, tmp_path).returncode == 0
    made = pdbg_here("bundle", "run.zarr", "0", "-o", "before.pdbg", "--verify", "--json", cwd=tmp_path)
    doc = json.loads(made.stdout)
    assert made.returncode == 0 and doc["verified"] is True and doc["code_notes"] == [], made.stdout
    script.write_text(OP_SCRIPT.replace("x * 2.0", "x * 2.01"))
    os.utime(script, (time.time() + 5, time.time() + 5))  # (a second's clock on some file systems)
    why = (f"{script} was modified after the recording began, and the step's module uses Soft from it and its call "
           "ran _soft there: its code may not be what ran (a likely cause of any difference)")
    made = pdbg_here("bundle", "run.zarr", "0", "-o", "after.pdbg", "--verify", cwd=tmp_path)
    assert made.returncode == 1 and "verified: MISMATCH when replayed from the bundle" in made.stdout, made.stdout
    assert f"\nwarning: {why}\n" in made.stdout, made.stdout
    made = pdbg_here("bundle", "run.zarr", "0", "-o", "again.pdbg", "--verify", "--json", cwd=tmp_path)
    doc = json.loads(made.stdout)
    assert made.returncode == 1 and doc["verified"] is False and doc["code_notes"] == [why], made.stdout


class Evil:
    """Unpickling this creates a marker file: the proof that a planted payload ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def rewrite(source: Path, target: Path, change: object) -> None:
    """Copy a zip, letting ``change(name, data)`` return new bytes, None to drop, or extra members."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = change(info.filename, src.read(info))  # type: ignore[operator]
            if data is not None:
                dst.writestr(info.filename, data)


def test_hostile_bundles_are_refused_and_run_nothing(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    run_path, code = recorded
    good = replayer.bundle(replayer.open(run_path), "Eq. 2@iter=1", tmp_path / "good.pdbg").path
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(Evil(marker))
    chunk = next(n for n in zipfile.ZipFile(good).namelist() if n.startswith("rank0/steps/name/c"))

    def pickle_codec(name: str, data: bytes) -> bytes:
        if name == "rank0/steps/name/zarr.json":
            meta = json.loads(data)
            meta["codecs"] = [{"name": "numcodecs.pickle", "configuration": {}}]
            return json.dumps(meta).encode()
        return payload if name == chunk else data

    def huge(name: str, data: bytes) -> bytes:
        if name == "rank0/steps/name/zarr.json":
            meta = json.loads(data)
            meta["shape"] = [1 << 40]  # 8 TB of int64
            return json.dumps(meta).encode()
        return data

    def newer(name: str, data: bytes) -> bytes:
        if name in ("zarr.json", "manifest.json"):
            now = layout.SCHEMA_VERSION.encode()
            return data.replace(b'"schema_version": "' + now + b'"', b'"schema_version": "9.0"').replace(
                b'"schema_version":"' + now + b'"', b'"schema_version":"9.0"')
        return data

    def origin_text(name: str, data: bytes) -> bytes:  # bundle.json fields of another type: it was a traceback
        return json.dumps({**json.loads(data), "origin": "x"}).encode() if name == "bundle.json" else data

    cases = {"pickle": pickle_codec, "huge": huge, "newer": newer, "origin": origin_text}
    for name, change in cases.items():
        rewrite(good, tmp_path / f"{name}.pdbg", change)
    with zipfile.ZipFile(tmp_path / "traversal.pdbg", "w") as z:
        for info in zipfile.ZipFile(good).infolist():
            z.writestr(info.filename, zipfile.ZipFile(good).read(info))
        z.writestr("../escaped.txt", b"outside")
    with zipfile.ZipFile(tmp_path / "duplicate.pdbg", "w") as z:
        for info in zipfile.ZipFile(good).infolist():
            z.writestr(info.filename, zipfile.ZipFile(good).read(info))
        with pytest.warns(UserWarning, match="Duplicate name"):
            z.writestr("zarr.json", b"{}")
    data = good.read_bytes()
    (tmp_path / "truncated.pdbg").write_bytes(data[: len(data) // 2])
    (tmp_path / "random.pdbg").write_bytes(os.urandom(4096))
    expected = {"pickle": "codec 'numcodecs.pickle'", "huge": "declare", "newer": "newer",
                "traversal": "points outside the bundle", "duplicate": "more than once",
                "truncated": "not a PaperDebugger recording", "random": "not a PaperDebugger recording",
                "origin": "bundle.json holds origin of the wrong type"}
    for name, message in expected.items():
        for command in ("info", "replay"):
            res = pdbg(command, f"{name}.pdbg", cwd=tmp_path, code=code)
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 2 and len(lines) == 1 and message in lines[0], (name, command, res.stderr)
            assert "Traceback" not in res.stderr
    assert not marker.exists() and not (tmp_path.parent / "escaped.txt").exists()
    # the planted payload is live: unpickled, it does create the marker
    (tmp_path / "payload.bin").write_bytes(payload)
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())",
                    str(tmp_path / "payload.bin")], check=True, capture_output=True)
    assert marker.exists()


def test_a_bundle_naming_a_function_that_is_no_paper_step_runs_nothing(recorded: tuple[Path, Path], tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle is data from elsewhere: one whose step names os.system, to be called with a
    recorded string, is refused; a replay calls only paper steps."""
    run_path, code = recorded
    marker = tmp_path / "PWNED"
    rec = replayer.open(run_path)
    step = rec.step("Eq. 2@iter=1")
    real = replayer.Step._doc

    def forged(self: replayer.Step, name: str) -> object:
        doc = real(self, name)
        if name == "definition":
            return {**doc, "ref": "os:system", "file": None}
        if name == "args":
            return {"args": [f"touch {marker}"], "kwargs": {}}
        return doc

    monkeypatch.setattr(replayer.Step, "_doc", forged)
    hostile = replayer.bundle(rec, step, tmp_path / "hostile.pdbg").path
    monkeypatch.undo()
    res = pdbg("replay", str(hostile), cwd=tmp_path, code=code)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "os:system is not a paper step" in lines[0], res.stderr
    assert not marker.exists()


def test_a_module_attribute_naming_a_function_outside_torch_math_runs_nothing(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording whose module skeleton sets ``forward`` to os.system (reached through torch's own
    namespace, ``torch:os.system``) and whose argument is a shell command: the replay calls nothing."""
    from recorder import jsonval

    marker = tmp_path / "PWNED"

    def stand_in(cmd: str) -> torch.Tensor:
        return torch.zeros(1)

    real = jsonval.function_ref
    monkeypatch.setattr(jsonval, "function_ref", lambda fn: "torch:os.system" if fn is stand_in else real(fn))

    class Top(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Identity()
            self.inner.forward = stand_in

        def forward(self, cmd: str) -> torch.Tensor:
            return self.inner(cmd)

    top = Top()
    with recorder.record(tmp_path / "run.zarr", model=top, mode="full", modules=["inner"]):
        top(f"touch {marker}")
    monkeypatch.undo()
    rec = replayer.open(tmp_path / "run.zarr")
    assert rec.step(0)._doc("module")["attrs"]["forward"] == {"$function": "torch:os.system"}
    with pytest.raises(ReplayError, match="rebuilt incomplete .*torch:os.system"):  # refused: nothing called
        replayer.replay(rec, 0)
    assert not marker.exists()


SCRIPT_STEP = '''
import sys

import torch

import recorder
import replayer


@recorder.paper_step("Eq. 7", description="a gate defined in the training script")
def gate(x):
    return torch.sigmoid(x) * x


@recorder.paper_step("Eq. 8", description="a root that goes NaN")
def root(x):
    return torch.sqrt(x - 1.0)


if __name__ == "__main__":
    with recorder.record(sys.argv[1], mode="full"):
        root(gate(torch.randn(100)))
    replayer.bundle(replayer.open(sys.argv[1]), 0, sys.argv[2], script=True)
    replayer.bundle(replayer.open(sys.argv[1]), 1, sys.argv[3])
'''


def test_a_bundle_replays_where_its_training_script_is_not(tmp_path: Path) -> None:
    """A step defined in the training script: its bundle, copied to a machine (a directory) without
    the script, runs the copy of the script it carries only when asked: a plain replay or verify is
    refused in one line that says how (nothing of the copy ran), --use-bundled-source replays it
    bit for bit, `pdbg verify` too. The copy is read, never run, to show code: the operation that
    made a NaN is shown with its line of code."""
    where = tmp_path / "made"
    where.mkdir()
    (where / "train.py").write_text(SCRIPT_STEP)
    res = run([sys.executable, "train.py", "run.zarr", "gate.pdbg", "root.pdbg"], where, where)
    assert res.returncode == 0, res.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(where / "gate.pdbg", elsewhere / "gate.pdbg")
    shutil.copy(where / "root.pdbg", elsewhere / "root.pdbg")
    shutil.copy(where / "repro.py", elsewhere / "repro.py")
    shutil.rmtree(where)
    for command in ("replay", "verify"):
        refused = pdbg(command, "gate.pdbg", cwd=elsewhere, code=elsewhere)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "the bundle carries a copy, run only if you ask: replay with --use-bundled-source" in refused.stderr
    repro = run([sys.executable, "repro.py"], elsewhere, elsewhere)
    assert repro.returncode == 2 and "--use-bundled-source" in repro.stderr, repro.stderr
    assert sorted(elsewhere.iterdir()) == [elsewhere / "gate.pdbg", elsewhere / "repro.py", elsewhere / "root.pdbg"]
    repro = run([sys.executable, "repro.py", "--use-bundled-source"], elsewhere, elsewhere)
    assert repro.returncode == 0 and "bitwise match" in repro.stdout, repro.stdout + repro.stderr
    res = pdbg("replay", "gate.pdbg", "--json", "--use-bundled-source", cwd=elsewhere, code=elsewhere)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["match"] is True and not any("cannot be read now" in w for w in doc["warnings"]), doc["warnings"]
    ops = pdbg("bisect", "root.pdbg", "--ops", cwd=elsewhere, code=elsewhere)
    assert "this step cannot be replayed: the training script" in ops.stdout and ops.returncode == 1, ops.stdout
    ops = pdbg("bisect", "root.pdbg", "--ops", "--use-bundled-source", cwd=elsewhere, code=elsewhere)
    assert "operation: aten::sqrt" in ops.stdout and "    return torch.sqrt(x - 1.0)" in ops.stdout.splitlines(), \
        ops.stdout + ops.stderr
    assert pdbg("verify", "gate.pdbg", "--use-bundled-source", cwd=elsewhere, code=elsewhere).returncode == 0
    with pytest.raises(ReplayError, match="the bundle carries a copy, run only if you ask"):
        replayer.replay(replayer.open(elsewhere / "gate.pdbg"))
    assert replayer.replay(replayer.open(elsewhere / "gate.pdbg"), use_bundled_source=True).match


@pytest.mark.parametrize("name", ['eq\\x3.pdbg', 'a"""b\\N.pdbg', 'Éq. 5 — résidu\u202e\n"\\u.pdbg'])
def test_repro_script_runs_whatever_the_bundles_file_name(recorded: tuple[Path, Path], tmp_path: Path,
                                                          name: str) -> None:
    """The bundle's file name went raw into repro.py's docstring: a backslash (eq\\x3.pdbg: "truncated
    \\xXX escape") or \"\"\" made a script that did not parse, exit 1, what repro.py says of a mismatch."""
    run_path, code = recorded
    made = replayer.bundle(replayer.open(run_path), "Eq. 1@iter=7", tmp_path / name, repro=True)
    assert made.script == tmp_path / "repro.py"
    compile(made.script.read_text(encoding="utf-8"), str(made.script), "exec")
    repro = run([sys.executable, "repro.py"], tmp_path, code)
    assert repro.returncode == 0 and "bitwise match" in repro.stdout, repro.stdout + repro.stderr


def test_an_existing_repro_script_is_not_overwritten(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """--script writes repro.py next to the bundle: an existing one is refused in one line, before
    anything is written, unless --force."""
    run_path, code = recorded
    (tmp_path / "repro.py").write_text("# mine\n")
    res = pdbg("bundle", str(run_path), "Eq. 1@iter=7", "-o", "f.pdbg", "--script", cwd=tmp_path, code=code)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "repro.py already exists" in lines[0]
    assert (tmp_path / "repro.py").read_text() == "# mine\n" and not (tmp_path / "f.pdbg").exists()
    res = pdbg("bundle", str(run_path), "Eq. 1@iter=7", "-o", "f.pdbg", "--script", "--force", cwd=tmp_path,
               code=code)
    assert res.returncode == 0 and "# mine" not in (tmp_path / "repro.py").read_text()


PROJECT_TRAIN = '''
import sys
import torch
import recorder
from mylib.acts import act
from mylib.util import raw


@recorder.paper_step("Eq. 2")
def scaled(x):
    return raw(x) * 0.5


if __name__ == "__main__":
    with recorder.record(sys.argv[1], mode="full"):
        scaled(act(torch.linspace(-3.0, 3.0, 16)))
    rec = __import__("replayer").open(sys.argv[1])
    __import__("replayer").bundle(rec, 0, sys.argv[2])
    __import__("replayer").bundle(rec, 1, sys.argv[3])
'''


def test_a_bundle_carries_the_project_modules_its_code_imports(tmp_path: Path) -> None:
    """A step in a package module that imports another of the package (absolute and relative), and
    one in the training script that imports the package: their bundles carry those modules too
    (found by reading imports), and replay with --use-bundled-source on a machine without the
    project, bit for bit; nothing of the bundle stays in sys.modules."""
    project = tmp_path / "project"
    (project / "mylib").mkdir(parents=True)
    (project / "mylib" / "__init__.py").write_text("")
    (project / "mylib" / "util.py").write_text("import torch\n\n\ndef raw(x):\n    return torch.exp(x) - 1\n")
    (project / "mylib" / "consts.py").write_text("SLOPE = 0.25\n")
    (project / "mylib" / "acts.py").write_text(
        "import recorder\nfrom mylib.util import raw\nfrom .consts import SLOPE\n\n\n"
        "@recorder.paper_step('Eq. 1')\ndef act(x):\n    return raw(x) * SLOPE\n")
    (project / "train.py").write_text(PROJECT_TRAIN)
    res = run([sys.executable, "train.py", "run.zarr", "act.pdbg", "scaled.pdbg"], project, project)
    assert res.returncode == 0, res.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("act.pdbg", "scaled.pdbg"):
        shutil.copy(project / name, elsewhere / name)
    shutil.rmtree(project)
    carried = replayer.open(elsewhere / "act.pdbg").bundle_info["modules"]
    assert set(carried) == {"mylib", "mylib.acts", "mylib.util", "mylib.consts"}, carried
    for name in ("act.pdbg", "scaled.pdbg"):
        res = pdbg("replay", name, cwd=elsewhere, code=elsewhere)  # the code is not here
        assert res.returncode == 2 and "replay with --use-bundled-source (use_bundled_source=True" in res.stderr, \
            res.stderr
        res = pdbg("replay", name, "--use-bundled-source", cwd=elsewhere, code=elsewhere)
        assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr
    assert replayer.replay(replayer.open(elsewhere / "act.pdbg"), use_bundled_source=True).match
    assert not [m for m in sys.modules if m == "mylib" or m.startswith("mylib.")]


NO_GRAD_MODULE = '''
import torch
import recorder


@recorder.paper_step("Eq. 4", description="SGD with momentum")
@torch.no_grad()
def sgd_update(param, grad, buf, lr, momentum):
    buf.mul_(momentum).add_(grad)
    param.add_(buf, alpha=-lr)


@torch.no_grad()
@recorder.paper_step("Eq. 5", description="decay")
def decay(param, rate):
    param.mul_(1 - rate)
'''

NO_GRAD_TRAIN = '''
import sys
import torch
import recorder
import replayer
from optlib import decay, sgd_update

if __name__ == "__main__":
    with recorder.record(sys.argv[1]):
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 0.5)
        sgd_update(p, p.grad, torch.zeros(4), 0.1, 0.9)
        decay(p, 0.01)
    rec = replayer.open(sys.argv[1])
    replayer.bundle(rec, 0, "update.pdbg")
    replayer.bundle(rec, 1, "decay.pdbg")
'''


def test_a_bundle_of_a_step_under_no_grad_carries_its_module_and_names_its_file(tmp_path: Path) -> None:
    """``@paper_step`` above ``@torch.no_grad()`` (an optimizer update) in a project module: the step's
    file was recorded as torch's ``utils/_contextlib.py``, so its bundle carried no source ("source
    carried: none") and failed elsewhere with --use-bundled-source, and the code-drift warning named
    torch's file ("recorded at .../torch/utils/_contextlib.py:8"). Both orders of the decorators: the
    bundle carries the module, pdbg info says its code is unchanged and bundled, the drift warning
    names the module's file, and the bundle replays elsewhere bit for bit."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "optlib.py").write_text(NO_GRAD_MODULE)
    (project / "train.py").write_text(NO_GRAD_TRAIN)
    res = run([sys.executable, "train.py", "run.zarr"], project, project)
    assert res.returncode == 0, res.stderr
    lib = str(project / "optlib.py")
    for name, step in (("update.pdbg", "sgd_update"), ("decay.pdbg", "decay")):
        assert replayer.open(project / name).bundle_info["sources"].keys() == {lib}
        res = pdbg("info", name, cwd=project, code=project)
        assert f"code of {step} (optlib:{step}): unchanged ({lib}) - bundled source available" in res.stdout, \
            res.stdout + res.stderr
    (project / "optlib.py").write_text(NO_GRAD_MODULE.replace("param.mul_(1 - rate)", "param.mul_(1 - 2 * rate)")
                                       .replace("param.add_(buf, alpha=-lr)", "param.add_(buf, alpha=-2 * lr)"))
    for index, step, line in (("0", "sgd_update", 6), ("1", "decay", 13)):
        res = pdbg("replay", "run.zarr", index, cwd=project, code=project)
        assert f"warning: code of {step} changed since recording ({lib}:{line})\n" in res.stdout, \
            res.stdout + res.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("update.pdbg", "decay.pdbg"):
        shutil.copy(project / name, elsewhere / name)
    shutil.rmtree(project)
    for name in ("update.pdbg", "decay.pdbg"):
        res = pdbg("replay", name, "--use-bundled-source", cwd=elsewhere, code=elsewhere)
        assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr


def test_a_bundle_of_a_call_given_a_misaligned_view_verifies(tmp_path: Path) -> None:
    """An nn.LSTMCell unrolled over xs[t] of a time-major batch (rows of 72 bytes): the odd calls' inputs
    began 8 and 24 bytes past a 64-byte boundary, and their bundles failed their own check ("MISMATCH when
    replayed from the bundle"): a bundle keeps where they lay, and the forward and backward of such a call
    verify and replay from the bundle bit for bit."""
    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    cell, xs = nn.LSTMCell(6, 10), torch.randn(4, 3, 6)
    with recorder.record(path, mode="full", modules="**"):
        h = c = torch.zeros(3, 10)
        outs = []
        for t in range(4):
            h, c = cell(xs[t], (h, c))
            outs.append(h)
        torch.stack(outs).square().sum().backward()
    rec = replayer.open(path)
    odd = [s for s in rec.steps if s.call in (1, 3)]
    for step in odd:
        out = tmp_path / f"{step.index}.pdbg"
        info = replayer.bundle(rec, step, out, verify=True)
        assert info.verified is True, (step.selector, info)
        with replayer.open(out) as bundled:
            assert replayer.replay(bundled, info.main_step).match
            assert bundled.step(info.main_step).extra.get("misaligned") == step.extra.get("misaligned")
    assert {(s.phase, s.call) for s in odd if s.extra.get("misaligned")} == \
        {("forward", 1), ("forward", 3), ("backward", 3)}, [(s.phase, s.call, s.extra) for s in odd]


def test_an_open_bundle_lets_go_of_its_file_when_closed(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """A bundle's Recording holds its zip open (a notebook's Out[] keeps every one displayed):
    `with replayer.open(...)` or close() lets it go. Out of file descriptors, opening one says so
    (it said the intact bundle was not a recording)."""
    run_path, _ = recorded
    bundle = replayer.bundle(replayer.open(run_path), "Eq. 1@iter=3", tmp_path / "one.pdbg").path
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731

    def holding() -> int:  # descriptors open on the bundle (other threads may open other files meanwhile)
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found += os.readlink(f"/proc/self/fd/{fd}") == str(bundle)
        return found

    with replayer.open(bundle) as rec:
        assert holding() == 1 and rec.step(0).tensor("args.0").numel()
    assert holding() == 0
    held = [replayer.open(bundle) for _ in range(3)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (fds() + 1, hard))
    try:
        with pytest.raises(FormatError, match=r"one.pdbg: cannot be read \(Too many open files\)"):
            for _ in range(8):
                held.append(replayer.open(bundle))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for rec in held:
            rec.close()
    assert holding() == 0


def test_a_bundle_carries_only_the_python_files_its_steps_code_came_from(tmp_path: Path) -> None:
    """A recording from someone else names the files its code came from, and a bundle of it packed
    whatever they named (a credentials file, /etc/passwd as the script). Only a Python file that
    holds a step's whole recorded definition is carried (and the project modules it imports)."""
    from types import SimpleNamespace

    from replayer import bundles

    secret = tmp_path / "credentials"
    secret.write_text("AWS_SECRET=hunter2\n")
    settings = tmp_path / "settings.py"
    settings.write_text("import os\nSECRET_KEY = 'hunter2'\n")
    layers = tmp_path / "layers.py"
    layers.write_text("import torch\n\n\ndef act(x):\n    return torch.tanh(x)\n")

    def step(file: Path, source: str) -> SimpleNamespace:
        return SimpleNamespace(definition={"ref": f"{file.stem}:act", "file": str(file), "source": source},
                               _doc=lambda column: None)

    rec = SimpleNamespace(run_info={"script": str(secret)})
    steps = [step(secret, "AWS_SECRET"), step(settings, "import os"), step(settings, "SECRET_KEY = 'hunter2'"),
             step(layers, "def act(x):\n    return torch.tanh(x)\n")]
    sources, modules = bundles._sources(rec, steps, str(secret))
    assert list(sources) == [str(layers)] and modules == {"layers": str(layers)}


LAUNCHER = """
import sys
import torch
import recorder
import local_settings  # the launcher's own settings (a token): not the step's code
from mylib.acts import act

if __name__ == "__main__":
    with recorder.record(sys.argv[1], mode="full"):
        act(torch.linspace(-3.0, 3.0, 16))
"""

SCRIPT_IN_SUBDIRECTORY = """
import os
import sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the project's root, for common.py
import torch
import recorder
from common import SLOPE


@recorder.paper_step("Eq. 8")
def sloped(x):
    return torch.tanh(x) * SLOPE


if __name__ == "__main__":
    with recorder.record(sys.argv[1], mode="full"):
        sloped(torch.linspace(-3.0, 3.0, 16))
"""


def test_a_bundle_carries_the_script_only_for_code_it_defined_and_finds_what_it_imports_above_it(
        tmp_path: Path) -> None:
    """A launcher script that imports a settings file holding a token was packed with its imports
    into every bundle, though the bundled step's code is in the package; a script in scripts/ that
    imports ../common.py was packed without it, so its bundle failed elsewhere (No module named
    'common'). The bundle says what it carries."""
    project = tmp_path / "project"
    (project / "mylib").mkdir(parents=True)
    (project / "scripts").mkdir()
    (project / "mylib" / "__init__.py").write_text("")
    (project / "mylib" / "acts.py").write_text(
        "import torch\nimport recorder\n\n\n@recorder.paper_step('Eq. 1')\ndef act(x):\n    return torch.tanh(x)\n")
    (project / "local_settings.py").write_text("API_TOKEN = 'sk-very-secret'\n")
    (project / "launch.py").write_text(LAUNCHER)
    (project / "common.py").write_text("SLOPE = 0.25\n")
    (project / "scripts" / "train.py").write_text(SCRIPT_IN_SUBDIRECTORY)
    for script, out in (("launch.py", "a.zarr"), ("scripts/train.py", "b.zarr")):
        res = run([sys.executable, script, out], project, project)
        assert res.returncode == 0, res.stderr
    made = pdbg("bundle", "a.zarr", "0", "-o", "a.pdbg", "--json", cwd=project, code=project)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["sources"] == [str(project / "mylib" / "acts.py")]
    with zipfile.ZipFile(project / "a.pdbg") as archive:
        assert not any(b"sk-very-secret" in archive.read(name) for name in archive.namelist())
    made = pdbg("bundle", "b.zarr", "0", "-o", "b.pdbg", cwd=project, code=project)
    assert made.returncode == 0 and "source carried: common.py, scripts/train.py" in made.stdout, made.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("a.pdbg", "b.pdbg"):
        shutil.copy(project / name, elsewhere / name)
    shutil.rmtree(project)
    res = pdbg("replay", "a.pdbg", "--use-bundled-source", cwd=elsewhere, code=elsewhere)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr
    info = pdbg("info", "b.pdbg", cwd=elsewhere, code=elsewhere)
    assert "source files carried: " in info.stdout and "common.py" in info.stdout, info.stdout
    res = pdbg("replay", "b.pdbg", "--use-bundled-source", cwd=elsewhere, code=elsewhere)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr


def test_the_changed_code_mark_looks_for_a_module_where_a_replay_does(tmp_path: Path, monkeypatch) -> None:
    """A src/ layout recorded with PYTHONPATH=src, looked at without it: pdbg info of a bundle said
    the code was "not found here" and the TUI showed no changed-code mark, while a replay found the
    module through the recorded file and warned that it had changed."""
    import importlib

    from replayer.code import drift_without_running

    package = tmp_path / "src" / "driftpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "acts.py").write_text("import torch\nimport recorder\n\n\n@recorder.paper_step('Eq. 1')\n"
                                     "def act(x):\n    return torch.tanh(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    module = importlib.import_module("driftpkg.acts")
    with recorder.record(tmp_path / "run.zarr"):
        module.act(torch.randn(3))
    for name in ("driftpkg.acts", "driftpkg"):
        sys.modules.pop(name, None)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path / "src")])
    step = replayer.open(tmp_path / "run.zarr").step(0)
    assert drift_without_running(step.definition, step.rec.run_info, []).startswith("unchanged (")
    (package / "acts.py").write_text((package / "acts.py").read_text().replace("tanh", "sigmoid"))
    assert drift_without_running(step.definition, step.rec.run_info, []).startswith("changed since recording (")


MOVED_SCRIPT = '''
import sys
import torch
import recorder


@recorder.paper_step("Eq. 2", description="softplus written with exp")
def soft(x):
    return torch.log1p(torch.exp(x))


if __name__ == "__main__":
    with recorder.record(sys.argv[1]) as run:
        for i in range(3):
            soft(torch.linspace(-1, 1, 8) * (100.0 if i == 2 else 1.0))
            run.next_iteration()
'''


def test_a_project_that_moved_is_found_with_script_by_every_command(tmp_path: Path) -> None:
    """Steps defined in a training script that moved since recording: the messages said to pass
    --script, which bisect and the TUI did not take and bundle took for repro.py's flag; pdbg bundle
    wrote a bundle without the script's code, which could not replay anywhere."""
    import asyncio

    from tui.app import open_app

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(MOVED_SCRIPT)
    assert run([sys.executable, "train.py", str(tmp_path / "run.zarr")], project, project).returncode == 0
    project.rename(tmp_path / "moved")
    script = str(tmp_path / "moved" / "train.py")
    where = str(tmp_path / "run.zarr")
    ops = pdbg("bisect", where, "--ops", cwd=tmp_path, code=tmp_path)
    assert "cannot read the training script" in ops.stdout and "--script" in ops.stdout, ops.stdout
    ops = pdbg("bisect", where, "--ops", "--script", script, cwd=tmp_path, code=tmp_path)
    assert "operation: aten::exp" in ops.stdout and ops.returncode == 1, ops.stdout + ops.stderr
    refused = pdbg("bundle", where, "Eq. 2@iter=2", "-o", "f.pdbg", cwd=tmp_path, code=tmp_path)
    assert refused.returncode == 2 and refused.stderr == (
        f"pdbg: error: step 2's code was defined in the training script {project / 'train.py'}, which the bundle must "
        "carry, but it is not there: give the script's path now with --script PATH (script= in Python)\n")
    wrong = pdbg("bundle", where, "Eq. 2@iter=2", "-o", "f.pdbg", "--script", str(tmp_path / "nope.py"), cwd=tmp_path,
                 code=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr == (  # not "give --script" to one who gave it
        f"pdbg: error: step 2's code was defined in the training script, which the bundle must carry, but "
        f"{tmp_path / 'nope.py'}, given with --script (script= in Python), is not there: give the path the script "
        f"recorded as {project / 'train.py'} has now\n"), wrong.stderr
    made = pdbg("bundle", where, "Eq. 2@iter=2", "-o", "f.pdbg", "--verify", "--script", script, "--repro",
                cwd=tmp_path, code=tmp_path)
    assert made.returncode == 0 and "verified: the bundle replays bit for bit" in made.stdout, made.stdout + made.stderr
    assert "source carried: moved/train.py\n" in made.stdout and (tmp_path / "repro.py").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(tmp_path / "f.pdbg", elsewhere / "f.pdbg")
    shutil.rmtree(tmp_path / "moved")
    replayed = pdbg("replay", "f.pdbg", "--use-bundled-source", cwd=elsewhere, code=elsewhere)
    assert replayed.returncode == 0 and "MATCH: bit for bit" in replayed.stdout, replayed.stdout + replayed.stderr

    async def press_r(**code: object) -> str:
        app = open_app(where, "Eq. 2@iter=2", **code)
        async with app.run_test(size=(110, 32)) as pilot:
            await pilot.press("r")
            await app.workers.wait_for_complete()
            await pilot.pause()
            return str(app.panel_text)

    os.makedirs(tmp_path / "moved")
    (tmp_path / "moved" / "train.py").write_text(MOVED_SCRIPT)
    assert "--script" in asyncio.run(press_r())
    assert "replay of step 2: bitwise match" in asyncio.run(press_r(script=script))


def test_a_step_that_cannot_be_replayed_here_is_bundled_unverified(recorded: tuple[Path, Path], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU step bundled on a machine without one: verify refused the whole bundle, naming "step 0"
    (its index in the bundle, not the one asked for), so the TUI's x, which verifies, exported none."""
    import importlib

    replay_mod = importlib.import_module("replayer.replay")
    run_path, code = recorded
    monkeypatch.syspath_prepend(str(code))

    def on_a_gpu(step: Any, rec: Any, notes: Any = None) -> torch.Tensor:
        raise NotOnThisMachine(f"step {rec.step} was recorded on cuda:0, and this machine has no GPU; replay it on a "
                               "machine with one")

    monkeypatch.setattr(replay_mod, "_materialize", on_a_gpu)
    rec = replayer.open(run_path)
    asked = rec.step("Eq. 1@iter=2")
    info = replayer.bundle(rec, asked, tmp_path / "gpu.pdbg", verify=True)
    assert info.verified is None and info.not_verified == (
        f"step {asked.index} was recorded on cuda:0, and this machine has no GPU; replay it on a machine with one")
    assert info.to_json()["not_verified"] == info.not_verified and (tmp_path / "gpu.pdbg").exists()
    assert replayer.open(tmp_path / "gpu.pdbg").main_step.name == asked.name
    # a refusal that holds on every machine is still one: no bundle that replays nowhere
    monkeypatch.setattr(replay_mod, "_materialize", lambda step, rec, notes=None: (_ for _ in ()).throw(
        ReplayError("the step's code cannot be found")))
    with pytest.raises(ReplayError, match="the step's code cannot be found"):
        replayer.bundle(rec, asked, tmp_path / "nowhere.pdbg", verify=True)
    assert not (tmp_path / "nowhere.pdbg").exists()


def test_bundle_script_flag_without_a_py_path_still_writes_repro_py() -> None:
    """`--script` wrote repro.py before `--repro`; now that it may take the script's path, the old
    command lines (`--script` before RUN, or last) keep their meaning."""
    from tui.cmd_bundle import legacy_script_flag

    assert legacy_script_flag(["bundle", "--script", "run.zarr", "3", "-o", "f.pdbg"]) == [
        "bundle", "--repro", "run.zarr", "3", "-o", "f.pdbg"]
    assert legacy_script_flag(["bundle", "run.zarr", "3", "-o", "f.pdbg", "--script"])[-1] == "--repro"
    assert legacy_script_flag(["bundle", "run.zarr", "3", "--script", "moved/train.py"])[-2:] == [
        "--script", "moved/train.py"]


def test_a_bundle_of_another_format_is_refused(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """bundle.json's "format" was not checked: a bundle of a newer format opened as this one."""
    run_path, code = recorded
    made = replayer.bundle(replayer.open(run_path), "Eq. 1@iter=2", tmp_path / "f.pdbg")
    opened = tmp_path / "opened"
    zipfile.ZipFile(made.path).extractall(opened)  # (an unzipped bundle opens as a directory)
    meta = json.loads((opened / "bundle.json").read_text())
    (opened / "bundle.json").write_text(json.dumps({**meta, "format": "paperdebugger.bundle/2"}))
    with pytest.raises(FormatError, match=r"bundle.json says it is a 'paperdebugger.bundle/2', which this "
                                          r"PaperDebugger does not read \(it reads 'paperdebugger.bundle'\); upgrade"):
        replayer.open(opened).bundle_info


@recorder.paper_step("Eq. 9", description="the two halves of a projection, by name")
def named_halves(x: torch.Tensor) -> Any:
    from collections import OrderedDict

    return OrderedDict(low=x[:, :2] * 2, high=torch.tanh(x[:, 2:]))


def test_a_bundle_keeps_the_schema_version_of_its_recording(tmp_path: Path) -> None:
    """A bundle was stamped with the schema of the pdbg that made it: a 1.12 step whose output was an
    OrderedDict (kept as a plain dict before 1.13) replayed bit for bit from its recording and MISMATCH from its
    bundle, read by 1.13's rules; a bundle of a newer minor's recording lost the warning that it is newer."""
    from tests.sealing import as_plain_dicts, as_schema, rewrite_docs

    path = tmp_path / "run.zarr"
    with recorder.record(path):
        named_halves(torch.randn(3, 4))
    rewrite_docs(path, as_plain_dicts)
    as_schema(path, "1.12")
    rec = replayer.open(path)
    assert replayer.replay(rec, 0).match
    made = replayer.bundle(rec, 0, tmp_path / "old.pdbg", verify=True)
    assert made.verified is True
    with replayer.open(made.path) as bundled:
        assert bundled.reader.schema_version == "1.12" and replayer.replay(bundled, 0).match

    newer = f"{layout.SCHEMA_MAJOR}.{layout.parse_version(layout.SCHEMA_VERSION)[1] + 1}"
    as_schema(path, newer)
    with pytest.warns(recorder.RecorderWarning, match=f"schema {newer}"):
        made = replayer.bundle(replayer.open(path), 0, tmp_path / "newer.pdbg")
    with pytest.warns(recorder.RecorderWarning, match=f"newer.pdbg was written by a newer PaperDebugger "
                                                      fr"\(schema {newer}"):
        assert replayer.open(made.path).reader.schema_version == newer


def test_info_of_a_bundle_of_a_flight_recording_says_what_the_bundle_holds(tmp_path: Path) -> None:
    """`pdbg info` of a bundle made from a flight recording said "tensors kept: none (the flight ring wrote
    out no iteration)", the recording's flight record, of a bundle that replays bit for bit: a recipient
    reading info first would think it useless. It says what the bundle itself holds."""
    from tests.cli import pdbg_here

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="flight", keep=2) as run:
        for i in range(4):
            named_halves(torch.full((3, 4), float("nan") if i == 3 else 0.5))
            run.next_iteration()
    rec = replayer.open(path)
    made = replayer.bundle(rec, "Eq. 9@iter=3", tmp_path / "f.pdbg", verify=True)
    assert made.verified is True
    doc = json.loads(pdbg_here("info", str(made.path), "--json", cwd=tmp_path).stdout)
    assert doc["tensors_kept"] == "those of 1 of its 1 steps (a bundle holds the tensors of the steps it replays)"
    assert "tensors kept: those of 1 of its 1 steps" in pdbg_here("info", str(made.path), cwd=tmp_path).stdout


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.lin(x)) * x


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.relu(self.fc(x)))  # the gate's grad output is the block's


def test_verify_of_a_backward_bundle_does_not_blame_flight_mode(tmp_path: Path) -> None:
    """verify of a bundled backward step of a full recording said its inner backward step kept its tensors
    "not those of their forward call, from an iteration flight mode had let go", of a run never in flight
    mode: the bundle keeps its inner calls' statistics only, and it says so."""
    from tests.cli import pdbg_here

    torch.manual_seed(0)
    model = nn.Sequential(GatedBlock())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=optimizer, modules=["0", "0.gate"]):
        for _ in range(2):
            model(torch.randn(3, 4)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    made = replayer.bundle(replayer.open(tmp_path / "run.zarr"), "0@iter=1:backward", tmp_path / "b.pdbg")
    doc = json.loads(pdbg_here("verify", str(made.path), "--json", cwd=tmp_path).stdout)
    assert doc.get("forward_not_kept") == 1, doc
    out = pdbg_here("verify", str(made.path), cwd=tmp_path).stdout
    assert "flight" not in out and ("1 of them backward steps that kept their own tensors, not those of their "
                                    "forward call, a call inside the bundled step, of which the bundle keeps the "
                                    "statistics only)") in out, out


class NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


def test_a_bundle_compares_the_running_statistics_its_step_left(tmp_path: Path) -> None:
    """A bundle of a BatchNorm block's call held no later call of the module, so its replay compared the
    output alone ("not compared: bn.running_mean ...: no later call of this module was recorded") where
    the recording compared the running statistics too, and an edit of them said NO CHANGE. The bundle
    carries the next call's buffers: compared bit for bit, and an edit shows in them."""
    torch.manual_seed(0)
    model = nn.Sequential(NormedBlock())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=optimizer, modules=["0"]):
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    made = replayer.bundle(replayer.open(tmp_path / "run.zarr"), "0@iter=1", tmp_path / "b.pdbg", verify=True)
    assert made.verified is True
    with replayer.open(made.path) as rec:
        res = replayer.replay(rec)
        after = {d.name: d for d in res.outputs if d.name.startswith("after:")}
        assert set(after) == {"after:bn.running_mean", "after:bn.running_var", "after:bn.num_batches_tracked"}
        assert all(d.match and d.max_ulp == 0 for d in after.values()) and res.match and not res.by_statistics
        assert not any("not compared" in w for w in res.warnings), res.warnings
        assert (len(rec), rec.step(1).iteration) == (2, 2)  # the module's next call, in the next iteration
        edited = replayer.replay(rec, edit={"bn.running_mean": "x + 100"})
        assert [d.name for d in edited.outputs if not d.match] == ["after:bn.running_mean"]


def test_a_step_asked_for_by_its_number_in_the_recording_names_the_bundles(recorded: tuple[Path, Path],
                                                                           tmp_path: Path) -> None:
    """`pdbg replay failure.pdbg 14`, 14 the number bisect named in the recording, was "out of range" alone: the
    refusal says a bundle numbers its steps anew, and which step the recording's is here."""
    run_path, _ = recorded
    rec = replayer.open(run_path)
    origin = rec.step("Eq. 2@iter=3")
    made = replayer.bundle(rec, origin, tmp_path / "b.pdbg")
    with replayer.open(made.path) as bundled:
        assert origin.index >= len(bundled)
        with pytest.raises(replayer.StepNotFoundError, match=(
                fr"^step {origin.index} is out of range: .*; a bundle numbers its steps from 0: step {origin.index} "
                fr"of the recording it was made from is its main step, {made.main} here \(or leave STEP out\)$")):
            bundled.step(origin.index)
        with pytest.raises(replayer.StepNotFoundError, match=r"out of range: [^;]*$"):
            bundled.step(origin.index + 1)


@recorder.paper_step("Eq. 9", description="a scaled tanh inside a block")
def scaled_tanh(h: torch.Tensor, s: float) -> torch.Tensor:
    return torch.tanh(h) * s


@recorder.paper_step("Alg. 2", step=1)
class TanhBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + scaled_tanh(self.fc(x), 2.0)  # the inner step's output and grad input are not the block's


def test_a_bundle_compares_its_inner_steps_results_bit_for_bit(tmp_path: Path) -> None:
    """A bundle of a block's backward kept its inner step's grad input as statistics only (it is not a tensor
    of the block's own), so a bundle that replays exactly was verified as "a match by statistics only for
    args.0 of step 3", where a replay of the recording matched bit for bit. The bundle keeps the inner steps'
    results: verified bit for bit, forward and backward."""
    torch.manual_seed(0)
    model = nn.Sequential(TanhBlock(), TanhBlock())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(tmp_path / "run.zarr", model=model, optimizer=optimizer):
        for _ in range(2):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    rec = replayer.open(tmp_path / "run.zarr")
    for which in ("TanhBlock@iter=1#1:backward", "TanhBlock@iter=1#1"):
        made = replayer.bundle(rec, which, tmp_path / f"{which.replace(':', '_')}.pdbg", verify=True)
        assert made.verified is True and made.verdict == "bitwise match", (which, made.verdict)
        with replayer.open(made.path) as bundled:
            res = replayer.replay(bundled)
        assert res.match and res.inner and all(s.match for s in res.inner), (which, res)
        assert res.by_statistics == [], (which, res.by_statistics)
