"""The benchmarks' verdicts: a target is met, not met, or undecided by the spread of the run.

docs/PERFORMANCE.md states each target's verdict from bench/docs_section.judge over the interval
from bench/docs_section.median_interval; a verdict that ignored the spread would flip between
runs of the same code."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from docs_section import judge, median_interval  # noqa: E402


@pytest.mark.parametrize(("interval", "verdict"), [
    ((1.02, 1.08), "met"),
    ((1.02, 1.10), "met"),  # the target itself is within it
    ((1.11, 1.20), "not met"),
    ((1.05, 1.14), "undecided"),
    ((1.10, 1.12), "undecided"),
])
def test_judge_reads_the_whole_interval(interval: tuple[float, float], verdict: str) -> None:
    assert judge(interval, 1.10) == verdict


def test_interval_holds_the_median_and_is_reproducible() -> None:
    ratios = [1.05, 1.12, 1.08, 1.03, 1.15, 1.09, 1.07, 1.11, 1.06, 1.10, 1.04, 1.13]
    low, high = median_interval(ratios)
    assert min(ratios) <= low <= statistics.median(ratios) <= high <= max(ratios)
    assert median_interval(ratios) == (low, high)  # a fixed seed: the same run reads the same


def test_interval_narrows_when_rounds_agree() -> None:
    spread = [1.00, 1.20, 1.02, 1.18, 1.04, 1.16, 1.06, 1.14, 1.08, 1.12, 1.10, 1.09]
    tight = [1.09, 1.10, 1.09, 1.10, 1.09, 1.10, 1.09, 1.10, 1.09, 1.10, 1.09, 1.10]
    assert judge(median_interval(spread), 1.10) == "undecided"
    assert judge(median_interval(tight), 1.10) == "met"
    wide, narrow = median_interval(spread), median_interval(tight)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]


def test_a_single_round_is_its_own_interval() -> None:
    assert median_interval([1.07]) == (1.07, 1.07)


def test_sessions_per_block_are_judged_paired() -> None:
    """A target's per-block line pairs each block with the baseline's block of its round and is
    judged on that ratio's interval, like the long session's line."""
    import record_overhead

    base = [0.40, 0.60, 0.40, 0.60, 0.40, 0.60]
    steady = [b * 1.05 for b in base]  # 5% over the baseline of its own round, every round
    spread = [b * r for b, r in zip(base, (1.00, 1.20, 1.02, 1.18, 1.04, 1.16), strict=True)]
    for rec, verdict in ((steady, "1.050x (1.050–1.050) — met"), (spread, "— undecided")):
        variants = {"baseline": {"per_iter": statistics.median(base), "samples": base}}
        for mode in ("stats", "full", "flight"):
            variants[mode] = {"per_iter": statistics.median(rec), "samples": rec, "loop_samples": rec}
        lines = record_overhead.target_lines({2: {"iterations": 5, "variants": variants}}, {})
        (stats_line,) = [line for line in lines if line.startswith("- stats ≤ 1.10x at 2 thread")]
        assert "a session per 5 iterations, paired: " in stats_line and verdict in stats_line


def test_callback_verdicts_without_the_by_hand_variant() -> None:
    """callback_overhead leaves record() by hand out unless asked (--by-hand): its table and
    verdicts then stand without it."""
    import callback_overhead as cb

    def variant(name: str, how: str, per_step: list[float]) -> cb.Variant:
        return cb.Variant(name, "hf", None, how, per_step=per_step, overhead=[0.1] * len(per_step),
                          ring_peak=[10**6] if how else [])

    res = {"frameworks": ["hf"], "by_hand": False,
           "variants": {"hf": variant("hf", "", [1.0, 1.2, 1.0, 1.2]),
                        "hf+callback": variant("hf+callback", "callback", [1.05, 1.38, 1.05, 1.38])}}
    (line,) = cb.verdicts(res)
    assert "paired 1.100x (95% interval 1.050–1.150) — **undecided**" in line and "by hand" not in line
    assert "record() by hand" not in cb.table(res)


def test_callback_docs_say_where_the_variants_trained() -> None:
    """The callbacks' section names the heap its variants trained in (a worker process each, with
    trimming off or glibc's defaults, or one shared process) and shows each variant's page faults:
    the same code reads 1.03x or 1.17x by that alone."""
    import callback_overhead as cb

    def variant(name: str, how: str, faults: float) -> cb.Variant:
        return cb.Variant(name, "hf", None, how, per_step=[0.2, 0.22], overhead=[0.1, 0.1],
                          ring_peak=[10**6] if how else [], faults=[faults, faults])

    for heap in cb.HEAPS:
        res = {"steps": 10, "blocks": 2, "seconds": 60.0, "loadavg_before": (1.0,) * 3,
               "loadavg_after": (1.0,) * 3, "frameworks": ["hf"], "by_hand": False, "heap": heap,
               "variants": {"hf": variant("hf", "", 9000), "hf+callback": variant("hf+callback", "callback", 4000)}}
        text = cb.docs_text({2: res}, "python bench/callback_overhead.py")
        assert f"`--heap {heap}`: {cb.HEAPS[heap]}" in text.replace("\n", " ")
        assert "| minor faults per step |" in text and "| 9000 |" in text and "| 4000 |" in text


def test_callback_steps_are_timed_from_the_settled_step() -> None:
    """A block's per-step figure starts at the end of step ``settle`` (the flight ring full), so a
    recording's first fill counts into its fixed cost, not its step time; every variant alike."""
    import callback_overhead as cb

    ends = [(0.0, 0), (1.0, 5000), (1.5, 9000), (1.7, 9000), (1.9, 9010)]  # slow first steps, then 0.2 s
    assert cb.steady(ends, 3) == (pytest.approx(0.2), 5.0)
    assert cb.steady(ends, 1) == (pytest.approx(1.9 / 4), 9010 / 4)  # from the first step's end, as before
    assert cb.steady(ends[:3], 3) == (pytest.approx(0.5), 4000.0)  # too short: its last step
    res = {"steps": 16, "blocks": 1, "seconds": 1.0, "loadavg_before": (1.0,) * 3,
           "loadavg_after": (1.0,) * 3, "frameworks": ["hf"], "by_hand": False, "heap": "fixed",
           "variants": {"hf": cb.Variant("hf", "hf", None, "", per_step=[0.2], overhead=[0.1], faults=[0.0]),
                        "hf+callback": cb.Variant("hf+callback", "hf", None, "callback", per_step=[0.21],
                                                  overhead=[0.3], ring_peak=[10**6], faults=[0.0])}}
    assert "between the end of its step 3 and of its last step" in cb.docs_text({2: res}, "x").replace("\n", " ")


def test_environment_is_put_back() -> None:
    """The bench's workers start with variables the parent process itself never keeps."""
    import os

    from docs_section import environment

    os.environ["PDBG_TEST_KEPT"] = "before"
    os.environ.pop("PDBG_TEST_ADDED", None)
    try:
        with environment({"PDBG_TEST_KEPT": "inside", "PDBG_TEST_ADDED": "inside"}):
            assert os.environ["PDBG_TEST_KEPT"] == os.environ["PDBG_TEST_ADDED"] == "inside"
        assert os.environ["PDBG_TEST_KEPT"] == "before" and "PDBG_TEST_ADDED" not in os.environ
    finally:
        os.environ.pop("PDBG_TEST_KEPT", None)


def test_only_names_a_target_setting() -> None:
    """--only MODE@THREADS runs one target's long session alone: it takes the settings the targets
    name and nothing else, so a typo cannot run for half an hour and judge nothing."""
    import argparse

    import record_overhead

    assert record_overhead.target_setting("full@1") == ("full", 1)
    assert record_overhead.target_setting("flight@2") == ("flight", 2)
    for bad in ("full@3", "anomaly@1", "full", "full@one"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a target's setting"):
            record_overhead.target_setting(bad)
