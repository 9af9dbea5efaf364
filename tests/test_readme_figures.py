"""Every figure README.md quotes from a committed report or benchmark JSON equals that JSON.

Each row of ``FIGURES`` is a README snippet with ``{}`` where the figure goes, the JSON file it comes from and
how the figure is read and rounded there. The test formats the JSON's value into the snippet and asks for the
result in README.md, so a README figure edited to differ from its JSON (or a JSON regenerated with another
value) fails here.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@cache
def _json(rel: str):
    return json.loads((ROOT / rel).read_text())


def _num(x: float, fmt: str) -> str:
    """``format(x, fmt)`` with the README's typographic minus."""
    return format(x, fmt).replace("-", "−")


def _pp(d: dict) -> str:
    """A paired difference of a rate in points: ``+6.0 pp [+2.0, +11.0]``."""
    lo, hi = (_num(100 * c, "+.1f") for c in d["ci"])
    return f"{_num(100 * d['delta'], '+.1f')} pp [{lo}, {hi}]"


def _study_pp(block: dict, key: str = "score") -> str:
    """``_pp`` of a study report's ``{key, key_ci}`` block."""
    return _pp({"delta": block[key], "ci": block[f"{key}_ci"]})


def _dnll(d: dict) -> str:
    return f"{_num(d['delta'], '+.4f')} [{_num(d['ci'][0], '+.4f')}, {_num(d['ci'][1], '+.4f')}]"


def _cbase(rel: str, run: str) -> int:
    """Peak C_base bytes of one run of a serving benchmark (``kv.RUN.cbase_bytes``)."""
    return _json(rel)["kv"][run]["cbase_bytes"]


def _task(report: str, spec: str, task: str) -> dict:
    return next(t for t in _json(report)["tasks"] if t["specialist"] == spec and t["task"] == task)


def _point(spec: str, label: str) -> dict:
    fr = _json("reports/frontier/report.json")["frontier"]["specialists"][spec][0]
    return next(p for p in fr["points"] if p["label"] == label)


def _session_ratios() -> list[float]:
    """native m = 0 ÷ int8 (native-trained) KV bytes of one session, every task and agent count."""
    out = []
    for spec in ("code", "tools"):
        a, b = _point(spec, "prefillshare m=0"), _point(spec, "prefillshare int8 (native-trained)")
        out += [a["kv_bytes"][n] / b["kv_bytes"][n] for n in a["kv_bytes"]]
    return out


DEMO = "reports/demo/results.json"
STUDY = "reports/study/report.json"
FRONTIER = "reports/frontier/report.json"
SAME = "benchmarks/results/serve_kv_smollm2_int8_same_prompt.json"
OWN = "benchmarks/results/serve_kv_smollm2_int8_own_prompts.json"
MPLE = "reports/multipl-e/report.json"

#: (README snippet with {} for the figure, JSON file, the figure as the README writes it)
FIGURES = [
    (
        "{} of phases",
        DEMO,
        lambda: "{}:{:02d}".format(*divmod(round(_json(DEMO)["phase_seconds"]["total"]), 60)),
    ),
    (
        "(training {} s, evaluation",
        DEMO,
        lambda: " + ".join(f"{_json(DEMO)['phase_seconds'][k]:.0f}" for k in ("train_ccft", "train_full_ft")),
    ),
    (
        "evaluation {} s; `reports/demo/results.json`",
        DEMO,
        lambda: f"{_json(DEMO)['phase_seconds']['eval']:.0f}",
    ),
    (
        "PrefillShare − naive {} NLL/token (`reports/demo/results.json`",
        DEMO,
        lambda: _dnll(_json(DEMO)["prefillshare_vs_naive"]["nll"]),
    ),
    (
        'BFCL "multiple" accuracy {} (`reports/study/report.json`, `paired_prefillshare_vs_naive`)',
        STUDY,
        lambda: _study_pp(_task(STUDY, "tools", "bfcl-multiple")["paired_prefillshare_vs_naive"]),
    ),
    (
        "every mode stays at\n0–{}%",
        MPLE,
        lambda: f"{max(100 * m['score'] for t in _json(MPLE)['tasks'] for m in t['modes'].values()):.0f}",
    ),
    (
        "(code {}, tools",
        FRONTIER,
        lambda: _study_pp(_task(FRONTIER, "code", "humaneval")["paired_vs_full_ft"]["prefillshare"]),
    ),
    (
        "tools {}); paired against m = 0",
        FRONTIER,
        lambda: _study_pp(_task(FRONTIER, "tools", "bfcl-multiple")["paired_vs_full_ft"]["prefillshare"]),
    ),
    (
        "(m = 8: {}). The int8",
        FRONTIER,
        lambda: _dnll(_point("code", "prefillshare m=8")["paired_vs_m0"]["nll"]),
    ),
    (
        "small resolved NLL on tools ({} served to the m = 0 decoder)",
        FRONTIER,
        lambda: _dnll(_point("tools", "prefillshare int8 (native-trained)")["paired_vs_m0"]["nll"]),
    ),
    (
        "the shared part is {}× smaller than fp32 where the agents send one prompt",
        SAME,
        lambda: f"{_cbase(SAME, 'shared_ref') / _cbase(SAME, 'shared'):.2f}",
    ),
    (
        "a whole session's KV {}× smaller in the frontier's memory",
        FRONTIER,
        lambda: f"{min(_session_ratios()):.1f}–{max(_session_ratios()):.1f}",
    ),
    (
        "holds {}× the native C_base's bytes",
        OWN,
        lambda: (
            f"{_json(OWN)['kv']['shared']['cbase_bytes'] / _json(OWN)['kv']['shared_ref']['cbase_bytes']:.2f}"
        ),
    ),
    (
        "at\n{}× its throughput",
        OWN,
        lambda: f"{_json(OWN)['variant_cost_at_saturation']['throughput_vs_ref']:.2f}",
    ),
]


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("snippet,source,figure", FIGURES, ids=[f[0][:40] for f in FIGURES])
def test_readme_figure_equals_its_json(snippet, source, figure):
    want = snippet.format(figure())
    assert want in _readme(), f"README.md should say {want!r} (the figure from {source})"


def test_readme_names_the_json_of_each_figure():
    text = _readme()
    for rel in sorted({src for _, src, _ in FIGURES}):
        assert rel in text or Path(rel).parent.as_posix() + "/" in text, f"README.md does not name {rel}"


def test_an_edited_figure_fails(monkeypatch):
    snippet, _, figure = FIGURES[4]
    edited = _readme().replace(snippet.format(figure()), snippet.format("+7.0 pp [+2.0, +11.0]"))
    monkeypatch.setattr(sys.modules[__name__], "_readme", lambda: edited)
    with pytest.raises(AssertionError):
        test_readme_figure_equals_its_json(snippet, "x", figure)
