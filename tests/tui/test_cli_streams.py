"""`pdbg` in a shell: what it prints never ends in a traceback of its own (a reader that left, a
closed stdout, an encoding without a character, Ctrl-C), its exit code stays its answer, `--json`
is JSON whatever the replayed script prints, and a script's top level sees its recorded arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import recorder
import tui.cli
from replayer.replay import Replayer
from tests.cli import env, pdbg, pdbg_here, python
from tests.tui.recordings import nan_run

SCRIPT = '''
import argparse
import sys

import torch
from torch import nn

import recorder

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("iters", type=int)
ARGS = parser.parse_args()  # at the top level, as many scripts do
print("loading the script")


@recorder.paper_step("Eq. 1")
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        print("in forward", tuple(x.shape))  # a debugging print
        return torch.tanh(self.fc(x)) * ARGS.iters


if __name__ == "__main__":
    torch.manual_seed(0)
    block = Block()
    with recorder.record(ARGS.out, mode="full"):
        for _ in range(ARGS.iters):
            block(torch.randn(2, 4)).sum().backward()
'''


def test_a_script_that_parses_its_arguments_at_the_top_level_replays_and_json_stays_json(tmp_path: Path) -> None:
    """A script that parses sys.argv at its top level was loaded with pdbg's own arguments: every
    replay failed with the script's argparse usage ("argument iters: invalid int value: 'replay'"),
    exit 2, and the TUI's r ended the app. It now sees the arguments it was recorded with. What it
    prints (at its top level, inside a step) went to stdout and broke --json; it goes to stderr."""
    (tmp_path / "train.py").write_text(SCRIPT)
    res = python("train.py", "run.zarr", "3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = pdbg("replay", "run.zarr", "0", cwd=tmp_path)
    assert res.returncode == 0 and "MATCH: bit for bit" in res.stdout, res.stdout + res.stderr
    res = pdbg("verify", "run.zarr", "--json", cwd=tmp_path)
    assert res.returncode == 0 and "loading the script" in res.stderr and "in forward (2, 4)" in res.stderr
    assert json.loads(res.stdout)["matched"] == 6  # the whole of stdout is the one JSON object


@pytest.fixture(scope="module")
def nan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nan_run(tmp_path_factory.mktemp("streams") / "nän run.zarr")


def test_output_problems_end_the_output_not_the_answer(nan_path: Path, tmp_path: Path) -> None:
    """`pdbg bisect` finds a NaN (exit 1). With stdout an encoding that lacks a character (·, ä) it
    raised UnicodeEncodeError; with stdout closed (>&-), or a reader that left before it wrote (`| true`),
    it gave a traceback or exit 0. It writes what it can, escaped, and exits 1 each time."""
    command = [sys.executable, "-m", "tui.cli", "bisect", str(nan_path)]
    ascii_env = {**env(), "PYTHONIOENCODING": "ascii"}
    res = subprocess.run(command, capture_output=True, text=True, env=ascii_env, timeout=300, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "\\xb7" in res.stdout or "\\xe4" in res.stdout, res.stdout
    closed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(),
                            timeout=300, check=False, preexec_fn=lambda: os.close(1))
    assert closed.returncode == 1 and "Traceback" not in closed.stderr, closed.stderr
    read, write = os.pipe()
    os.close(read)  # the reader left before anything was written: every write is EPIPE
    try:
        left = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, env=env(), timeout=300,
                              check=False)
    finally:
        os.close(write)
    assert left.returncode == 1 and left.stderr == "", left.stderr


@recorder.paper_step("\u00c9q. 3 \u2014 m\u00e9lange", name="m\u00e9lange")
def melange(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_selector_typed_under_a_locale_that_is_not_utf_8_matches(tmp_path: Path) -> None:
    """Under LC_ALL=C with Python's UTF-8 mode off, the command line is decoded as ASCII: a non-ASCII selector
    came as lone surrogates, matched nothing, and the error showed it garbled ('\\udcc3\\udc89q. 3 ...'). A
    selector (or an edit key, a glob) is read as the UTF-8 it was typed in; a path stays the file system's."""
    path = tmp_path / "r\u00e9s" / "run.zarr"
    with recorder.record(path):
        melange(torch.ones(2))
    c_locale = {**env(), "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    for selector in ("\u00c9q. 3 \u2014 m\u00e9lange@iter=0", "m\u00e9lange"):
        res = subprocess.run([sys.executable, "-m", "tui.cli", "find", str(path), selector], capture_output=True,
                             text=True, env=c_locale, timeout=300, check=False)
        assert res.returncode == 0 and res.stdout.startswith("step 0: "), res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-m", "tui.cli", "find", str(path), "\u00c9q. 9"], capture_output=True,
                         text=True, env=c_locale, timeout=300, check=False)
    assert res.returncode == 2 and "no step matches '\\xc9q. 9'" in res.stderr and "udc" not in res.stderr, \
        res.stderr


