"""Opening something that is not a good recording gives one line naming the problem."""

from __future__ import annotations

import json

import pytest
import torch

import recorder
from recorder.errors import FormatError, NotARecordingError, PdbgError, RecordingError, SchemaVersionError
from recorder.store import layout
from recorder.store.reader import RunReader
from tests.sealing import write_sealed


@recorder.paper_step("Eq. 1")
def double(x):
    return x * 2


@pytest.fixture
def good_run(run_path):
    with recorder.record(run_path):
        double(torch.ones(3))
    return run_path


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and text
    return text


def test_missing_path(tmp_path):
    """A path that does not exist is named, with what to give instead."""
    with pytest.raises(NotARecordingError) as err:
        RunReader(tmp_path / "nope.zarr")
    assert "no such file or directory" in _one_line(err.value)
    assert isinstance(err.value, FileNotFoundError)


def test_directory_that_is_not_a_recording(tmp_path):
    """An ordinary directory, or a plain zarr group, is not taken for a recording."""
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotARecordingError) as err:
        RunReader(tmp_path)
    assert "is not a PaperDebugger recording" in _one_line(err.value)
    import zarr

    zarr.open_group(tmp_path / "plain.zarr", mode="w")
    with pytest.raises(NotARecordingError):
        RunReader(tmp_path / "plain.zarr")


def test_file_that_is_not_a_recording(tmp_path):
    """A random file (not a zip) is refused with one line."""
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"\x80\x04junk")
    with pytest.raises(NotARecordingError) as err:
        RunReader(bad)
    _one_line(err.value)


def test_truncated_manifest(good_run):
    """A manifest cut short is reported as truncated or corrupt."""
    manifest = good_run / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    with pytest.raises(FormatError) as err:
        RunReader(good_run)
    assert "manifest.json is truncated or corrupt" in _one_line(err.value)


def test_missing_manifest(good_run):
    """Without a manifest no step is trusted."""
    (good_run / "manifest.json").unlink()
    with pytest.raises(FormatError) as err:
        RunReader(good_run)
    assert "manifest.json is missing" in _one_line(err.value)


def test_newer_schema_version(good_run):
    """A recording from a newer major schema asks the user to upgrade."""
    meta_path = good_run / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["paperdebugger"]["schema_version"] = "2.0"
    write_sealed(meta_path, meta)
    with pytest.raises(SchemaVersionError) as err:
        RunReader(good_run)
    text = _one_line(err.value)
    assert "schema 2.0" in text and "upgrade paperdebugger" in text


