"""``ccft report``: tables per task and mode, paired deltas vs Full-FT, plots, report.json, provenance."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ccft.core.errors import ConfigError
from ccft.evals.report import build_report, headline_table, modes_table, reading
from ccft.evals.stats import mean_ci, paired_bootstrap_delta
from ccft.evals.sweep import summarize_sweep

pytest.importorskip(
    "matplotlib", reason="ccft report draws its plots with matplotlib (pin it with the test extras)"
)

PNG = b"\x89PNG\r\n\x1a\n"
META = {
    "model": "SmolLM2-135M-Instruct, Q4_1 weights dequantised to fp32",
    "hardware": "test CPU, 2 cores",
    "data": "GSM8K test (MIT), first 40 rows",
}


def _eval_folder(root, task="gsm8k", n=40, modes=("base", "full-ft", "naive", "prefillshare"), missing=0):
    """A result folder as ``ccft eval`` writes it, with known per-item numbers."""
    rng = np.random.default_rng(0)
    folder = root / task
    folder.mkdir(parents=True)
    meta = {
        "task": task,
        "n_items": n,
        "primary_metric": "exact_match_flexible",
        **META,
        "settings": {"max_new_tokens": 256, "handoff_tokens": 1, "prompting": "zero-shot chat"},
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    truth = {}
    shift = {"base": 0.5, "full-ft": 0.0, "naive": 0.08, "prefillshare": 0.01}
    acc = {"base": 0.1, "full-ft": 0.5, "naive": 0.3, "prefillshare": 0.45}
    base_nll = rng.uniform(0.8, 1.2, n)
    for mode in modes:
        nll = base_nll + shift[mode] + rng.normal(0, 0.02, n)
        em = (rng.uniform(0, 1, n) < acc[mode]).astype(float)
        keep = n - (missing if mode == "prefillshare" else 0)
        recs = [
            {
                "id": f"{task}/{i}",
                "index": i,
                "nll": float(nll[i]),
                "nll_sum": float(nll[i]) * 10,
                "nll_tokens": 10,
                "text": "x",
                "finish_reason": "eos",
                "scores": {"exact_match_flexible": float(em[i]), "exact_match_strict": 0.0},
            }
            for i in range(keep)
        ]
        (folder / f"items.{mode}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        truth[mode] = recs
    return folder, truth


def _sweep_folder(root):
    rng = np.random.default_rng(1)
    n = 12
    ids = [f"toy/{i}" for i in range(n)]
    ref = rng.uniform(1, 2, n)
    points = [
        {"label": "full-ft", "over": None, "rho": None, "ids": ids, "nll": list(ref)},
        {"label": "base", "over": None, "rho": None, "ids": ids, "nll": list(ref + 0.5)},
    ]
    for label, slope in (("naive", 0.3), ("prefillshare", 0.02)):
        for over in ("positions", "layers"):
            for rho in (0.0, 0.25, 0.5, 0.75, 1.0):
                points.append(
                    {
                        "label": label,
                        "over": over,
                        "rho": rho,
                        "ids": ids,
                        "nll": list(ref + slope * rho + rng.normal(0, 0.01, n)),
                        "gen_ids": ids[:4],
                        "scores": [{"acc": float(i % 2)} for i in range(4)],
                    }
                )
    meta = {"kind": "ccft-sweep", "task": "toy", "n_items": n, "num_layers": 30, **META}
    s = summarize_sweep(meta, points, n_resamples=500)
    (root / "sweep").mkdir()
    (root / "sweep" / "sweep.json").write_text(json.dumps(s))
    return s


def test_report_tables_deltas_plots_and_json(tmp_path):
    folder, truth = _eval_folder(tmp_path / "runs")
    sweep = _sweep_folder(tmp_path / "runs")
    rep = build_report([str(tmp_path / "runs")], tmp_path / "out")
    md = (tmp_path / "out" / "README.md").read_text()
    js = json.loads((tmp_path / "out" / "report.json").read_text())
    assert js["headline"] == rep["headline"] and len(rep["headline"]) == 4
    for row in rep["headline"]:
        mode = row["mode"]
        nll = [r["nll"] for r in truth[mode]]
        em = [r["scores"]["exact_match_flexible"] for r in truth[mode]]
        assert row["nll"] == pytest.approx(float(np.mean(nll)))
        assert row["nll_ci"] == pytest.approx(list(mean_ci(nll)["ci"]))
        assert (
            row["score"] == pytest.approx(float(np.mean(em)))
            and row["primary_metric"] == "exact_match_flexible"
        )
        assert (row["model"], row["data"], row["hardware"], row["n"]) == (
            META["model"],
            META["data"],
            META["hardware"],
            40,
        )
        if mode != "full-ft":
            d = paired_bootstrap_delta(nll, [r["nll"] for r in truth["full-ft"]])
            assert row["delta_vs_full_ft"]["nll"]["delta"] == pytest.approx(d["delta"])
            assert row["delta_vs_full_ft"]["nll"]["ci"] == pytest.approx(list(d["ci"]))
            # the Markdown shows the same numbers
            assert f"{d['delta']:+.4f} [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]" in md
    naive = rep["headline"][2]["delta_vs_full_ft"]["nll"]
    assert naive["ci"][0] > 0  # naive sharing is worse than Full-FT on these rows, and the CI says so
    # every number names model (with quantisation), data, n and hardware
    assert (
        "Q4_1 weights dequantised to fp32" in md
        and META["data"] in md
        and "n = 40" in md
        and META["hardware"] in md
    )
    assert (
        "| gsm8k | naive | exact_match_flexible |" in md
        and "### gsm8k" in md
        and "### Sharing sweep: toy" in md
    )
    # plots: one per task + the sweep, real PNGs referenced from the Markdown
    assert set(rep["plots"].values()) == {"gsm8k.png", "sweep.png"}
    for fn in rep["plots"].values():
        data = (tmp_path / "out" / fn).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000 and f"]({fn})" in md
    # the sweep table: one row per point with the paired delta vs full-ft's own prefill
    assert len(js["sweeps"][0]["points"]) == len(sweep["points"]) == 22
    row = next(p for p in sweep["points"] if (p["label"], p["over"], p["rho"]) == ("naive", "layers", 1.0))
    assert f"| naive | Full-FT decoder | layers | 1 | {row['nll']:.4f}" in md
    assert row["delta_nll_vs_full_ft"]["delta"] == pytest.approx(0.3, abs=0.02)
    assert row["metrics"]["acc"]["mean"] == pytest.approx(0.5)


def test_incomplete_runs_report_their_n_and_pair_only_common_items(tmp_path):
    _, truth = _eval_folder(tmp_path / "runs", n=20, missing=5)
    rep = build_report([str(tmp_path / "runs")], tmp_path / "out")
    ps = next(r for r in rep["headline"] if r["mode"] == "prefillshare")
    assert ps["n"] == 15 and ps["delta_vs_full_ft"]["nll"]["n"] == 15
    d = paired_bootstrap_delta(
        [r["nll"] for r in truth["prefillshare"]], [r["nll"] for r in truth["full-ft"][:15]]
    )
    assert ps["delta_vs_full_ft"]["nll"]["delta"] == pytest.approx(d["delta"])
    assert "15 (incomplete)" in (tmp_path / "out" / "README.md").read_text()


def test_demo_results_json_is_accepted(tmp_path):
    per_row = {
        m: {
            "nll_rows": [1.0 + 0.1 * i + off for i in range(6)],
            "em_strict_rows": [True, False] * 3,
            "em_flexible_rows": [True] * 6,
        }
        for m, off in (("full-ft", 0.0), ("naive", 0.05))
    }
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "results.json").write_text(
        json.dumps(
            {
                "model": META["model"],
                "hardware": META["hardware"],
                "data": {"eval_nll": "GSM8K test, first 6 rows"},
                "modes": {},
                "per_row": per_row,
            }
        )
    )
    rep = build_report([str(tmp_path / "demo")], tmp_path / "out")
    naive = next(r for r in rep["headline"] if r["mode"] == "naive")
    assert naive["delta_vs_full_ft"]["nll"]["delta"] == pytest.approx(0.05)
    assert naive["score"] == 1.0 and naive["data"] == "GSM8K test, first 6 rows"


def test_cli_report_and_errors(tmp_path, capsys):
    from ccft.cli.main import main

    _eval_folder(tmp_path / "runs", task="toy", n=8)
    assert main(["report", str(tmp_path / "runs"), "-o", str(tmp_path / "rep")]) == 0
    assert "1 task(s), 0 sweep(s)" in capsys.readouterr().out
    assert (tmp_path / "rep" / "toy.png").read_bytes().startswith(PNG)
    assert main(["report", str(tmp_path / "nothing"), "-o", str(tmp_path / "rep2")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no results"):
        build_report([str(tmp_path / "empty")], tmp_path / "rep3")


def test_headline_and_legacy_tables_keep_working():
    summary = {
        "task": "t",
        "meta": {**META, "n_items": 2, "primary_metric": "acc"},
        "modes": {
            "full-ft": {
                "n": 2,
                "nll": 1.0,
                "nll_ci": [0.9, 1.1],
                "metrics": {"acc": {"mean": 0.5, "ci": [0.0, 1.0], "n": 2}},
            }
        },
        "deltas_vs_full_ft": {},
    }
    table = headline_table([summary])
    assert "| t | full-ft | acc | 50.0% [0.0, 100.0] |  | 1.0000 [0.9000, 1.1000] |  | 2 | [1] |" in table
    assert "[1] model: SmolLM2-135M-Instruct, Q4_1 weights dequantised to fp32; data:" in table
    legacy = {
        "modes": {
            "full-ft": {"nll": 1.0, "nll_ci": [0.9, 1.1], "n": 3},
            "naive": {"nll": 1.2, "nll_ci": [1.0, 1.3], "n": 3},
        },
        "deltas_vs_full_ft": {"naive": {"nll": {"delta": 0.2, "ci": [0.1, 0.3]}}},
    }
    assert "| naive | +0.2000 [+0.1000, +0.3000] |" in modes_table(legacy)
    assert isinstance(reading(legacy), str)


def test_deltas_table_names_the_pairs_behind_nll_and_scores():
    """NLL on 100 items, generations scored on the first 50 (generate_limit): the n pairs cell says both."""
    block = {
        "nll": 1.0,
        "nll_ci": [0.9, 1.1],
        "n": 100,
        "metrics": {"em": {"mean": 0.1, "ci": [0.0, 0.2], "n": 50}},
    }
    summary = {
        "meta": {"primary_metric": "em"},
        "modes": {"full-ft": block, "naive": block},
        "deltas_vs_full_ft": {
            "naive": {
                "nll": {"delta": 0.2, "ci": [0.1, 0.3], "n": 100},
                "em": {"delta": 0.0, "ci": [-0.1, 0.1], "n": 50},
            }
        },
    }
    assert modes_table(summary).splitlines()[-1].endswith("| 100 (NLL), 50 (scored) |")
    summary["deltas_vs_full_ft"]["naive"]["em"]["n"] = 100
    assert modes_table(summary).splitlines()[-1].endswith("| 100 |")


def test_hardware_line_names_the_cpu_vector_instructions_and_threads(monkeypatch):
    # two machines with the same CPU model name ran the study 1.7x apart; the line must tell them apart
    import torch

    from ccft.evals.results import hardware

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    line = hardware()
    assert "(AVX512)" in line and f"using {torch.get_num_threads()} threads" in line
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert "(AVX2)" in hardware()
