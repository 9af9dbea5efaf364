"""One headline metric per task: ``ccft report`` (``evals.report.primary_metric``), ``ccft study``
(``evals.study.task_entry``) and the task's declaration agree, on synthetic summaries and on the
summaries committed under reports/."""

import json
import warnings
from pathlib import Path

import pytest

from ccft.evals import report, study
from ccft.evals.protocol import get_task, primary_metric_of, secondary_metric_of, task_names

ROOT = Path(__file__).resolve().parents[2]


def _summary(task: str, keys, meta_primary=None) -> dict:
    block = {"metrics": {k: {"mean": 0.5, "ci": [0.4, 0.6], "n": 4} for k in keys}, "n": 4, "nll": 1.0}
    return {
        "task": task,
        "meta": {"primary_metric": meta_primary},
        "modes": {"full-ft": block, "prefillshare": block},
    }


@pytest.mark.parametrize("name", task_names())
def test_report_and_study_headline_the_declared_metric(name):
    t = get_task(name)
    primary, secondary = primary_metric_of(t), secondary_metric_of(t)
    # a decoy that sorts first and a meta that names something else: the declaration wins in both readers
    keys = ["aaa_decoy", primary, *([secondary] if secondary else [])]
    s = _summary(name, keys, meta_primary="aaa_decoy")
    assert report.primary_metric(s) == primary
    entry = study.task_entry(s, "spec")
    assert (entry["primary_metric"], entry["secondary_metric"]) == (primary, secondary)
    assert study.metrics_of(name) == (primary, secondary)


def test_declarations():
    assert primary_metric_of(get_task("gsm8k")) == "exact_match_flexible"
    assert primary_metric_of(get_task("gsm-plus")) == "exact_match_flexible"
    assert (primary_metric_of(get_task("humaneval")), secondary_metric_of(get_task("humaneval"))) == (
        "passed",
        "compiles",
    )
    assert primary_metric_of(get_task("multipl-e-lua")) == "passed"
    assert secondary_metric_of(get_task("multipl-e-lua")) is None
    assert primary_metric_of(get_task("bfcl-multiple")) == "accuracy"


@pytest.mark.parametrize(
    "rel, want",
    [
        ("reports/demo/gsm8k/summary.json", "exact_match_flexible"),
        ("reports/study/code/humaneval/summary.json", "passed"),
    ],
)
def test_committed_summaries(rel, want):
    """These were written when the runner recorded ``exact_match_strict`` / ``pass@1`` (not a summary key),
    so the report headlined strict match for GSM8K and ``compiles`` for HumanEval."""
    s = json.loads((ROOT / rel).read_text())
    assert report.primary_metric(s) == want == study.task_entry(s, "x")["primary_metric"]


def test_unregistered_task_falls_back_to_meta_then_first_key():
    assert report.primary_metric(_summary("custom", ["b", "a"], meta_primary="b")) == "b"
    assert report.primary_metric(_summary("custom", ["b", "a"])) == "a"
    assert report.primary_metric(_summary("custom", ["b"], meta_primary="zzz")) == "b"


def test_task_metrics_is_deprecated_and_derived():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        table = study.TASK_METRICS
    assert any(issubclass(x.category, DeprecationWarning) for x in w)
    assert table["gsm8k"] == ("exact_match_flexible", "answer_format")
