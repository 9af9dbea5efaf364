"""The paired PrefillShare − naive difference, the frontier's pairing against m = 0, and the reports'
"Results" summaries: their words follow from the CIs (resolved = the 95% CI excludes 0)."""

from __future__ import annotations

import pytest

from ccft.evals.report import paired_difference, results_verdict, verdict
from ccft.evals.stats import paired_bootstrap_delta
from ccft.evals.study.frontier import frontier_points, m0_reference
from ccft.evals.study.report import frontier_results, study_results, study_title, task_entry


def _recs(nll, scores=None, ids=None):
    ids = ids or [f"i{k}" for k in range(len(nll))]
    return [
        {"id": i, "index": k, "nll": x, **({"scores": {"em": scores[k]}} if scores else {})}
        for k, (i, x) in enumerate(zip(ids, nll, strict=True))
    ]


def test_paired_difference_known_answer_constant_shift():
    # every item 0.1 lower for prefillshare: delta −0.1 and a CI of exactly that, whatever the resampling
    naive = _recs([1.0, 2.0, 0.5, 3.0])
    ps = _recs([0.9, 1.9, 0.4, 2.9])
    d = paired_difference({"prefillshare": ps, "naive": naive}, "prefillshare", "naive")
    assert d["nll"]["delta"] == pytest.approx(-0.1)
    assert d["nll"]["ci"] == pytest.approx([-0.1, -0.1]) and d["nll"]["n"] == 4


def test_paired_difference_pairs_by_item_id_and_matches_the_bootstrap():
    naive = _recs([1.0, 2.0, 3.0], [0.0, 0.0, 1.0], ids=["a", "b", "c"])
    ps = list(reversed(_recs([1.5, 2.0, 2.0], [1.0, 0.0, 1.0], ids=["a", "b", "c"])))  # other order
    d = paired_difference({"prefillshare": ps, "naive": naive, "full-ft": naive}, "prefillshare", "naive")
    want = paired_bootstrap_delta([1.0, 0.0, 1.0], [0.0, 0.0, 1.0], n_resamples=2000, seed=0)
    assert d["em"]["delta"] == pytest.approx(1 / 3) and d["em"]["ci"] == pytest.approx(list(want["ci"]))
    assert d["nll"]["delta"] == pytest.approx((0.5 + 0.0 - 1.0) / 3)
    # records given as id -> record (the study's form) give the same
    as_dict = {m: {r["id"]: r for r in rs} for m, rs in {"prefillshare": ps, "naive": naive}.items()}
    assert paired_difference(as_dict, "prefillshare", "naive") == d
    assert paired_difference({"naive": naive}, "prefillshare", "naive") == {}


def test_verdict_words_follow_the_ci():
    assert verdict([0.02, 0.11], True, "PrefillShare", "naive") == "resolved: PrefillShare better"
    assert verdict([-0.05, -0.01], True, "PrefillShare", "naive") == "resolved: naive better"
    assert verdict([0.01, 0.03], False, "PrefillShare", "Full-FT") == "resolved: Full-FT better"  # NLL
    assert verdict([-0.1, 0.01], True, "PrefillShare", "naive") == "not resolved: CI includes 0"
    assert verdict([0.0, 0.1], True, "a", "b") == "not resolved: CI includes 0"  # touching 0 is not excluding


def test_results_verdict_names_resolved_and_unresolved():
    pairs = {
        ("prefillshare", "full-ft"): {"em": {"delta": -0.04, "ci": [-0.10, 0.01]}},
        ("naive", "full-ft"): {"em": {"delta": -0.10, "ci": [-0.17, -0.04]}},
        ("prefillshare", "naive"): {"em": {"delta": 0.06, "ci": [0.02, 0.11]}},
    }
    text = results_verdict(pairs, [("em", "accuracy", True, True)])
    assert "Resolved (95% paired CI excludes 0): naive − Full-FT on accuracy (Full-FT better); " in text
    assert "PrefillShare − naive on accuracy (PrefillShare better)." in text
    assert "Not resolved (CI includes 0): PrefillShare − Full-FT on accuracy." in text
    quiet = {k: {"em": {"delta": 0.0, "ci": [-0.1, 0.1]}} for k in pairs}
    text = results_verdict(quiet, [("em", "accuracy", True, True)])
    assert "every comparison on accuracy" in text and "No difference between the modes resolves" in text
    assert "Resolved" not in text


def _entry_summary():
    block = {
        "metrics": {"accuracy": {"mean": 0.5, "ci": [0.2, 0.8]}},
        "nll": 1.0,
        "nll_ci": [0.9, 1.1],
        "n": 4,
    }
    return {
        "task": "bfcl-multiple",
        "modes": {m: dict(block) for m in ("full-ft", "naive", "prefillshare")},
        "deltas_vs_full_ft": {
            "naive": {
                "accuracy": {"delta": -0.5, "ci": [-0.75, -0.25]},
                "nll": {"delta": 0.1, "ci": [0.05, 0.2]},
            },
            "prefillshare": {
                "accuracy": {"delta": 0.0, "ci": [-0.25, 0.25]},
                "nll": {"delta": 0.0, "ci": [-0.1, 0.1]},
            },
        },
    }


