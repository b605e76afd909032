"""The timeline's view model reads a step column a chunk at a time until a filter needs it whole:
rows drawn from chunks must be exactly the rows drawn from whole columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import recorder
import replayer
from tests.replayer.kinds import TreeEncoder
from tests.tui.recordings import nan_run
from tui import views


@pytest.fixture(scope="module")
def nan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nan_run(tmp_path_factory.mktemp("views") / "nan.zarr")


@pytest.mark.parametrize("chunk", [3, 8192])  # 3: every iteration spans chunks; 8192: one chunk
def test_rows_from_chunks_equal_rows_from_whole_columns(nan_path: Path, chunk: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(views._StepColumn, "CHUNK", chunk)
    lazy = views.TimelineModel(replayer.open(nan_path))
    drawn = [lazy.row(i) for i in reversed(range(lazy.n))]  # from the end: spans found from any side
    assert all(c.array is None for c in lazy._cols.values()) and lazy._depth is None  # nothing read whole

    whole = views.TimelineModel(replayer.open(nan_path))
    assert len(whole.iteration) and len(whole.depth) and len(whole.t_start) and len(whole.t_end)
    assert len(whole.status) and len(whole.phase)
    assert drawn == [whole.row(i) for i in reversed(range(whole.n))]
    assert lazy.n == 20 and {lazy.depth_of(i) for i in range(lazy.n)} == {0, 1, 2}


def test_arguments_read_as_the_call_was_written() -> None:
    """A step's arguments line names a function argument, a generator and torch values by what they are."""
    doc = {"args": [{"$tensor": "args.0"}, {"$tensor": "args.0"}, 2.5],
           "kwargs": {"fn": {"$function": "torch.nn.functional:silu"},
                      "generator": {"$generator": {"device": "cpu", "state": "AAAA"}},
                      "dtype": {"$dtype": "bfloat16"}, "device": {"$device": "cuda:0"},
                      "cfg": {"$dataclass": {"type": "m:Config", "fields": {}}},
                      "f": {"$opaque": {"type": "builtins:function", "repr": "<lambda>"}},
                      "g": {"$opaque": {"type": "builtins:function", "repr": "<function __main__:<lambda>>"}},
                      "mask_mod": {"$opaque": {"type": "builtins:function",
                                               "repr": "<function __main__:main.<locals>.causal>"}}}}
    # (a function not recorded: by its qualified name where the recording kept it, 1.18)
    assert views.arguments_text(doc) == ("(<args.0>, <args.0>, 2.5, fn=silu, generator=Generator(cpu), "
                                         "dtype=torch.bfloat16, device='cuda:0', cfg=Config(...), "
                                         "f=<builtins:function, not recorded>, g=<lambda __main__:<lambda>, not "
                                         "recorded>, mask_mod=<function __main__:main.<locals>.causal, not recorded>)")


def test_a_module_argument_shows_its_class() -> None:
    """A network given to a step (schema 1.30's $module) showed as ``module(...)``; it shows its class, as an
    object argument does, in a list as at the top."""
    from torch import nn

    from recorder import jsonval

    net = nn.Sequential(nn.Linear(2, 2))
    doc = jsonval.encode({"args": [net, [net, nn.Linear(2, 2)], 0.5], "kwargs": {}},
                         tensor_name=lambda t, p: p, module_doc=lambda m: {"class": jsonval.type_ref(m)})
    assert views.arguments_text(doc) == "(Sequential(...), [Sequential(...), Linear(...)], 0.5)"


def test_numpy_arguments_read_with_dtype_shape_values_and_nan() -> None:
    """Numpy arguments showed as ``ndarray(...)`` and ``npscalar(...)``, like one that was not recorded
    (``<numpy:ndarray>``): they now show their dtype, shape, first values and NaN/Inf count, and a value
    not recorded as data says so."""
    from recorder import jsonval

    doc = jsonval.encode({"args": [np.array([0.5, np.nan, np.inf, 1, 2], dtype=np.float64), np.float32(1.5),
                                   np.zeros(5000, dtype=np.float32), np.array([True, False])],
                          "kwargs": {"n": np.uint64(2**64 - 1)}})
    assert views.arguments_text(doc) == ("(ndarray float64[5] [0.5, nan, inf, 1, …] (1 NaN, 1 Inf), "
                                         "np.float32(1.5), <numpy:ndarray, not recorded>, ndarray bool[2] "
                                         "[True, False], n=np.uint64(18446744073709551615))")


