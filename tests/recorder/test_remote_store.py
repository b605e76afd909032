"""Remote stores: a run recorded to ``s3://`` and read back through zarr's fsspec store, against a
local S3-compatible server (moto's server mode on 127.0.0.1, started and stopped here). The remote
recording must read exactly like the same run recorded to a directory; a store that cannot be used
(no bucket, wrong credentials, no server, s3fs missing) is one PaperDebugger error line; a store that
goes away mid-run warns once, training goes on, and closing returns in bounded time."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import recorder
import replayer
from recorder.capture import RecorderWarning
from recorder.errors import NotARecordingError, RecordingError
from recorder.store import backend, layout
from recorder.store.reader import RunReader
from tests.models import Tiny

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed: pip install -e '.[test]'")
pytest.importorskip("s3fs", reason="s3fs is not installed: pip install -e '.[test]'")
boto3 = pytest.importorskip("boto3", reason="boto3 (with moto) is not installed: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "pdbg-test"
KEY, SECRET, REGION = "testing-key", "testing-secret", "us-east-1"


def train(target: Any, iterations: int = 3, **options: Any) -> recorder.Run:
    """The same tiny run wherever it is recorded (same seed, same data)."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(target, model=model, optimizer=opt, mode="full", **options) as run:
        for i in range(iterations):
            model(torch.arange(6).reshape(2, 3) + i).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """A moto S3 server on 127.0.0.1 with ``bucket`` created. Servers of one process share moto's
    in-memory state: a bucket and its objects outlive the server that made them."""

    def __init__(self, bucket: str | None = BUCKET) -> None:
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.running = True
        if bucket is not None:
            client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY,
                                  aws_secret_access_key=SECRET, region_name=REGION)
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=bucket)

    def stop(self) -> None:
        if self.running:
            self.running = False
            self._server.stop()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION},
            **extra}


@pytest.fixture(scope="module", autouse=True)
def _no_ambient_aws() -> Iterator[None]:
    """Credentials, endpoints and options come from each test, never from this machine's AWS setup.
    (And the server's request log stays out of the test output.)"""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logging.getLogger("werkzeug"), "level", logging.WARNING)
        for name in list(os.environ):
            if name.startswith("AWS_") or name.startswith("FSSPEC_S3") or name == backend.STORAGE_OPTIONS_ENV:
                mp.delenv(name)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        yield


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with S3Server() as server:
        yield server.endpoint


