"""`pdbg info RUN --check` and ``Recording.check_payloads``: every payload read once and checked against
its checksum, and each corrupted or unreadable one named with the tensor records that hold it, without
replaying anything."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr

import replayer
from recorder.store import codecs, layout
from recorder.store.reader import RankReader
from tests.cli import pdbg_here
from tests.recorder.test_hostile_input import BLOB_CHUNK, record_tiny
from tui.cmd_replay import _size


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("check") / "run.zarr"
    record_tiny(path)
    return path


@pytest.fixture
def run(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the pristine recording, to damage."""
    shutil.copytree(pristine, tmp_path / "run.zarr")
    return tmp_path / "run.zarr"


def holders(path: Path, pid: int) -> list[tuple[int, str, str]]:
    """(step index, step name, record name) of the tensor records holding payload ``pid``, as the reader has them."""
    rec = replayer.open(path)
    rows = np.flatnonzero(rec.rank.payload_column() == pid).tolist()
    return sorted(((r.step, rec.step(r.step).name, r.name) for r in (rec.rank.tensor_record(row) for row in rows)),
                  key=lambda user: user[0])


def users_text(users: list[tuple[int, str, str]]) -> str:
    return ", ".join(f"{record} of step {index} ({name})" for index, name, record in users)


def stored_bytes(path: Path) -> int:
    rank = replayer.open(path).rank
    sizes = np.array([np.dtype(layout.BLOB_DTYPES[u]).itemsize for u in layout.BLOB_UNITS])
    return int((rank.column("payloads/count") * sizes[rank.column("payloads/blob")]).sum())


