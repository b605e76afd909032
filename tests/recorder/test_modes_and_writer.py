"""Modes, sampling, compression settings, the bounded writer queue and graceful degradation."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import recorder
from recorder import pipeline as pipeline_mod
from recorder import stats
from recorder.store import layout
from recorder.store import writer as store_writer
from recorder.store.reader import RunReader
from tests.recorder.readback import rng_parts


@recorder.paper_step("Eq. 3", description="scale")
def scale(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
    return x * k


def _payload_flags(rank):
    return [[r.has_payload for r in rank.tensor_records(i)] for i in range(len(rank))]


def test_stats_mode_keeps_no_payloads(run_path):
    """mode='stats' keeps statistics of every tensor and no bytes."""
    with recorder.record(run_path, mode="stats"):
        for _ in range(3):
            scale(torch.randn(100))
    rank = RunReader(run_path).rank(0)
    assert len(rank) == 3 and rank.lengths["payloads"] == 0
    rec = rank.tensor_records(0)[0]
    assert rec.stats["absmax"] > 0 and not rec.has_payload


@pytest.mark.parametrize("mode", ["full", "flight"])
def test_a_cpu_training_under_another_default_device_records_and_replays(run_path, mode):
    """With torch's default device set elsewhere (``torch.set_default_device``; here "meta", a
    device any machine has), a model and data placed on the CPU are recorded with every payload,
    large ones too (the recorder's buffers are its own, on the CPU), and replay bit for bit."""
    import replayer

    torch.manual_seed(0)
    with torch.device("meta"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = torch.nn.Sequential(torch.nn.Linear(256, 256, device="cpu"), torch.nn.Tanh())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(64, 256, device="cpu")
        with recorder.record(run_path, model=model, optimizer=opt, mode=mode, modules=["*"]) as run:
            for _ in range(3):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    assert run.status == "complete" and run.failure is None and [str(w.message) for w in caught] == []
    rec = replayer.open(run_path)
    last = [s for s in rec.steps if s.iteration == 2]
    assert last and all(r.has_payload for s in last for r in s.records)
    assert all(replayer.replay(rec, s).match for s in last)


def test_every_k_iterations_keeps_payloads(run_path):
    """every=2: payloads on iterations 0, 2, 4; statistics on all."""
    with recorder.record(run_path, every=2) as run:
        for _ in range(5):
            scale(torch.randn(10))
            run.next_iteration()
    rank = RunReader(run_path).rank(0)
    assert list(rank.column("steps/iteration")) == [0, 1, 2, 3, 4]
    assert [all(f) for f in _payload_flags(rank)] == [True, False, True, False, True]
    assert np.isfinite(rank.tensor_records(1)[0].stats["mean"])


@pytest.mark.parametrize("compressor", [None, "zstd", "none", {"cname": "zstd", "clevel": 3, "shuffle": "shuffle"}])
def test_compressors_round_trip(run_path, compressor):
    """Every compression setting reads back the same bytes."""
    x = torch.randn(1000)
    with recorder.record(run_path, compressor=compressor):
        scale(x)
    reader = RunReader(run_path)
    rank = reader.rank(0)
    assert torch.equal(rank.tensor(rank.tensor_records(0)[0]), x)
    if compressor == "none":  # as docs/FORMAT.md says: no Blosc, so no level or shuffle named
        assert reader.attrs["compression"] == {"cname": None}
        blobs = zarr.open_group(str(run_path), mode="r")["rank0/blobs"]
        for name in blobs.array_keys():
            assert [c.to_dict()["name"] for c in blobs[name].metadata.codecs] == ["bytes"]


def test_bad_compressor_is_refused(run_path):
    """An unknown compressor gets a one-line error naming the choices."""
    with pytest.raises(recorder.RecordingError, match="unknown compressor 'brotli'"):
        recorder.record(run_path, compressor="brotli")


def test_readable_with_plain_zarr(run_path):
    """A finished run reads with zarr alone: steps, documents and payload bytes, as docs/FORMAT.md says."""
    x = torch.arange(12, dtype=torch.float32)
    with recorder.record(run_path):
        scale(x, k=3.0)
    manifest = json.loads((run_path / "manifest.json").read_text())
    lengths = manifest["ranks"]["0"]
    g = zarr.open_group(run_path, mode="r")
    assert g.attrs["paperdebugger"]["schema_version"] == layout.SCHEMA_VERSION
    r0 = g["rank0"]
    assert r0["steps/iteration"].shape == (lengths["steps"],)
    name_doc = int(r0["steps/name"][0])
    off, n = int(r0["docs/offset"][name_doc]), int(r0["docs/length"][name_doc])
    assert json.loads(r0["docs/bytes"][off:off + n].tobytes()) == "scale"
    start = int(r0["steps/tensor_start"][0])
    pid = int(r0["tensors/payload"][start])
    assert r0["payloads/blob"][pid] == 2  # u4
    off, count = int(r0["payloads/offset"][pid]), int(r0["payloads/count"][pid])
    assert np.array_equal(r0["blobs/u4"][off:off + count].view(np.float32), x.numpy())


def test_memory_store_backend():
    """Recording into a zarr MemoryStore works like a directory (the storage interface for tests)."""
    store = zarr.storage.MemoryStore()
    with recorder.record(store):
        scale(torch.ones(4))
    reader = RunReader(store)
    assert reader.status == "complete" and len(reader.rank(0)) == 1


def test_queue_memory_is_bounded(run_path):
    """With a small queue bound, queued bytes never exceed it by more than one item (backpressure)."""
    with recorder.record(run_path, max_queue_bytes=1 << 20) as run:
        for _ in range(40):
            scale(torch.randn(128 * 1024))  # 512 KiB in, 512 KiB out per call
    assert run.pipeline.peak_queue_bytes <= (1 << 20) + (512 << 10) + 1
    assert len(RunReader(run_path).rank(0)) == 40


def test_writer_is_woken_in_batches_and_by_a_flush(run_path, monkeypatch):
    """Small steps queue up without waking the writer (a wake-up per item doubled a small step's
    cost); a flush wakes it and commits all of them."""
    monkeypatch.setattr(pipeline_mod, "WAKE_S", 3600.0)
    with recorder.record(run_path, mode="stats", flush_interval=3600) as run:
        assert run.flush()  # the store made, the writer idle and waiting
        for i in range(10):  # 10 step records, fewer than WAKE_ITEMS
            scale(torch.full((4,), float(i)))
        assert len(run.pipeline._queue) == 10  # nothing woke the writer
        assert run.flush()
        assert not run.pipeline._queue
        assert len(RunReader(run_path).rank(0)) == 10
        for i in range(pipeline_mod.WAKE_ITEMS + 5):  # a batch: the writer is woken without a flush
            scale(torch.full((4,), float(i)))
        with run.pipeline._cond:  # the writer notifies it after every item it finishes
            run.pipeline._cond.wait_for(lambda: len(run.pipeline._queue) < pipeline_mod.WAKE_ITEMS, timeout=60)
        assert len(run.pipeline._queue) < pipeline_mod.WAKE_ITEMS


def test_training_waiting_for_room_wakes_the_writer(run_path, monkeypatch):
    """With the writer idle until a batch of items fills (no idle wake-up, no byte threshold here),
    training that needs room in a small queue wakes it instead of waiting: 30 payload steps finish."""
    monkeypatch.setattr(pipeline_mod, "WAKE_S", 3600.0)
    monkeypatch.setattr(pipeline_mod, "WAKE_SHARE", 0)
    done = threading.Event()

    def train() -> None:
        with recorder.record(run_path, max_queue_bytes=1 << 20, when_slow="wait", flush_interval=3600):
            for _ in range(30):
                scale(torch.randn(64 * 1024))  # 256 KiB in, 256 KiB out per call
        done.set()

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    assert done.wait(60), "training waited for a writer that was never woken"
    assert len(RunReader(run_path).rank(0)) == 30


def test_writer_failure_degrades_without_stopping_training(run_path, monkeypatch):
    """A failing writer is reported once as a RecorderWarning; the user's calls keep working."""
    def broken(self, key, data):
        raise OSError("disk full")

    monkeypatch.setattr(store_writer.StoreWriter, "payload", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.record(run_path, flush_interval=0.01) as run:
            results = [scale(torch.full((4,), float(i))) for i in range(50)]
    assert [r[0].item() for r in results] == [2.0 * i for i in range(50)]
    ours = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
    assert len(ours) == 1 and "disk full" in str(ours[0].message)
    assert run.status == "incomplete"  # recording stopped early; the process did not die
    assert RunReader(run_path).status == "incomplete"


def test_a_failed_writer_reads_incomplete_once_close_returns(run_path, monkeypatch):
    """A writer that failed on its own publishes "incomplete" on its thread; close() waits for it
    (here a slow store: the publishing takes 0.3 s), so the run reads as closed right after."""
    real_abandon = store_writer.StoreWriter.abandon

    def slow_abandon(self, info):
        time.sleep(0.3)  # the fault injected: a store slow to take the last two writes
        real_abandon(self, info)

    def broken(self, key, data):
        raise OSError("disk full")

    monkeypatch.setattr(store_writer.StoreWriter, "abandon", slow_abandon)
    monkeypatch.setattr(store_writer.StoreWriter, "payload", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", recorder.RecorderWarning)
        with recorder.record(run_path, flush_interval=0.01) as run:
            for i in range(50):
                scale(torch.full((4,), float(i)))
    assert run.status == "incomplete"
    reader = RunReader(run_path)
    assert reader.status == "incomplete"
    assert "disk full" in reader.rank(0).final["writer_error"]


def test_capture_failure_degrades(run_path, monkeypatch):
    """An internal error while capturing a tensor warns once, the call still returns its result, and
    the tensor's record says why it holds no statistics: recording goes on (it stopped, the run
    incomplete, before one odd tensor could no longer end a recording)."""
    monkeypatch.setattr(stats, "host_stats", lambda t: 1 / 0)  # statistics alone
    monkeypatch.setattr(stats, "copy_stats", lambda t, dst, src: 1 / 0)  # statistics taken with a copy
    with pytest.warns(recorder.RecorderWarning, match="ZeroDivisionError") as caught:
        with recorder.record(run_path) as run:
            out = [scale(torch.ones(2)) for _ in range(3)]
    assert all(torch.equal(o, torch.full((2,), 2.0)) for o in out)
    assert run.failure is None and run.status == "complete"
    assert len([w for w in caught if "could not capture" in str(w.message)]) == 1
    reader = RunReader(run_path).rank(0)
    assert reader.lengths["steps"] == 3
    assert all(reader.why_statistics_only(r).startswith("Tensor that could not be captured (ZeroDivisionError")
               for step in range(3) for r in reader.tensor_records(step))


def test_host_and_device_statistics_agree():
    """The no-sync device path computes the same statistics as the host path, NaN/Inf included."""
    x = torch.randn(1000, dtype=torch.float64)
    x[3], x[10], x[11] = float("nan"), float("inf"), -float("inf")
    for t in (x, x.float(), x.half(), torch.randn(5, 5).bfloat16(), torch.arange(10), torch.tensor([True, False]),
              torch.tensor([7.0]), torch.empty(0), torch.full((4,), float("nan"))):
        host = stats.host_stats(t)
        dev = stats.device_stats(t).tolist()
        for a, b in zip(host, dev):
            assert (np.isnan(a) and np.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-9)
    h = stats.host_stats(x)
    finite = x[torch.isfinite(x)]
    assert h[6:] == (1.0, 2.0)
    assert h[0] == finite.min().item() and h[1] == finite.max().item()


def test_small_tensor_statistics_through_numpy_agree_and_never_warn():
    """Small float tensors are summarised through numpy: the same statistics as torch's path, for
    strided, non-finite and overflowing values, and no numpy warning reaches the user's process."""
    big = np.finfo(np.float32).max / 2
    cases = [torch.randn(64), torch.randn(8, 6).t(), torch.randn(300, dtype=torch.float64) + 1e6,
             torch.tensor([1.5]), torch.tensor([float("nan"), 2.0, -float("inf"), 3.0]),
             torch.full((16,), big), torch.tensor([big, -big, float("nan")]),
             torch.full((8,), 1e300, dtype=torch.float64), torch.full((3,), float("inf"))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in cases:
            assert t.numel() <= stats.SMALL
            small = stats.host_stats(t)
            large = stats._stats(stats._working(t).reshape(-1), torch)  # the path of tensors above SMALL
            for a, b in zip(small, large, strict=True):
                assert (np.isnan(a) and np.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-9), t


def test_importing_recorder_is_cheap():
    """`import recorder` loads neither zarr nor textual nor numba (nor the replayer)."""
    code = ("import sys, recorder;"
            "bad = [m for m in ('zarr', 'textual', 'numba', 'replayer', 'tui') if m in sys.modules];"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_accelerator_path_round_trips(run_path, monkeypatch):
    """The asynchronous path used for accelerator tensors (device statistics, staged copies hashed by
    the writer) stores the same bytes and statistics; exercised here with CPU tensors."""
    from recorder import capture

    monkeypatch.setattr(capture.Session, "_cpu_payload",
                        lambda self, t, by_content, owner=0: (capture.Session._device_payload(self, t), None))
    monkeypatch.setattr(stats, "host_stats", stats.device_stats)
    x = torch.randn(3, 5)
    with recorder.record(run_path) as run:
        scale(x)
        scale(x.t())  # non-contiguous
        scale(x)  # same content again: deduplicated by the writer
    assert run.failure is None
    rank = RunReader(run_path).rank(0)
    inputs = [rank.tensor_records(i)[0] for i in range(3)]
    assert torch.equal(rank.tensor(inputs[0]), x) and torch.equal(rank.tensor(inputs[1]), x.t().contiguous())
    assert inputs[0].payload == inputs[2].payload != inputs[1].payload
    assert inputs[0].stats["max"] == x.max().item()


def _frames(run_path) -> list[bool]:
    """Per payload chunk file of float32 payloads: whether it is an uncompressed Blosc frame."""
    chunks = sorted((run_path / "rank0" / "blobs" / "u4" / "c").iterdir(), key=lambda p: int(p.name))
    return [bool(p.read_bytes()[2] & 0x02) for p in chunks]  # flags byte: bit 1 set = stored as is


def test_adaptive_compression_stores_what_does_not_shrink(run_path, tmp_path):
    """Float noise hardly shrinks: after the first whole chunk it is stored as it is (a retest every
    16 chunks); zeros shrink: always compressed. Both read back bitwise, also through plain zarr."""
    gen = torch.Generator().manual_seed(0)
    noise = [torch.randn(1 << 20, generator=gen) for _ in range(24)]  # 4 MiB each, one chunk
    with recorder.record(run_path, mode="full") as run:
        for x in noise:
            scale(x, 1.0)
            run.next_iteration()
    stored = _frames(run_path)
    assert stored[0] is False and sum(stored) >= len(stored) - 4, stored  # compressed: the first and retests
    reader = RunReader(run_path).rank(0)
    for i, x in enumerate(noise):
        record = next(r for r in reader.tensor_records(i) if r.role == "input")
        assert torch.equal(reader.tensor(record).view(torch.int32), x.view(torch.int32))
    plain = zarr.open_group(str(run_path), mode="r")["rank0/blobs/u4"]
    assert np.array_equal(plain[: 1 << 20].view(np.float32), noise[0].numpy())

    zeros_path = tmp_path / "zeros.zarr"
    with recorder.record(zeros_path, mode="full") as run:
        for i in range(8):
            scale(torch.full((1 << 20,), float(i)), 1.0)
            run.next_iteration()
    assert not any(_frames(zeros_path))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "no-exchange"])
def test_rewritten_keys_read_back_after_every_write(tmp_path, monkeypatch, exchange):
    """A key written again and again (an array's partial last chunk) reads back as its latest bytes
    after every write, longer or shorter than before; a write without ``spare``, or ``drop_spare``,
    leaves no temporary file. Where the filesystem cannot swap two names, the same holds."""
    from recorder.store import backend
    if not exchange:
        monkeypatch.setattr(backend, "_exchange", None)
    store = backend.open_store(tmp_path / "s.zarr", mode="w")
    key = "rank0/steps/phase/c/0"
    for size in (10, 3000, 200, 4000, 1):
        data = np.random.default_rng(size).bytes(size)
        backend.put(store, key, data, spare=True)
        assert backend.get(store, key) == data
    spare = tmp_path / "s.zarr" / f"{key}.partial"
    assert spare.exists() == (exchange and backend._exchange is not None)
    backend.put(store, key, b"final")
    assert backend.get(store, key) == b"final" and not spare.exists()
    backend.put(store, key, b"again", spare=True)
    backend.put(store, key, b"again and again", spare=True)
    backend.drop_spare(store, key)
    assert backend.get(store, key) == b"again and again" and not spare.exists()


def test_many_commits_read_back_and_close_leaves_no_temporary_files(run_path):
    """Each commit rewrites the partial last chunk of every table; every commit reads back with
    exactly its steps, and a closed run leaves no temporary file behind."""
    with recorder.record(run_path, mode="stats") as run:
        for i in range(6):
            for _ in range(3):
                scale(torch.full((5,), float(i)))
            assert run.flush()
            rank = RunReader(run_path).rank(0)
            assert len(rank) == 3 * (i + 1)
            assert [rank.tensor_records(s)[0].stats["max"] for s in range(len(rank))] == \
                [float(j // 3) for j in range(3 * (i + 1))]
    assert not list(run_path.rglob("*.partial"))
    assert len(RunReader(run_path).rank(0)) == 18


def test_device_statistics_are_checked_for_nonfinite_once_per_iteration(run_path, monkeypatch):
    """With statistics kept on an accelerator (exercised with CPU tensors), notify_nonfinite does not
    bring each step's statistics to the host as it ends: the steps of an iteration are looked at
    when it ends (one host sync per iteration), and the first NaN is still reported once, with its
    index, by then."""
    monkeypatch.setattr(stats, "host_stats", stats.device_stats)
    told: list[tuple[int, str]] = []
    with recorder.record(run_path, mode="stats") as run:
        run.notify_nonfinite(lambda index, message: told.append((index, message)))
        scale(torch.ones(3))
        run.next_iteration()
        scale(torch.ones(3))
        scale(torch.tensor([1.0, float("nan"), 2.0]))  # step 2
        scale(torch.tensor([float("nan")]))  # step 3: a NaN again, not reported
        assert told == []  # nothing synchronised yet
        run.next_iteration()
        assert [index for index, _ in told] == [2]
        assert "output has 1 NaN" in told[0][1] and "iteration 1" in told[0][1]
        scale(torch.tensor([float("inf")]))
    assert len(told) == 1
    statuses = [layout.STATUSES[int(s)] for s in RunReader(run_path).rank(0).column("steps/status")]
    assert statuses == ["ok", "ok", "nonfinite", "nonfinite", "nonfinite"]


@recorder.paper_step("Eq. 4", description="noisy scale")
def noisy(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rand(x.shape)  # draws random numbers: every step starts from a new RNG state


def _blosc_codec(chunk: bytes) -> int:
    return chunk[2] >> 5  # Blosc header, flags byte: bits 5-7 name the codec (1 lz4, 4 zstd)


def test_documents_are_zstd_once_whole_or_closed_and_lz4_while_rewritten(run_path):
    """RNG states (base64 in JSON documents, one per step here) make most of a stats-mode store.
    Closed, its document chunks are zstd, which halves them; while the run goes on, the partial
    chunk each commit rewrites is lz4 (fast), and reads back. Both are Blosc frames plain zarr reads."""
    chunk = run_path / "rank0" / "docs" / "bytes" / "c" / "0"
    torch.manual_seed(0)
    with recorder.record(run_path, mode="stats") as run:
        for _ in range(40):
            noisy(torch.ones(4))
        assert run.flush()
        assert _blosc_codec(chunk.read_bytes()) == 1
        live = RunReader(run_path).rank(0)
        states = [rng_parts(live, i)["torch"] for i in (0, 39)]  # read mid-run, from the lz4 chunk
        assert not torch.equal(states[0], states[1])
    assert _blosc_codec(chunk.read_bytes()) == 4
    rank = RunReader(run_path).rank(0)
    assert torch.equal(rng_parts(rank, 39)["torch"], states[1])
    raw = int(zarr.open_group(str(run_path), mode="r")["rank0/docs/bytes"].shape[0])
    on_disk = sum(p.stat().st_size for p in (run_path / "rank0" / "docs").rglob("c/*"))
    assert on_disk * 1.8 < raw, (raw, on_disk)


def test_commit_waits_for_payload_chunks_written_in_background(run_path, monkeypatch):
    """Whole payload chunks are written on threads of their own; no manifest is written while one
    is on its way (a commit waits for them), and a failed chunk write stops the recording like any
    other failed write."""
    from recorder.store import backend

    gate, blocked, settling = threading.Event(), threading.Event(), threading.Event()
    in_flight, at_manifest = [0], []
    real_put, real_settle = backend.put, store_writer.StoreWriter._settle

    def held_put(store, key, data, **kwargs):
        if key.endswith("manifest.json"):
            at_manifest.append(in_flight[0])
        if "/blobs/" not in key or "/c/" not in key:
            return real_put(store, key, data, **kwargs)
        in_flight[0] += 1
        blocked.set()
        assert gate.wait(timeout=60), "the test never opened the gate"
        try:
            return real_put(store, key, data, **kwargs)
        finally:
            in_flight[0] -= 1

    def settle(self):
        settling.set()
        real_settle(self)

    monkeypatch.setattr(backend, "put", held_put)
    monkeypatch.setattr(store_writer.StoreWriter, "_settle", settle)
    x = torch.randn(1 << 20)  # 4 MiB: one whole chunk per copy (fewer than PUTS_IN_FLIGHT in all)
    run = recorder.record(run_path, mode="full", flush_interval=3600)
    scale(x)
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(run.flush()))
    flusher.start()
    assert blocked.wait(timeout=60) and settling.wait(timeout=60)  # the commit waits, a chunk held
    manifest = json.loads((Path(run_path) / layout.manifest_key(0)).read_text())
    assert manifest["ranks"]["0"]["payloads"] == 0
    gate.set()
    flusher.join(timeout=60)
    assert flushed == [True]
    assert at_manifest and set(at_manifest) == {0}  # every manifest written with no chunk on its way
    rank = RunReader(run_path).rank(0)
    assert rank.lengths["payloads"] == 2  # input and output
    got = [rank.tensor(r) for r in rank.tensor_records(0)]
    assert torch.equal(got[0].view(torch.int32), x.view(torch.int32))
    assert torch.equal(got[1].view(torch.int32), (x * 2.0).view(torch.int32))
    run.close()

    def failing_put(store, key, data, **kwargs):
        if "/blobs/" in key and "/c/" in key:
            raise OSError(28, "No space left on device")
        return real_put(store, key, data, **kwargs)

    monkeypatch.setattr(backend, "put", failing_put)
    other = str(Path(run_path).with_name("other.zarr"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.record(other, mode="full") as run2:
            assert torch.equal(scale(x), x * 2.0)  # training goes on
    ours = [w for w in caught if issubclass(w.category, recorder.RecorderWarning)]
    assert len(ours) == 1 and "full" in str(ours[0].message)
    assert run2.status == "incomplete" and RunReader(other).status == "incomplete"


@pytest.mark.parametrize("mode", ["full", "flight"])
def test_activations_are_hashed_by_the_writer_and_stored_once(run_path, mode, monkeypatch):
    """Parameters are addressed by content when captured; activations and gradients are copied under
    a token and hashed by the writer thread when it writes them. The activations and gradients
    read back bitwise, and bytes that two records hold (one step's output and the next step's input, the
    gradient between them) are stored once."""
    first = recorder.annotate(torch.nn.Linear(64, 64), "Eq. 1", name="first")
    second = recorder.annotate(torch.nn.Linear(64, 64), "Eq. 2", name="second")
    model = torch.nn.Sequential(first, second)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    training_thread = threading.get_ident()
    hashed_here: list[int] = []
    content_key = pipeline_mod.payload_mod.content_key

    def counting(units, unit):
        if threading.get_ident() == training_thread:
            hashed_here.append(units.nbytes)
        return content_key(units, unit)

    monkeypatch.setattr(pipeline_mod.payload_mod, "content_key", counting)
    xs, middles, grads = [torch.randn(8, 64) for _ in range(2)], [], []
    with recorder.record(run_path, model=model, optimizer=opt, mode=mode):
        for x in xs:
            middle = first(x)
            middle.retain_grad()
            second(middle).square().sum().backward()
            middles.append(middle.detach().clone())
            grads.append(middle.grad.clone())
            opt.step()
            opt.zero_grad()
    # Two parameters per module, two modules, two iterations: the only bytes hashed while training.
    assert sorted(hashed_here) == [64 * 4] * 4 + [64 * 64 * 4] * 4
    rank = RunReader(str(run_path)).rank(0)
    column = {n: rank.column(f"steps/{n}") for n in ("name", "phase", "iteration")}
    steps = {(rank.doc(int(column["name"][i])), int(column["phase"][i]), int(column["iteration"][i])): i
             for i in range(len(rank))}
    assert len(steps) == len(rank) == 8
    for it, (x, middle, grad) in enumerate(zip(xs, middles, grads)):
        fwd1, fwd2, bwd1, bwd2 = ({r.role: r for r in rank.tensor_records(steps[key])} for key in (
            ("first", 0, it), ("second", 0, it), ("first", 1, it), ("second", 1, it)))
        assert torch.equal(rank.tensor(fwd1["input"]), x)
        assert torch.equal(rank.tensor(fwd2["input"]), middle)
        assert fwd1["output"].payload == fwd2["input"].payload  # the same bytes, stored once
        assert torch.equal(rank.tensor(bwd1["grad_output"]), grad)
        assert bwd2["grad_input"].payload == bwd1["grad_output"].payload


def test_two_processes_claiming_one_path_at_once_one_is_refused(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes starting to record to one new path at the same moment both find it free: the
    claim of the store's root is one exclusive step, so the second is refused in one line and the
    first's recording is left as it was."""
    from recorder.errors import RecordingError
    from recorder.store import backend, codecs

    path = tmp_path / "run.zarr"
    with recorder.record(path, mode="full"):
        root = (path / "zarr.json").read_bytes()
        monkeypatch.setattr(backend, "get", lambda store, key: None)  # its check ran before the claim
        with pytest.raises(RecordingError) as info:
            store_writer.StoreWriter(backend.open_store(path, mode="w"), run_attrs={},
                                     compression=codecs.parse(None))
        assert str(info.value) == ("the store already holds a zarr hierarchy (another process began recording "
                                   "there just now); record into a new, empty one")
        assert (path / "zarr.json").read_bytes() == root and not list(path.glob("*.claim"))
        monkeypatch.undo()
    assert RunReader(str(path)).status == "complete"
