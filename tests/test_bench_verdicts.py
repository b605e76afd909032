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
