"""Bad input to `pdbg` is one line on stderr that names the problem and what to do, exit code 2, no
traceback: a misspelt tensor in `find --when`, a `--script` that is not the recorded one; and a script
that does not compile is reported by `pdbg record` as Python reports it, not as a failure of pdbg."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli import pdbg, python
from tests.tui.recordings import nan_run

SCRIPT = '''
import torch

import recorder


@recorder.paper_step("Eq. 1")
def scale(x):
    return x * 2


if __name__ == "__main__":
    with recorder.record("run.zarr"):
        scale(torch.ones(3))
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nan_run(tmp_path_factory.mktemp("bad_input") / "run.zarr")


class TestPaths:
    @pytest.mark.parametrize("command", ["info", "verify", "bisect"])
    def test_an_empty_recording_path_is_refused(self, command: str, run: Path) -> None:
        """An empty RUN was taken for the working directory: "  is not a PaperDebugger recording (it has no
        zarr.json ...)", naming nothing; it says the path is empty."""
        res = pdbg(command, "", cwd=run.parent)
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert res.stderr == ("pdbg: error: the path of the recording is empty; give the path of a recording (made "
                              "by recorder.record or `pdbg record`)\n"), res.stderr



class TestStepIndex:
    def test_a_superscript_digit_is_a_name_no_step_has(self, run: Path, tmp_path: Path) -> None:
        """`²` passes str.isdigit but not int(): `pdbg replay RUN ²` ended in a ValueError traceback."""
        res = pdbg("replay", str(run), "²", cwd=tmp_path)
        assert res.returncode == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("pdbg: error: no step matches '²'"), res.stderr

class TestBisectOptions:
    @pytest.mark.parametrize("option", [["--script", "train.py"], ["--use-bundled-source"]])
    def test_an_option_of_ops_alone_is_refused(self, option: list[str], run: Path, tmp_path: Path) -> None:
        """--use-bundled-source without --ops was ignored (exit 1, the origin printed as if it applied), where
        --script without --ops is refused: both say they are for --ops."""
        res = pdbg("bisect", str(run), *option, cwd=tmp_path)
        assert res.returncode == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1, res.stderr
        assert f"{option[0]} says " in res.stderr and f"add --ops, or leave {option[0]} out" in res.stderr, res.stderr

    def test_bundled_source_of_a_run_that_is_no_bundle_is_refused(self, run: Path, tmp_path: Path) -> None:
        """--ops --use-bundled-source on a directory run answered exit 1 with an op note that the step "cannot be
        replayed"; as for pdbg replay, it is bad input: no bundled source to use."""
        res = pdbg("bisect", str(run), "--ops", "--use-bundled-source", cwd=tmp_path)
        assert res.returncode == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith(f"pdbg: error: {run} is not a bundle: there is no bundled source to use"), \
            res.stderr


class TestFindCondition:
    def test_a_tensor_no_step_has_is_refused(self, run: Path, tmp_path: Path) -> None:
        """A misspelt tensor name in --when read as a search that found nothing (exit 1): it is an error."""
        res = pdbg("find", str(run), "*", "--when", "outptu.inf > 0", cwd=tmp_path)
        assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
        assert res.stdout == "" and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("pdbg: error: the condition 'outptu.inf > 0' names the tensor 'outptu', which "
                                     "no step of"), res.stderr
        assert "names there: " in res.stderr and "args.0" in res.stderr, res.stderr

    def test_a_misspelt_name_of_a_role_is_refused(self, run: Path, tmp_path: Path) -> None:
        """A name under a role (param.NAME) that no record of that role has is an error, even under not."""
        res = pdbg("find", str(run), "*", "--when", "not param.nosuch.norm > 0", cwd=tmp_path)
        assert res.returncode == 2 and "names the param tensor 'nosuch'" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr

    def test_a_condition_on_tensors_it_has_still_finds_nothing_quietly(self, run: Path, tmp_path: Path) -> None:
        """Names the recording has, by name or position, are searched as before: no hit is exit 1."""
        none = pdbg("find", str(run), "*", "--when", "output.absmax > 1e30 and args.0.nan > 1e9", cwd=tmp_path)
        assert none.returncode == 1 and none.stdout.strip() == "no step matches", none.stderr
        hit = pdbg("find", str(run), "*", "--when", "output.0.inf > 0", cwd=tmp_path)
        assert hit.returncode == 0 and hit.stdout.startswith("step "), hit.stderr


class TestScripts:
    def test_a_script_that_does_not_compile_is_reported_as_python_does(self, tmp_path: Path) -> None:
        """pdbg record printed pdbg's own frames (runner.py, runpy) above a script's SyntaxError, and told to mark
        paper steps; it prints the error as Python does, and that the script never got to run a step."""
        (tmp_path / "broken.py").write_text("x = (\n")
        res = pdbg("record", "-o", "run.zarr", "--", "broken.py", cwd=tmp_path)
        assert res.returncode == 1, res.stderr
        assert "Traceback" not in res.stderr and "runner.py" not in res.stderr and "runpy" not in res.stderr, \
            res.stderr
        assert res.stderr.startswith('  File "broken.py", line 1\n'), res.stderr
        assert "SyntaxError: '(' was never closed\n" in res.stderr, res.stderr
        assert res.stderr.splitlines()[-1].endswith("no step was recorded: the script raised SyntaxError (above) "
                                                    "before any step ran"), res.stderr

    def test_a_script_option_naming_another_file_says_which_file(self, tmp_path: Path) -> None:
        """--script naming a file without the step said "__main__ has no scale now": it names the file looked in."""
        (tmp_path / "train.py").write_text(SCRIPT)
        (tmp_path / "other.py").write_text("print('other')\n")
        recorded = python("train.py", cwd=tmp_path)
        assert recorded.returncode == 0, recorded.stderr
        res = pdbg("replay", "run.zarr", "0", "--script", "other.py", cwd=tmp_path)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("pdbg: error: the training script other.py (__main__) has no scale now"), \
            res.stderr
        assert "--script" in res.stderr and "other\n" not in res.stdout
        assert pdbg("replay", "run.zarr", "0", cwd=tmp_path).returncode == 0

    def test_a_bundle_refuses_a_script_option_without_the_step(self, tmp_path: Path) -> None:
        """pdbg bundle --script naming a file without the step wrote a bundle (exit 0) whose every replay was
        refused: it is refused before anything is written; the script moved elsewhere is taken."""
        (tmp_path / "train.py").write_text(SCRIPT)
        (tmp_path / "other.py").write_text("print('other')\n")
        assert python("train.py", cwd=tmp_path).returncode == 0
        res = pdbg("bundle", "run.zarr", "0", "-o", "f.pdbg", "--script", "other.py", cwd=tmp_path)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("pdbg: error: step 0's code is scale, defined in the training script "), res.stderr
        assert "does not define it" in res.stderr and not (tmp_path / "f.pdbg").exists()
        (tmp_path / "moved").mkdir()
        (tmp_path / "train.py").rename(tmp_path / "moved" / "train.py")
        res = pdbg("bundle", "run.zarr", "0", "-o", "f.pdbg", "--script", "moved/train.py", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert pdbg("replay", "f.pdbg", cwd=tmp_path).returncode == 0