def test_timeline_rows_keep_their_columns_with_wide_characters_and_deep_nesting(tmp_path: Path) -> None:
    """Names were cut by characters, not terminal columns: a row holding CJK text pushed the
    duration bar right (cut off at 80 columns). And from 8 levels of nesting the indent took most
    of the name column. Every row now takes the same columns, and a deep step's name keeps room."""
    from rich.cells import cell_len

    import recorder

    @recorder.paper_step("Eq. 2 日本", name="步骤_ünïcode")
    def wide(x):  # type: ignore[no-untyped-def]
        return x + 1

    def nested(depth: int, x):  # type: ignore[no-untyped-def]
        return wide(x) if depth == 0 else deep(depth - 1, x)

    deep = recorder.paper_step("Level")(nested)
    path = tmp_path / "run.zarr"
    with recorder.record(path):
        wide(torch.ones(2))
        deep(9, torch.ones(2))
    model = views.TimelineModel(replayer.open(path))
    widths = {sum(cell_len(text) for text, _ in model.row(i)) for i in range(model.n)}
    assert len(widths) == 1, widths
    deepest = "".join(text for text, _ in model.row(model.n - 2))  # the last Level call, 9 levels down
    assert "Level" in deepest




def test_the_paper_view_counts_a_recursions_time_once(tmp_path: Path) -> None:
    """The paper view added up the time of every call of a recursive step, each nested one again inside
    its caller's (835 ms for a Tree-LSTM's encoder in a 289 ms recording), where ``pdbg info`` counts a
    recursion once: its calls inside another of its calls are not added again, forward and backward."""
    enc = TreeEncoder()
    with recorder.record(tmp_path / "run.zarr", model=enc) as run:
        for _ in range(2):
            enc((((1, 2), (3, 4)), ((5, 6), 7))).sum().backward()
            run.next_iteration()
    rec = replayer.open(tmp_path / "run.zarr")
    node = views.paper_tree(views.TimelineModel(rec)).children["Algorithm 4"]
    table = rec.steps
    outer = table.column("parent") < 0  # every step is the encoder's: those at the top hold all the others
    spans = table.column("t_end") - table.column("t_start")
    assert (node.forward, node.backward) == (26, 26) and outer.sum() == 4
    assert node.seconds == node.children["TreeEncoder"].seconds == float(spans[outer].sum()) < float(spans.sum())


def test_the_filter_and_the_rows_take_names_as_printed_and_under_unicode_normalisation(tmp_path: Path) -> None:
    """f résidu found nothing of a label recorded in NFD ("filter 'résidu': 0 steps"), and a module path
    with control characters lost them in the timeline (blocks.tabhere: typed back, it selected nothing)
    and broke the step pane's header in two at its newline. Rows and the header show them escaped, and
    the filter finds a name by its NFC or NFKC spelling, or by the escaped form it shows."""
    from tests.replayer.test_replay import Keyed

    path = tmp_path / "run.zarr"
    torch.manual_seed(0)
    model = Keyed()
    with recorder.record(path, model=model, modules=["**"]):
        model(torch.randn(2, 4)).sum().backward()
    rec = replayer.open(path)
    model_view = views.TimelineModel(rec)
    step = rec.step("blocks.tab\\there")
    text = "".join(piece for piece, _ in model_view.row(step.index, width=150))
    assert "blocks.tab\\there" in text and "\t" not in text
    header = views.step_view(rec.step("blocks.a\\nFAKE LINE")).title
    assert "\n" not in header and "blocks.a\\nFAKE LINE" in header
    for typed, expected in (("r\u00e9sidu", {"residu"}), ("\u00c9QUATION", {"residu"}), ("caf\u00e9", {"Linear"}),
                            ("tab\\there", {"Linear"}), ("\ufb01lter_\uff53tep", {"filter_step"})):
        assert model_view.apply_filter(typed) == 2, typed  # (the forward and the backward)
        assert {rec.step(int(i)).name for i in model_view.rows} == expected
    assert model_view.apply_filter("name:\ufb01lter_step") == 2


@recorder.paper_step("Eq. T", description="look up token ids")
def token_ids(ids: torch.Tensor) -> torch.Tensor:
    return ids.clone()


