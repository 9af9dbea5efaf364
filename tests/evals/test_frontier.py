"""The sharing-depth frontier (``ccft.evals.study.frontier``; issue 35, items 5–6): the memory model's known
answers, the points' statistics against the stats module on hand-made records, the config's errors, and a
tiny study that trains a CCFT decoder at depth 1 and reports the frontier (resumable)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ccft.core.errors import ConfigError
from ccft.evals.stats import mean_ci, paired_bootstrap_delta
from ccft.evals.study.frontier import (
    choose_depth,
    frontier_markdown,
    frontier_points,
    parse_frontier,
    session_kv_bytes,
    session_prefill_layer_tokens,
)
from conftest import TINY_RECIPE, make_tiny_folder

ROOT = Path(__file__).resolve().parents[2]


def test_memory_model_known_answers():
    # L = 30 layers, a 100-token shared prompt, 10 tokens per agent, N = 4, 1,536 bytes per layer-token
    kw = dict(layers=30, agents=4, prompt_tokens=100, own_tokens=10, bytes_per_layer_token=1536)
    assert session_kv_bytes(depth=None, **kw) == 4 * 110 * 30 * 1536  # every agent its own prefill
    assert session_kv_bytes(depth=0, **kw) == (100 * 30 + 4 * 10 * 30) * 1536  # Eq. 9: C_base once
    assert session_kv_bytes(depth=2, **kw) == (100 * 30 + 4 * 100 * 2 + 4 * 10 * 30) * 1536
    # m = L keeps C_base and every agent's full prompt KV: more than no sharing by exactly C_base
    assert session_kv_bytes(depth=30, **kw) - session_kv_bytes(depth=None, **kw) == 100 * 30 * 1536
    # a compact C_base (int8 codes + scales, about 1/3.93 of fp32) scales only C_base's term
    assert session_kv_bytes(depth=0, cbase_ratio=0.25, **kw) == (100 * 30 * 0.25 + 4 * 10 * 30) * 1536
    with pytest.raises(ConfigError, match="depth m=31 outside 0..30"):
        session_kv_bytes(depth=31, **kw)
    p = dict(layers=30, agents=4, prompt_tokens=100)
    assert session_prefill_layer_tokens(depth=None, **p) == 12000
    assert session_prefill_layer_tokens(depth=0, **p) == 3000
    assert session_prefill_layer_tokens(depth=2, **p) == 100 * (30 + 8)


def _rec(i, acc, nll, new_tokens=5, prompt_tokens=20):
    return {
        "id": f"q{i}",
        "index": i,
        "nll": nll,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "scores": {"exact_match_flexible": acc, "answer_format": acc},
    }


def test_points_are_the_stats_of_the_items():
    full = [1, 1, 0, 1, 1, 0, 1, 1]
    naive = [0, 0, 0, 1, 0, 0, 0, 1]
    ps0 = [1, 0, 0, 1, 0, 0, 1, 1]
    ps2 = [1, 1, 0, 1, 1, 0, 1, 0]
    nll = {"full-ft": 0.5, "naive": 1.5, "prefillshare m=0": 0.9, "prefillshare m=2": 0.6}
    accs = {"full-ft": full, "naive": naive, "prefillshare m=0": ps0, "prefillshare m=2": ps2}
    records = {
        label: {f"q{i}": _rec(i, a, nll[label] + 0.01 * i) for i, a in enumerate(xs)}
        for label, xs in accs.items()
    }
    records["naive"]["extra"] = _rec(99, 1, 0.1)  # an item only one point has: left out of every point
    f = frontier_points(
        "gsm8k",
        records,
        metrics=("exact_match_flexible", "answer_format"),
        layers=4,
        bytes_per_layer_token=100,
        agents=[2],
        n_resamples=300,
        seed=1,
    )
    assert f["n"] == 8 and f["primary_metric"] == "exact_match_flexible" and f["prompt_tokens"] == 20
    assert [p["label"] for p in f["points"]] == ["naive", "prefillshare m=0", "prefillshare m=2", "full-ft"]
    by = {p["label"]: p for p in f["points"]}
    for label, xs in accs.items():
        s = mean_ci(xs, n_resamples=300, seed=1)
        assert by[label]["primary"] == pytest.approx(s["mean"]) and by[label]["primary_ci"] == list(s["ci"])
    d = paired_bootstrap_delta(ps2, full, n_resamples=300, seed=1)
    assert by["prefillshare m=2"]["paired_vs_full_ft"]["primary"] == {
        "delta": d["delta"],
        "ci": list(d["ci"]),
    }
    assert by["prefillshare m=2"]["paired_vs_full_ft"]["nll"]["delta"] == pytest.approx(0.1)
    assert by["full-ft"]["paired_vs_full_ft"] == {}
    assert by["prefillshare m=2"]["retention"] == pytest.approx(5 / 6)
    # memory: P = 20, U = 5, L = 4, N = 2, 100 bytes per layer-token
    assert by["full-ft"]["kv_bytes"]["2"] == 2 * 25 * 4 * 100
    assert by["prefillshare m=2"]["kv_bytes"]["2"] == (20 * 4 + 2 * 20 * 2 + 2 * 5 * 4) * 100
    assert by["naive"]["prefill_layer_tokens"]["2"] == 20 * 4
    # the smallest depth meeting the target, and how sure
    assert choose_depth(f, 0.8) == {
        "depth": 2,
        "retention": pytest.approx(5 / 6),
        "confidence": "resolved" if d["ci"][0] >= -0.2 * (6 / 8) else "point estimate only",
        "target": 0.8,
    }
    assert choose_depth(f, 0.9)["depth"] is None
    md = frontier_markdown({"math": [f]})
    assert "| prefillshare m=2 | 2 | native | 62.5 |" in md and "KV MB (N=2)" in md


@pytest.mark.parametrize(
    "raw, match",
    [
        ([1, 2], "frontier must be a mapping"),
        ({"depth": [1]}, r"unknown key\(s\) \['depth'\]"),
        ({"depths": [0, 1]}, "each depth once and ≥ 1"),
        ({"depths": ["1"]}, "list of integers"),
        ({"depths": [1], "specialists": ["chess"]}, r"\['chess'\] are not specialists of this study"),
        ({"depths": [1], "agents": [0]}, "agent counts ≥ 1"),
        ({"depths": [1], "target_retention": 1.5}, "target_retention=1.5"),
        ({"depths": [1], "cache_formats": ["native"]}, r"frontier.cache_formats=\['native'\]"),
    ],
)
def test_config_errors_name_the_key(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_frontier(raw, "study.yaml", ["math", "code"])


def test_config_defaults():
    assert (
        parse_frontier(None, "s", ["math"]) is None and parse_frontier({"depths": []}, "s", ["math"]) is None
    )
    assert parse_frontier({"cache_formats": ["int8"]}, "s", ["math"]).cache_formats == ["int8"]
    fc = parse_frontier({"depths": [4, 1]}, "s", ["math", "code"])
    assert (fc.depths, fc.specialists, fc.agents, fc.target_retention) == (
        [1, 4],
        ["math", "code"],
        [4, 8],
        0.95,
    )


STUDY = """runs: {runs}
out: {out}
bootstrap: 200
batch_size: 4
sweep_limit: 0
frontier: {{depths: [1], agents: [2, 4], target_retention: 0.5, cache_formats: [int8]}}
specialists:
  math:
    recipe: {math}
    tasks: {{gsm8k: {{limit: 3, max_new_tokens: 6}}}}