def test_newer_minor_version_opens(good_run, tmp_path):
    """A newer minor version of the same major schema still opens, with one warning that it is newer
    (it opened silently, though a newer minor can change verdicts: FORMAT.md's schema history)."""
    from tests.cli import pdbg

    meta_path = good_run / "zarr.json"
    meta = json.loads(meta_path.read_text())
    major, minor = layout.SCHEMA_VERSION.split(".")
    newer = f"{major}.{int(minor) + 1}"
    meta["attributes"]["paperdebugger"]["schema_version"] = newer
    write_sealed(meta_path, meta)
    said = (f"was written by a newer PaperDebugger (schema {newer}; this one reads {layout.SCHEMA_VERSION}): what "
            "the newer schema added is not read, and an answer may differ from the newer version's; upgrade "
            "paperdebugger")
    with pytest.warns(recorder.RecorderWarning) as caught:
        assert len(RunReader(good_run).rank(0)) == 1
    assert [str(w.message) for w in caught] == [f"{good_run} {said}"]
    res = pdbg("info", str(good_run), cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == f"pdbg: warning: {good_run} {said}\n", res.stderr


def test_manifest_pointing_past_the_data(good_run):
    """A manifest that claims more rows than exist is reported as damage, not read as zeros."""
    manifest_path = good_run / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["ranks"]["0"]["steps"] = 10
    write_sealed(manifest_path, manifest)
    with pytest.raises(FormatError) as err:
        RunReader(good_run).rank(0).column("steps/name")
    assert "damaged" in _one_line(err.value)


def test_a_copy_made_while_recording_with_its_manifest_copied_last(tmp_path):
    """A store copied while its run was being written, the data first and manifest.json last (as a
    slow `cp -r` or a sync may copy it): the manifest commits rows that the copied chunks did not hold
    yet. They read as zeros: phantom steps named like step 0's, and verify raised AttributeError."""
    import shutil

    import replayer

    path, copy = tmp_path / "run.zarr", tmp_path / "copy.zarr"
    with recorder.record(path) as run:
        for i in range(3):
            double(torch.full((3,), float(i)))
        assert run.flush()
        shutil.copytree(path, copy)  # the data, at 3 steps
        for i in range(5):
            double(torch.full((3,), float(i)))
        assert run.flush()
        shutil.copy(path / "manifest.json", copy / "manifest.json")  # the manifest, at 8
    assert len(replayer.open(path).steps) == 8
    with pytest.raises(FormatError) as err:
        rec = replayer.open(copy)
        [step.name for step in rec.steps]
    assert _one_line(err.value).endswith(
        "step 3 is not a step the recorder wrote (its rows read as zeros); the recording was copied while it was "
        "being written (its manifest after the data), or is damaged: copy it again, or copy manifest.json first")


class TestRecordMisuse:
    def test_unknown_mode(self, run_path):
        """An unknown mode is refused before anything is written."""
        with pytest.raises(RecordingError, match="unknown mode 'fast'"):
            recorder.record(run_path, mode="fast")
        assert not run_path.exists()

    def test_a_misspelt_option(self, run_path):
        """A misspelt option is named, with the one meant, before anything is written (it was Python's
        "Run.__init__() got an unexpected keyword argument")."""
        with pytest.raises(RecordingError, match=r"^record\(\) has no option 'flush_intervall' \(did you mean "
                                                 r"'flush_interval'\?\)$"):
            recorder.record(run_path, flush_intervall=1.0)
        with pytest.raises(RecordingError, match="has no option 'zzz'; its options are flush_interval, keep, "):
            recorder.record(run_path, zzz=1)
        assert not run_path.exists()

    def test_nested_recordings(self, run_path, tmp_path):
        """A second recording while one is active is refused; the first keeps working."""
        with recorder.record(run_path) as run:
            with pytest.raises(RecordingError, match="already active"):
                recorder.record(tmp_path / "other.zarr")
            double(torch.ones(2))
        assert run.status == "complete" and len(RunReader(run_path).rank(0)) == 1

    def test_existing_non_empty_directory(self, good_run):
        """An existing recording is never overwritten; the refusal says what a requeued job does instead
        (deleting the path would lose the segment recorded before the preemption)."""
        with pytest.raises(RecordingError, match="already exists and is not empty; choose a new path \\(a job resumed "
                                                 "from a checkpoint: one per attempt"):
            recorder.record(good_run)
        assert len(RunReader(good_run).rank(0)) == 1

    def test_errors_share_a_base(self):
        """Every error the user can see derives from PdbgError (the CLI maps it to exit code 2)."""
        for cls in (NotARecordingError, FormatError, SchemaVersionError, RecordingError):
            assert issubclass(cls, PdbgError) and cls.exit_code == 2


def test_reused_pid_is_not_taken_for_a_live_writer(good_run):
    """A 'recording' manifest whose pid now belongs to another process reads as crashed."""
    import os

    manifest_path = good_run / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["status"] = "recording"
    manifest["writer"]["pid"] = os.getpid()  # alive, but started at another time than the writer
    manifest["writer"]["start"] = manifest["writer"]["start"] - 1
    write_sealed(manifest_path, manifest)
    assert RunReader(good_run).status == "crashed"
    manifest["writer"]["start"] += 1
    write_sealed(manifest_path, manifest)
    assert RunReader(good_run).status == "recording"


def test_a_one_step_recording_reads_as_one_step(good_run):
    """Its repr said "1 steps"."""
    import replayer

    rec = replayer.open(good_run)
    assert repr(rec) == f"<Recording {good_run}: 1 step, complete>" and repr(rec.steps) == "<StepTable: 1 step>"