@pytest.fixture(scope="module")
def runs(endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The same run recorded to a directory and to s3://."""
    local = tmp_path_factory.mktemp("remote") / "run.zarr"
    url = f"s3://{BUCKET}/runs/run.zarr"
    for target, extra in ((local, {}), (url, {"storage_options": options(endpoint)})):
        run = train(target, **extra)
        assert run.status == "complete" and run.failure is None
    return local, url


def read_all(rec: replayer.Recording) -> dict[str, Any]:
    """What a user reads: every step column but the times, every document but the run's own, every
    tensor record with its statistics and payload bytes."""
    rank = rec.rank
    data: dict[str, Any] = {c: rank.column(f"steps/{c}").tobytes() for c in layout.STEP_COLUMNS
                            if c not in ("t_start", "t_end")}
    data["docs"] = [json.dumps(rank.doc(i), sort_keys=True) for i in range(rank.lengths["docs"])]
    records = []
    for step in range(len(rank)):
        for r in rank.tensor_records(step):
            value = rank.tensor(r).reshape(-1).view(torch.uint8).numpy().tobytes() if r.has_payload else None
            records.append((r.step, r.role, r.name, r.dtype, r.shape, r.stride, r.stats, value))
    data["records"] = records
    data["lengths"] = {k: v for k, v in rank.lengths.items()}
    return data


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text, text
    return text


# -- round trip ----------------------------------------------------------------------------------
def test_remote_recording_reads_like_the_local_one(runs: tuple[Path, str], endpoint: str) -> None:
    local, url = runs
    a, b = replayer.open(local), replayer.open(url, storage_options=options(endpoint))
    assert b.status == "complete" and len(b) == len(a) == 12
    assert b.reader.label == url and b.reader.schema_version == layout.SCHEMA_VERSION
    assert read_all(b) == read_all(a)
    payloads = sum(r.has_payload for s in range(len(b)) for r in b.rank.tensor_records(s))
    assert payloads > 20
    # The objects in the bucket are the directory's files (no temporary files, nothing else).
    files = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    fs = b.reader.store.fs
    found = backend.sync(fs._find(f"{BUCKET}/runs/run.zarr", detail=True))
    sizes = {key.removeprefix(f"{BUCKET}/runs/run.zarr/"): int(info["size"]) for key, info in found.items()}
    assert set(sizes) == files
    timed = ("zarr.json", layout.MANIFEST_KEY, "rank0/zarr.json", "rank0/steps/t_start/", "rank0/steps/t_end/")  # times
    for name in files:
        if not name.startswith(timed):
            assert sizes[name] == (local / name).stat().st_size, name
    assert b.reader.nbytes() == sum(sizes.values())


def test_replay_of_a_remote_step_matches(runs: tuple[Path, str], endpoint: str) -> None:
    rec = replayer.open(runs[1], storage_options=options(endpoint))
    for which in ("scaled_tanh@iter=1", "Tiny@iter=2:backward"):
        result = replayer.replay(rec, which)
        assert result.match, (which, result)


def test_pdbg_info_on_a_url_reads_aws_environment(runs: tuple[Path, str], endpoint: str) -> None:
    """The command line has no storage flags: s3fs (botocore) reads AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != backend.STORAGE_OPTIONS_ENV}
    env.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_ENDPOINT_URL=endpoint,
               AWS_DEFAULT_REGION=REGION, AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tui.cli", "info", runs[1]], check=False, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{runs[1]}: complete, 12 steps, 3 iterations" in out.stdout
    assert "Traceback" not in out.stderr


def test_pdbg_storage_options_environment(runs: tuple[Path, str], endpoint: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """PDBG_STORAGE_OPTIONS: any fsspec option, for filesystems with no environment of their own."""
    from tui import cli

    monkeypatch.setenv(backend.STORAGE_OPTIONS_ENV, json.dumps(options(endpoint)))
    assert len(replayer.open(runs[1])) == 12
    assert cli.main(["info", "--json", runs[1]]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 12
    assert cli.main(["info", f"s3://{BUCKET}/no/such/run.zarr"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdbg: error: s3://pdbg-test/no/such/run.zarr: no recording there") and err.count("\n") == 1
    monkeypatch.setenv(backend.STORAGE_OPTIONS_ENV, "{not json")
    with pytest.raises(NotARecordingError, match="PDBG_STORAGE_OPTIONS is not valid JSON"):
        replayer.open(runs[1])
    monkeypatch.setenv(backend.STORAGE_OPTIONS_ENV, "[1]")
    with pytest.raises(NotARecordingError, match="must hold a JSON object"):
        replayer.open(runs[1])


def test_pdbg_record_to_a_url(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdbg record -o s3://...` records an unmodified script straight into the bucket."""
    from tui import cli

    monkeypatch.setenv(backend.STORAGE_OPTIONS_ENV, json.dumps(options(endpoint)))
    url = f"s3://{BUCKET}/cli/plain.zarr"
    script = ROOT / "tests" / "scripts" / "plain_train.py"
    assert cli.main(["record", "-o", url, "--modules", "blocks.*", "--", str(script), "3"]) == 0
    rec = replayer.open(url)
    assert rec.status == "complete" and len(rec) > 0
    assert {rec.step(i).module_path for i in range(len(rec))} <= {f"blocks.{k}" for k in range(8)}


# -- errors ----------------------------------------------------------------------------------------
def test_missing_bucket(endpoint: str) -> None:
    url = "s3://no-such-bucket/run.zarr"
    with pytest.raises(RecordingError) as info:
        train(url, iterations=1, storage_options=options(endpoint))
    assert one_line(info.value) == ("s3://no-such-bucket/run.zarr: bucket 'no-such-bucket' does not exist; create "
                                    "it, or give a URL in an existing bucket")
    with pytest.raises(NotARecordingError, match="bucket 'no-such-bucket' does not exist"):
        replayer.open(url, storage_options=options(endpoint))


def test_existing_recording_and_no_recording(runs: tuple[Path, str], endpoint: str) -> None:
    with pytest.raises(RecordingError, match="already holds a zarr hierarchy; record into a new, empty URL"):
        train(runs[1], iterations=1, storage_options=options(endpoint))
    with pytest.raises(NotARecordingError) as info:
        replayer.open(f"s3://{BUCKET}/nothing.zarr", storage_options=options(endpoint))
    assert "no recording there (no zarr.json)" in one_line(info.value)
    assert len(replayer.open(runs[1], storage_options=options(endpoint))) == 12  # the refusal touched nothing


def test_wrong_credentials(runs: tuple[Path, str], endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """moto checks credentials once its "no authentication" allowance is spent: only keys of its
    IAM users are valid then, and ours is none."""
    from moto import settings
    from moto.core.responses import ActionAuthenticatorMixin

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    bad = options(endpoint, key="not-a-key", secret="not-a-secret")
    with pytest.raises(RecordingError) as info:
        train(f"s3://{BUCKET}/denied.zarr", iterations=1, storage_options=bad)
    assert "access denied" in one_line(info.value) and "AWS_ACCESS_KEY_ID" in str(info.value)
    assert str(info.value).startswith(f"s3://{BUCKET}/denied.zarr: ")
    with pytest.raises(NotARecordingError, match="access denied"):
        replayer.open(runs[1], storage_options=bad)


def test_unreachable_endpoint() -> None:
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RecordingError) as info:
        train("s3://bucket/run.zarr", iterations=1, storage_options=options(nobody))
    assert "the store did not answer" in one_line(info.value) and "endpoint" in str(info.value)
    with pytest.raises(NotARecordingError, match="the store did not answer"):
        replayer.open("s3://bucket/run.zarr", storage_options=options(nobody))
    assert time.monotonic() - start < 60


def test_endpoint_that_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that accepts connections and says nothing: every call ends at REMOTE_TIMEOUT_S."""
    monkeypatch.setattr(backend, "REMOTE_TIMEOUT_S", 1.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(RecordingError) as info:
            train("s3://bucket/run.zarr", iterations=1, storage_options=options(url))
        assert time.monotonic() - start < 10
        assert "got no answer in 1 s" in one_line(info.value)
    finally:
        silent.close()


def test_without_s3fs(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = importlib.import_module("fsspec.registry")  # (fsspec.registry is the read-only view)

    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs raises ImportError
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    monkeypatch.delitem(registry._registry, "s3a", raising=False)
    with pytest.raises(RecordingError) as info:
        train("s3://bucket/run.zarr", iterations=1)
    assert one_line(info.value).startswith("s3://bucket/run.zarr: cannot open s3:// URLs: Install s3fs")
    assert "paperdebugger[s3]" in str(info.value)
    with pytest.raises(NotARecordingError, match="Install s3fs"):
        replayer.open("s3://bucket/run.zarr")


def test_storage_options_need_a_url(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="storage_options apply to URLs"):
        train(tmp_path / "run.zarr", iterations=1, storage_options={"anon": True})
    assert not (tmp_path / "run.zarr").exists()


def test_file_url_is_a_local_path(tmp_path: Path) -> None:
    run = train(f"file://{tmp_path / 'run.zarr'}", iterations=1)
    assert run.status == "complete" and (tmp_path / "run.zarr" / layout.MANIFEST_KEY).is_file()
    assert len(replayer.open(f"file://{tmp_path / 'run.zarr'}")) == 4


# -- the store going away mid-run ------------------------------------------------------------------
def test_store_lost_mid_run_warns_once_and_training_goes_on() -> None:
    """Stop the server after the first commit: the writer's next write fails (after s3fs's retries),
    recording stops with one warning, training finishes, close() returns promptly, and what was
    committed before stays readable once the store is back."""
    bucket = "pdbg-midrun"
    url = f"s3://{bucket}/run.zarr"
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with S3Server(bucket) as server, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = recorder.record(url, model=model, optimizer=opt, mode="full", flush_interval=0.05,
                              storage_options=options(server.endpoint))
        for i in range(6):
            loss = model((torch.arange(6).reshape(2, 3) + i) % 10).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            if i == 1:
                assert run.flush()
                committed = run.steps
                server.stop()
            if i >= 2:
                run.flush(timeout=60)  # the writer meets the dead store here, not at close()
        assert run.failure is not None  # already known while training
        start = time.monotonic()
        run.close()
        closing = time.monotonic() - start
        print(f"failure: {run.failure}; close() took {closing:.2f} s")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert closing < 10, closing
    assert run.status in ("crashed", "incomplete")  # "incomplete" where the recorder tells a stopped writer apart
    ours = [w for w in caught if issubclass(w.category, RecorderWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert url in str(ours[0].message)
    with S3Server(bucket=None) as back:  # the same in-memory objects behind a new server
        reader = RunReader(url, storage_options=options(back.endpoint))
        print(f"after the restart: {reader.status}, {len(reader.rank(0))} steps")
        assert reader.status in ("recording", "crashed")  # the final status could not be written
        assert len(reader.rank(0)) == committed == 8  # two iterations of 4 steps
        rec = replayer.open(url, storage_options=options(back.endpoint))
        assert replayer.replay(rec, "scaled_tanh@iter=1").match


def test_close_returns_when_the_store_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store starts swallowing requests (the server replaced by one that accepts connections and
    never answers) before anything was committed: close() is the first to write, meets the hang,
    and still returns after about one REMOTE_TIMEOUT_S, not one per file."""
    monkeypatch.setattr(backend, "REMOTE_TIMEOUT_S", 2.0)
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    server = S3Server("pdbg-hang")
    port = int(server.endpoint.rsplit(":", 1)[1])
    silent = socket.socket()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = recorder.record("s3://pdbg-hang/run.zarr", model=model, optimizer=opt, mode="full",
                                  flush_interval=600, storage_options=options(server.endpoint))
            assert run.pipeline.ready.wait(30)  # the layout is in the store; no step is
            for i in range(2):
                model(torch.arange(6).reshape(2, 3) + i).square().mean().backward()
                opt.step()
                opt.zero_grad()
            server.stop()
            silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            silent.bind(("127.0.0.1", port))
            silent.listen(64)
            start = time.monotonic()
            run.close()
            closing = time.monotonic() - start
        assert closing < 2.0 + 8, closing  # one timeout, then every other write fails at once
        assert run.status in ("crashed", "incomplete") and "got no answer in 2 s" in (run.failure or "")
        assert len([w for w in caught if issubclass(w.category, RecorderWarning)]) == 1
    finally:
        silent.close()
        server.stop()