"""


def test_a_tiny_study_reports_the_frontier_and_resumes(tmp_path, tokenizer):
    base = make_tiny_folder(tmp_path / "base", tokenizer, seed=5, scale=30.0)
    (tmp_path / "math.yaml").write_text(TINY_RECIPE.format(base=base, data="gsm8k:train", chat="true"))
    cfg = tmp_path / "study.yaml"
    cfg.write_text(STUDY.format(runs=tmp_path / "runs", out=tmp_path / "out", math=tmp_path / "math.yaml"))
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    import os

    env = dict(os.environ, **env)
    cmd = [sys.executable, "-m", "ccft", "study", str(cfg), "--skip-serving"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    meta = json.loads((tmp_path / "runs" / "math" / "ccft-m1" / "ccft.json").read_text())
    assert meta["share_from_layer"] == 1 and meta["method"] == "ccft"
    (f,) = report["frontier"]["specialists"]["math"]
    by = {p["label"]: p for p in f["points"]}
    int8_labels = ("prefillshare int8 (native-trained)", "prefillshare int8 (int8-trained)")
    assert set(by) == {"full-ft", "naive", "naive m=1", "prefillshare m=0", "prefillshare m=1", *int8_labels}
    # naive sharing at depth 1: the Full-FT decoder reading its own K/V in layer 0, C_base above (no training)
    naive1 = [
        json.loads(x)
        for x in (out / "math" / "frontier" / "naive-m1" / "gsm8k" / "items.naive.jsonl")
        .read_text()
        .splitlines()
    ]
    assert by["naive m=1"]["nll"] == pytest.approx(sum(r["nll"] for r in naive1) / len(naive1))
    assert by["naive m=1"]["depth"] == 1 and by["naive m=1"]["nll"] != by["naive"]["nll"]
    assert not (tmp_path / "runs" / "math" / "full-ft-m1").exists()
    assert f["n"] == 3
    int8_meta = json.loads((tmp_path / "runs" / "math" / "ccft-int8" / "ccft.json").read_text())
    assert int8_meta["cache_format"] == "int8" and int8_meta.get("share_from_layer", 0) == 0
    served = json.loads((out / "math" / "frontier" / "int8-served" / "gsm8k" / "meta.json").read_text())
    assert served["settings"]["cache_format"] == "int8"
    # the compact points hold C_base in int8 codes + bf16 scales: its term of the KV just under 4x smaller
    own, lay, n = f["own_tokens"], f["layers"], 4
    per = by["full-ft"]["kv_bytes"]["4"] / (
        n * (f["prompt_tokens"] + own["full-ft"]) * lay
    )  # bytes/layer-token
    for label in int8_labels:
        assert by[label]["cache_format"] == "int8" and by[label]["depth"] == 0
        assert by[label]["prefill_layer_tokens"] == by["prefillshare m=0"]["prefill_layer_tokens"]
        c_base = by[label]["kv_bytes"]["4"] - n * own[label] * lay * per
        native = by["prefillshare m=0"]["kv_bytes"]["4"] - n * own["prefillshare m=0"] * lay * per
        assert 3.5 < native / c_base < 4.0
    # the m = 1 point is the mean of its own items file; the study's points are the study's numbers
    items = [
        json.loads(x)
        for x in (out / "math" / "frontier" / "m1" / "gsm8k" / "items.prefillshare.jsonl")
        .read_text()
        .splitlines()
    ]
    assert by["prefillshare m=1"]["nll"] == pytest.approx(sum(r["nll"] for r in items) / len(items))
    (task,) = report["tasks"]
    assert by["prefillshare m=0"]["nll"] == pytest.approx(task["modes"]["prefillshare"]["nll"])
    assert by["full-ft"]["nll"] == pytest.approx(task["modes"]["full-ft"]["nll"])
    assert by["prefillshare m=1"]["kv_bytes"]["4"] > by["prefillshare m=0"]["kv_bytes"]["4"]
    assert "frontier_math_train_m1" in report["phase_seconds"]
    readme = (out / "README.md").read_text()
    assert "## Frontier" in readme and "| prefillshare m=1 | 1 | native |" in readme
    assert (out / "math" / "frontier" / "gsm8k.png").is_file()
    # a second run reuses the depth-1 decoder and its items: same numbers
    again = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"reusing finished run {tmp_path / 'runs' / 'math' / 'ccft-m1'}" in again.stdout
    report2 = json.loads((out / "report.json").read_text())
    assert report2["frontier"]["specialists"]["math"] == report["frontier"]["specialists"]["math"]


def test_shipped_frontier_config_parses():
    from ccft.evals.study import load_study_config

    cfg = load_study_config(ROOT / "recipes" / "frontier.yaml")
    assert cfg.frontier.depths == [1, 2, 4, 8] and cfg.frontier.specialists == ["code", "tools"]
    assert cfg.modes == ["full-ft", "naive", "prefillshare"] and cfg.out == "reports/frontier"
    # the study's decoders are reused: same runs folder and training overrides as recipes/study.yaml
    study = load_study_config(ROOT / "recipes" / "study.yaml")
    assert cfg.runs == study.runs
    for name in ("tools", "code"):
        assert cfg.specialists[name].recipe == study.specialists[name].recipe
        assert cfg.specialists[name].train == study.specialists[name].train


def test_shipped_multipl_e_config_parses():
    """recipes/multipl-e.yaml evaluates the study's own code decoders (same runs, recipe and training) on
    every bundled item of its languages, in the four modes, with nothing else (no sweep, no serving)."""
    from ccft.evals.protocol import get_task
    from ccft.evals.study import load_study_config

    cfg = load_study_config(ROOT / "recipes" / "multipl-e.yaml")
    study = load_study_config(ROOT / "recipes" / "study.yaml")
    assert list(cfg.specialists) == ["code"] and cfg.runs == study.runs and cfg.out == "reports/multipl-e"
    assert cfg.specialists["code"].recipe == study.specialists["code"].recipe
    assert cfg.specialists["code"].train == study.specialists["code"].train
    assert cfg.modes == study.modes and cfg.sweep_limit == 0 and cfg.serving == {"enabled": False}
    tasks = cfg.specialists["code"].task_list()
    assert [t for t, _, _ in tasks] == ["multipl-e-cpp", "multipl-e-go", "multipl-e-java"]
    for task, limit, _ in tasks:  # every bundled item: the limit is at least the task's size
        assert len(get_task(task).load(limit)) == len(get_task(task).load(None))