def test_study_task_entry_and_results_report_prefillshare_minus_naive():
    ids = ["a", "b", "c", "d"]
    recs = {
        "full-ft": [
            {"id": i, "index": k, "nll": 1.0, "scores": {"accuracy": 1.0}} for k, i in enumerate(ids)
        ],
        "naive": [{"id": i, "index": k, "nll": 1.2, "scores": {"accuracy": 0.0}} for k, i in enumerate(ids)],
        "prefillshare": [
            {"id": i, "index": k, "nll": 1.0, "scores": {"accuracy": 1.0}} for k, i in enumerate(ids)
        ],
    }
    e = task_entry(_entry_summary(), "tools", recs)
    pn = e["paired_prefillshare_vs_naive"]
    assert pn["score"] == pytest.approx(1.0) and pn["score_ci"] == pytest.approx([1.0, 1.0])
    assert pn["nll"] == pytest.approx(-0.2) and pn["nll_ci"] == pytest.approx([-0.2, -0.2])
    assert "paired_prefillshare_vs_naive" not in task_entry(_entry_summary(), "tools")  # no records: no key
    report = {
        "tasks": [e],
        "model": "Tiny, fp32",
        "hardware": "Some CPU (AVX2), 2 logical cores, torch x using 2 threads, no GPU",
    }
    text = study_results(report)
    assert text.startswith("Primary-metric differences that resolve: bfcl-multiple naive − full-ft ")
    assert "bfcl-multiple prefillshare − naive +100.0 pp [+100.0, +100.0]" in text
    assert "Not resolved (CI includes 0): PrefillShare − Full-FT on accuracy" in text
    assert "PrefillShare − naive on accuracy (PrefillShare better)" in text
    assert study_title(report) == (
        "ccft study: PrefillShare vs Full-FT vs naive sharing — tools (bfcl-multiple), n = 4 each; Tiny, "
        "Some CPU (AVX2), 2 logical cores"
    )
    report["tasks"][0]["paired_vs_full_ft"]["naive"]["score_ci"] = [-0.75, 0.1]
    report["tasks"][0]["paired_prefillshare_vs_naive"]["score_ci"] = [-0.2, 1.0]
    assert study_results(report).startswith("No primary-metric difference between the modes resolves")


def test_frontier_points_are_paired_against_m0_of_their_own_mode():
    assert m0_reference("prefillshare m=4") == "prefillshare m=0"
    assert m0_reference("prefillshare int8 (int8-trained)") == "prefillshare m=0"
    assert m0_reference("naive m=2") == "naive"
    assert m0_reference("prefillshare m=0") is None and m0_reference("full-ft") is None

    def recs(nll, acc):
        return {
            str(i): {
                "id": str(i),
                "index": i,
                "nll": nll + 0.01 * i,
                "prompt_tokens": 10,
                "new_tokens": 2,
                "scores": {"passed": acc[i]},
            }
            for i in range(4)
        }

    points = {
        "full-ft": recs(1.0, [1, 1, 0, 0]),
        "naive": recs(1.2, [0, 0, 0, 0]),
        "naive m=2": recs(1.1, [0, 0, 0, 0]),
        "prefillshare m=0": recs(1.05, [1, 0, 0, 0]),
        "prefillshare m=2": recs(1.08, [1, 0, 0, 0]),
    }
    f = frontier_points(
        "humaneval", points, metrics=("passed", None), layers=4, bytes_per_layer_token=8, agents=[2]
    )
    by = {p["label"]: p for p in f["points"]}
    assert by["prefillshare m=2"]["paired_vs_m0"]["nll"]["delta"] == pytest.approx(0.03)
    assert by["prefillshare m=2"]["paired_vs_m0"]["nll"]["ci"] == pytest.approx([0.03, 0.03])
    assert by["prefillshare m=2"]["paired_vs_m0"]["primary"] == {"delta": 0.0, "ci": [0.0, 0.0]}
    assert by["naive m=2"]["paired_vs_m0"]["nll"]["delta"] == pytest.approx(-0.1)
    assert "paired_vs_m0" not in by["prefillshare m=0"] and "paired_vs_m0" not in by["full-ft"]
    text = frontier_results({"code": [f]})
    assert "- **code / humaneval**, passed: Not resolved for every point (CI includes 0)." in text
    assert "naive m=2 -0.1000 [-0.1000, -0.1000] (better)" in text
    assert "prefillshare m=2 +0.0300 [+0.0300, +0.0300] (worse)" in text