def test_ctrl_c_is_one_line_and_exit_130(nan_path: Path, monkeypatch, capsys) -> None:
    """Ctrl-C while a command runs (here: inside a replay of verify) printed a traceback of 20-50 lines."""
    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(Replayer, "replay", interrupted)
    assert tui.cli.main(["verify", str(nan_path)]) == 130
    err = capsys.readouterr().err
    assert err == "pdbg: interrupted\n", err


def test_verify_goes_on_past_a_step_the_replayer_fails_on(nan_path: Path, monkeypatch, capsys) -> None:
    """An error the replay has no message for, on one step (a fault of pdbg's), ended `pdbg verify` of the whole
    run with a traceback, and the other steps went unverified. That step is now listed as not replayed, with
    the error, and the others are verified."""
    replay = Replayer.replay
    failed: list[int] = []

    def faulty(self, step, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not failed:
            failed.append(step.index)
            raise RuntimeError("unsupported operation: more than one element refers to a single memory location")
        return replay(self, step, *args, **kwargs)

    monkeypatch.setattr(Replayer, "replay", faulty)
    code = tui.cli.main(["verify", str(nan_path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code != 2 and len(doc["not_replayed"]) == 1, doc
    reason = doc["not_replayed"][0]["reason"]
    assert doc["not_replayed"][0]["step"]["index"] == failed[0] and "RuntimeError: unsupported operation" in reason
    assert "fault of pdbg's" in reason and doc["replayed"] >= 1 and doc["matched"] == doc["replayed"], doc


def test_ctrl_c_while_pdbg_starts_is_one_line_and_exit_130(monkeypatch, capsys) -> None:
    """Ctrl-C in the second pdbg takes to import torch, before any command runs, printed a traceback
    of the import machinery. The entry point (`pdbg` runs tui.entry:main) says one line and exits 130."""
    import importlib.abc

    import tui.entry

    class Interrupted(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name == "tui.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "tui.cli")
    monkeypatch.delattr(sys.modules["tui"], "cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    assert tui.entry.main() == 130
    assert capsys.readouterr().err == "pdbg: interrupted\n"


def test_options_may_come_between_run_and_step(nan_path: Path, tmp_path: Path) -> None:
    """`pdbg replay RUN --no-inner STEP` (and `--threads 1 STEP`) said "unrecognized arguments: STEP", exit 2:
    argparse filled the optional STEP with nothing before the option. They replay as STEP first does."""
    run, step = str(nan_path), "Scaled@iter=0#0"
    first = pdbg_here("replay", run, step, "--no-inner", "--threads", "1", cwd=tmp_path)
    assert first.returncode == 0 and "MATCH" in first.stdout, first.stderr
    for order in ([run, "--no-inner", step, "--threads", "1"], [run, "--threads", "1", step, "--no-inner"],
                  ["--no-inner", run, "--threads", "1", step]):
        res = pdbg_here("replay", *order, cwd=tmp_path)
        assert res.returncode == 0 and res.stdout == first.stdout, (order, res.stderr)
    res = pdbg_here("replay", "--json", str(nan_path), "Scaled@iter=0#0", "extra", cwd=tmp_path)
    assert res.returncode == 2 and "unrecognized arguments: extra" in res.stderr, res.stderr


@pytest.mark.parametrize("argv, expected", [
    (["replay", "r.zarr", "--no-inner", "5"], {"run": "r.zarr", "step": "5", "no_inner": True}),
    (["replay", "--threads", "1", "r.zarr", "--json", "-1"], {"run": "r.zarr", "step": "-1", "threads": 1}),
    (["replay", "r.zarr", "--no-inner"], {"run": "r.zarr", "step": None, "no_inner": True}),
    (["bundle", "r.zarr", "-o", "b.pdbg", "5", "--verify"], {"run": "r.zarr", "step": "5", "out": "b.pdbg"}),
    (["find", "r.zarr", "--backward", "Eq. 2"], {"run": "r.zarr", "where": "Eq. 2", "backward": True}),
    (["bisect", "--ops", "r.zarr", "--against", "o.zarr"], {"run": "r.zarr", "against": "o.zarr", "ops": True}),
    (["tui", "--at", "3", "r.zarr"], {"run": "r.zarr", "at": "3"}),
    (["tui", "--", "-odd.zarr"], {"run": "-odd.zarr"}),
    (["record", "-o", "r.zarr", "train.py", "--lr", "1", "x"], {"script": "train.py", "args": ["--lr", "1", "x"]}),
])
def test_every_commands_options_may_come_anywhere(argv: list[str], expected: dict[str, object]) -> None:
    """Options before, between or after a command's positional arguments parse alike; pdbg record still
    passes what follows the script on to it, and `--` still marks a path that starts with -."""
    args, unknown = tui.cli.build_parser().parse_known_args(argv)
    assert not unknown and {k: getattr(args, k) for k in expected} == expected, (unknown, args)


def test_the_replay_table_fits_the_terminal(nan_path: Path, tmp_path: Path) -> None:
    """The replay table was 119 columns wide whatever the terminal, and wrapped in 80 columns. In a
    narrower terminal a mismatch's replayed statistics go on a line of their own; to a pipe, or in a
    wide terminal, recorded and replayed stay side by side."""
    res = pdbg_here("replay", str(nan_path), "Scaled@iter=1#0", "--edit", "args.0=x*2", cwd=tmp_path, columns=80)
    assert res.returncode == 1, res.stderr
    lines = res.stdout.splitlines()
    top = lines.index(next(line for line in lines if line.split()[:2] == ["tensor", "match"]))
    table = lines[top:lines.index("", top)]  # the header, the two rows of a mismatch, what differs (prose)
    assert len(table) >= 3 and table[3:] and all(line.startswith("    ") for line in table[3:]), res.stdout
    assert max(len(line) for line in table) <= 80, res.stdout
    (recorded,) = [i for i, line in enumerate(lines) if line.split()[:3] == ["output", "NO", "recorded"]]
    assert lines[recorded + 1].split()[0] == "replayed", res.stdout
    res = pdbg_here("replay", str(nan_path), "Scaled@iter=1#0", "--edit", "args.0=x*2", cwd=tmp_path, columns=120)
    assert "recorded: min" in res.stdout and "replayed: min" in res.stdout, res.stdout
    res = pdbg_here("replay", str(nan_path), "Scaled@iter=1#0", "--edit", "args.0=x*2", cwd=tmp_path)  # a pipe
    assert "recorded: min" in res.stdout and "replayed: min" in res.stdout, res.stdout


@pytest.mark.parametrize("columns", [80, 120, 200, None])
def test_the_replay_tables_tensor_names_stay_apart(columns: int | None, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Names were cut to their first 18 characters, with no ellipsis: self_attn.out_proj.weight and
    .bias were two rows "self_attn.out_proj". They are whole where the terminal has room (a pipe has
    it all), else cut at their start, with an ellipsis, keeping the end that tells them apart."""
    import torch

    from replayer.compare import compare
    from tui.cmd_replay import _outputs_table

    names = ["param_grad:self_attn.out_proj.weight", "param_grad:self_attn.out_proj.bias", "args.0"]
    diffs = [compare(name, "param_grad", torch.ones(3), torch.ones(3)) for name in names]
    monkeypatch.delenv("COLUMNS", raising=False)
    if columns is not None:
        monkeypatch.setenv("COLUMNS", str(columns))
    _outputs_table(diffs)
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.split()[1:2] == ["yes"]]
    assert len(rows) == 3 and len(set(rows)) == 3, rows
    if columns in (200, None):
        assert rows == names
    else:
        assert rows[0].startswith("…") and rows[0].endswith("proj.weight") and rows[1].endswith("proj.bias")
        assert rows[2] == "args.0"


def test_pdbg_record_leaves_the_scripts_streams_as_they_are(tmp_path: Path) -> None:
    """A script that reconfigures sys.stdout and writes to its buffer, recorded in pdbg's own process
    (full mode): pdbg's stream wrapper reached it, and it died with AttributeError ('reconfigure')."""
    (tmp_path / "train.py").write_text(
        "import sys\nimport torch\nfrom torch import nn\n\nsys.stdout.reconfigure(line_buffering=True)\n"
        "net = nn.Sequential(nn.Linear(4, 4))\nnet(torch.randn(2, 4)).sum().backward()\n"
        "sys.stdout.buffer.write(b'raw bytes\\n')\nprint('done', sys.stdout.errors)\n")
    res = pdbg("record", "-o", "run.zarr", "--modules", "0", "--", "train.py", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("raw bytes\ndone "), res.stdout + res.stderr
    assert res.stderr.rstrip().endswith("run.zarr (complete, 2 steps)"), res.stderr


@pytest.mark.parametrize("argv, hint", [
    (["bisect", "r.zarr", "--against", "-x.zarr"], "a value that starts with '-' is given as --against=-x.zarr"),
    (["replay", "r.zarr", "3", "--swap", "-fix.py"], "a value that starts with '-' is given as --swap=-fix.py"),
    (["replay", "-x.zarr", "3"], "-x.zarr reads as an option: a path that starts with '-' is given as ./-x.zarr"),
    (["info", "-x.zarr"], "-x.zarr reads as an option: a path that starts with '-' is given as ./-x.zarr"),
])
def test_a_value_that_starts_with_a_dash_gets_a_way_to_give_it(argv: list[str], hint: str, capsys) -> None:
    """`pdbg bisect RUN --against -x.zarr` said only argparse's "expected one argument", and `pdbg info -x.zarr`
    that RUN was missing: the error now says how to give such a value, in its one line."""
    try:
        code = tui.cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and hint in err, err


def test_an_unknown_option_gets_no_dash_hint(capsys) -> None:
    assert tui.cli.main(["replay", "r.zarr", "3", "--bogus"]) == 2
    assert capsys.readouterr().err == "pdbg: error: unrecognized arguments: --bogus (options: pdbg replay --help)\n"