def test_the_inspector_shows_integer_values_whole(tmp_path: Path) -> None:
    """Token ids and indices are shown exactly where they fit their column (32767 and 32766 told apart);
    only those wider than it (int64 extremes) in exponent form."""
    ids = torch.tensor([32767, 32766, 4294967295, 2**62, -5], dtype=torch.int64)
    with recorder.record(tmp_path / "run.zarr"):
        token_ids(ids)
        token_ids(torch.tensor([65535, 65534], dtype=torch.uint16))
    steps = replayer.open(tmp_path / "run.zarr").steps.filter(name="token_ids")
    shown = views.tensor_view(steps[0], "output", "output").values[0].split()
    assert shown[1:] == ["32767", "32766", "4294967295", "4.612e+18", "-5"]
    assert views.tensor_view(steps[1], "args.0", "input").values[0].split()[1:] == ["65535", "65534"]


def test_a_shortened_path_keeps_its_end() -> None:
    """The header's path gives way from its start: the file's name is what the user reads."""
    path = "/home/someone/experiments/2026/runs/gpt2_nan.zarr"
    assert views.shortened_path(path, 80) == path
    assert views.shortened_path(path, 20) == "…/runs/gpt2_nan.zarr"
    assert views.shortened_path(path, 19) == "…/gpt2_nan.zarr"
    assert views.shortened_path(path, 8) == "…an.zarr"


def test_a_dotted_name_is_cut_in_its_middle() -> None:
    """A parameter's path keeps its start (which layer) and its end (weight or bias)."""
    assert views.cut_dotted("fc.weight", 28) == "fc.weight"
    assert views.cut_dotted("input_projection_with_a_long_name.weight", 28) == "input_proje…long_name.weight"
    assert views.cut_dotted("transformer.h.1.mlp.c_fc.weight", 28) == "transformer….mlp.c_fc.weight"
    assert views.cut_dotted("input_projection_with_a_long_name.weight", 6) == "…eight"


def test_the_inspector_s_nan_line_breaks_between_its_parts_not_inside_the_index(nan_path: Path) -> None:
    """On an 80-column terminal (the page about 66 columns wide) the NaN/Inf line of a 4-d tensor wrapped as words:
    "... the first at element 123456 [1, 14, 9," and "0] (o goes to an element)" on the next line. It breaks after
    the counts, then (if still too long) before the key's hint, never inside the index; a line that fits is as is."""
    import dataclasses

    from rich.console import Console

    from tui.app import render_tensor

    view = views.tensor_view(replayer.open(nan_path).step(12), "output", "output")
    line = "201 NaN and 900 Inf of 524288; the first at element 123456 [1, 14, 9, 0] (o goes to an element)"
    for width, want in ((66, ["201 NaN and 900 Inf of 524288;", "the first at element 123456 [1, 14, 9, 0] (o goes "
                                                                  "to an element)"]),
                        (50, ["201 NaN and 900 Inf of 524288;", "the first at element 123456 [1, 14, 9, 0]",
                              "(o goes to an element)"])):
        console = Console(width=width, record=True, color_system=None)
        console.print(render_tensor(dataclasses.replace(view, nonfinite=line), width=width))
        shown = [row.rstrip().replace("\u00a0", " ") for row in console.export_text().splitlines()]
        at = shown.index(want[0])  # (below the title and the recorded statistics)
        assert shown[at:at + len(want)] == want, shown[:8]
    assert view.nonfinite is not None
    assert view.nonfinite in str(render_tensor(view, width=66)).splitlines()  # it fits: one line


def test_the_inspector_says_how_many_values_are_not_finite_and_where_the_first_is(nan_path: Path) -> None:
    """The inspector's page showed the slice from element 0 and a histogram of the finite values: of a
    tensor with a NaN further on, neither showed it, nor said how many there were. It says both."""
    from tui.app import render_tensor

    step = replayer.open(nan_path).step(12)  # the origin: exp overflowed in 5 of 12 elements
    out = step.tensor("output").reshape(-1)
    first = int(torch.nonzero(~torch.isfinite(out))[0])
    view = views.tensor_view(step, "output", "output")
    assert view.nonfinite == (f"5 Inf of 12; the first at element {first} [{first // 4}, {first % 4}] "
                              "(o goes to an element)")
    assert view.nonfinite in str(render_tensor(view))
    assert views.tensor_view(step, "args.0", "input").nonfinite is None
    values = np.zeros(256)
    values[[17, 40]] = np.nan, np.inf
    assert views.nonfinite_where(values, (16, 16)).startswith("1 NaN and 1 Inf of 256; the first at element 17 [1, 1]")
    assert views.nonfinite_where(np.arange(3), (3,)) is None