class TestPdbgInfoCheck:
    def test_an_intact_recording_says_how_much_it_read_and_exits_0(self, pristine: Path, tmp_path: Path) -> None:
        """Every payload is read and found intact: the count and bytes read, exit 0."""
        count = replayer.open(pristine).rank.lengths["payloads"]
        res = pdbg_here("info", str(pristine), "--check", cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.splitlines()[-1] == (f"payloads: {count} read ({_size(stored_bytes(pristine))}), every one "
                                               "intact (its bytes match their checksum)")
        doc = json.loads(pdbg_here("info", str(pristine), "--check", "--json", cwd=tmp_path).stdout)
        assert doc["payload_check"] == {"payloads": count, "bytes": stored_bytes(pristine), "damaged": [],
                                        "damaged_tables": []}

    def test_without_check_no_payload_is_read_and_the_option_is_named(self, pristine: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
        """Plain `pdbg info` stays as fast as it was (it reads no payload) and says that --check would."""
        def refuse(*_: object) -> None:
            raise AssertionError("pdbg info read a payload")

        monkeypatch.setattr(RankReader, "payload_units", refuse)
        monkeypatch.setattr(RankReader, "check_payloads", refuse, raising=False)
        res = pdbg_here("info", str(pristine), cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.splitlines()[-1] == \
            "payloads: not read (--check reads each one and checks it against its checksum)"
        assert "payload_check" not in json.loads(pdbg_here("info", str(pristine), "--json", cwd=tmp_path).stdout)

    def test_a_flipped_value_in_a_payload_chunk_names_its_step_and_record(self, run: Path, tmp_path: Path) -> None:
        """A payload chunk whose bytes decode to another value of one tensor: that payload alone is listed,
        with the steps and records holding it (a module's output is its inner step's too: one payload, read
        once, two records), and the check exits 1."""
        rec = replayer.open(run)
        (record,) = [r for r in rec.step(1).records if r.role == "output" and r.has_payload]
        pid = record.payload
        assert int(rec.rank.column("payloads/blob")[pid]) == layout.BLOB_UNITS.index("u4")
        offset = int(rec.rank.column("payloads/offset")[pid])
        chunk = run / BLOB_CHUNK
        units = np.frombuffer(numcodecs.Blosc().decode(chunk.read_bytes()), dtype=np.uint32).copy()
        units[offset] ^= 1 << 7  # one bit of one value
        chunk.write_bytes(codecs.DEFAULT_PAYLOADS.encode(units))
        users = holders(run, pid)
        assert users == [(0, rec.step(0).name, "output"), (1, rec.step(1).name, "output")]

        res = pdbg_here("info", str(run), "--check", cwd=tmp_path)
        assert res.returncode == 1, res.stdout + res.stderr
        lines = res.stdout.splitlines()
        count = rec.rank.lengths["payloads"]
        assert lines[-2].startswith(f"payloads: {count} read (") and lines[-2].endswith(
            "; 1 corrupted or unreadable (restore the recording from a copy, or record again):")
        count_units = int(rec.rank.column("payloads/count")[pid])
        assert lines[-1] == (f"  payload {pid}, rank0/blobs/u4[{offset}:{offset + count_units}]: payload checksum "
                             f"mismatch; held by {users_text(users)}")
        doc = json.loads(pdbg_here("info", str(run), "--check", "--json", cwd=tmp_path).stdout)
        (damaged,) = doc["payload_check"]["damaged"]
        assert damaged["payload"] == pid and damaged["problem"].endswith("payload checksum mismatch")
        assert damaged["used_by"] == [{"step": i, "name": name, "record": r} for i, name, r in users]

    def test_a_flipped_byte_in_a_compressed_payload_chunk_is_found(self, run: Path, tmp_path: Path) -> None:
        """A byte flipped in the chunk file as stored: what it breaks (a value, or the whole chunk) is listed,
        one line per payload, and the check exits 1 with no traceback."""
        chunk = run / BLOB_CHUNK
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        chunk.write_bytes(bytes(raw))
        res = pdbg_here("info", str(run), "--check", cwd=tmp_path)
        assert res.returncode == 1 and res.stderr == "", res.stdout + res.stderr
        listed = res.stdout[res.stdout.index("corrupted or unreadable"):].splitlines()[1:]
        assert listed and all(line.startswith("  payload ") and "blobs/u4" in line and "; held by " in line
                              for line in listed), listed

    def test_a_deleted_chunk_file_names_each_payload_in_it(self, run: Path, tmp_path: Path) -> None:
        """A missing blob chunk: each payload stored in it is listed as unreadable, with its records; the
        payloads in other chunks are still checked."""
        rank = replayer.open(run).rank
        in_u8 = np.flatnonzero(rank.column("payloads/blob") == layout.BLOB_UNITS.index("u8")).tolist()
        assert in_u8 and len(in_u8) < rank.lengths["payloads"]
        (run / "rank0/blobs/u8/c/0").unlink()
        res = pdbg_here("info", str(run), "--check", cwd=tmp_path)
        assert res.returncode == 1, res.stdout + res.stderr
        listed = res.stdout[res.stdout.index("corrupted or unreadable"):].splitlines()[1:]
        assert listed == [f"  payload {pid}: chunk rank0/blobs/u8/c/0 is missing, but the manifest commits rows in "
                          "it; the recording is damaged or was copied incompletely; held by "
                          f"{users_text(holders(run, pid))}" for pid in in_u8]
        assert f"{len(in_u8)} corrupted or unreadable" in res.stdout

    def test_a_deleted_chunk_of_a_table_is_named(self, run: Path, tmp_path: Path) -> None:
        """A missing chunk of the tensor records' table (not of a payload): every payload's bytes are intact, but
        replay refuses the recording; --check said every payload intact and exited 0. It names the chunk, exit 1,
        and --json lists it."""
        (run / "rank0/tensors/step/c/0").unlink()
        said = ("chunk rank0/tensors/step/c/0 is missing, but the manifest commits rows in it; the recording is "
                "damaged or was copied incompletely")
        res = pdbg_here("info", str(run), "--check", cwd=tmp_path)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "\ntables: 1 column damaged (restore the recording from a copy; replay, verify and bisect refuse it):\n"\
               f"  {said}\n" in res.stdout, res.stdout
        assert "payloads: " in res.stdout and "every one intact" in res.stdout
        res = pdbg_here("info", str(run), "--check", "--json", cwd=tmp_path)
        assert res.returncode == 1 and json.loads(res.stdout)["payload_check"]["damaged_tables"] == [
            {"rank": 0, "problem": said}], res.stdout
        assert pdbg_here("replay", str(run), "0", cwd=tmp_path).returncode == 2

    @pytest.mark.parametrize("what, says", [("directory", "is not a PaperDebugger recording"),
                                            ("file", "is not a PaperDebugger recording"),
                                            ("missing", "no such file or directory")])
    def test_what_is_not_a_recording_is_one_line_and_exit_2(self, tmp_path: Path, what: str, says: str) -> None:
        """Bad input stays exit 2 with one line that says what the path is, as without --check."""
        target = tmp_path / "not_a_run"
        if what == "directory":
            target.mkdir()
        elif what == "file":
            target.write_text("hello\n")
        res = pdbg_here("info", str(target), "--check", cwd=tmp_path)
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.startswith(f"pdbg: error: {target}") and res.stderr.count("\n") == 1, res.stderr
        assert says in res.stderr and "Traceback" not in res.stderr


class TestCheckPayloads:
    def test_each_payload_is_read_once_and_each_chunk_decoded_once(self, pristine: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """The check streams: every stored payload once, and a blob chunk holding many payloads decoded
        once, not once per payload."""
        reads: list[tuple[str, int, int]] = []
        read = RankReader._read

        def counted(self: RankReader, path: str, start: int, stop: int) -> np.ndarray:
            if path.startswith("blobs/"):
                reads.append((path, start, stop))
            return read(self, path, start, stop)

        monkeypatch.setattr(RankReader, "_read", counted)
        rec = replayer.open(pristine)
        seen: list[tuple[int, int]] = []
        report = rec.check_payloads(progress=lambda done, total: seen.append((done, total)))
        count = rec.rank.lengths["payloads"]
        assert report.intact and report.payloads == count and report.nbytes == stored_bytes(pristine)
        assert seen == [(i, count) for i in range(1, count + 1)]
        chunks = {p.relative_to(pristine).as_posix() for p in (pristine / "rank0/blobs").glob("*/c/*")}
        assert len(reads) == len(chunks) and len(set(reads)) == len(reads), reads

    def test_a_damaged_payload_is_named_with_its_records(self, run: Path) -> None:
        """The Python answer names the rank, payload, what is wrong and (step, name, record) of each holder."""
        rank = replayer.open(run).rank
        pid = 1
        hashes = zarr.open_group(run, mode="r+")[layout.rank_group(0)]["payloads/hash"]
        hashes[pid] = hashes[pid] ^ np.array([0, 1], dtype=hashes.dtype)  # another checksum: a changed payloads/ row
        report = replayer.open(run).check_payloads()
        (damaged,) = report.damaged
        assert not report.intact and report.payloads == rank.lengths["payloads"]
        assert (damaged.rank, damaged.payload) == (0, pid) and damaged.problem.endswith("payload checksum mismatch")
        assert damaged.used_by == holders(run, pid) and damaged.used_by
