"""The study's report: ``report.json`` from the runner's summaries, and ``README.md`` rendered from the
template ``ccft/evals/templates/study_README.md``."""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from importlib import resources

from ccft.core.modes import REFERENCE_MODE
from ccft.evals.study.config import StudyConfig, metrics_of

__all__ = [
    "PRIMARY_MEANING",
    "SECONDARY_MEANING",
    "build_study_report",
    "full_ft_beats_base",
    "study_reading",
    "study_readme",
    "task_entry",
]


#: what each secondary metric means, for reports
SECONDARY_MEANING = {
    "answer_format": "share of answers in GSM8K's `#### N` form (right or wrong)",
    "compiles": "share of programs (prompt + completion) that parse as Python and define the entry point",
    "offered_call": "share of outputs that parse as a call to one of the item's offered functions",
}
PRIMARY_MEANING = {
    "exact_match_flexible": "exact match (flexible extraction: last number)",
    "passed": "pass@1 (greedy, tests run in the sandbox)",
    "accuracy": "BFCL AST accuracy (bfcl-eval's checker)",
}


def _metric(mode_block: dict, key: str | None) -> tuple[float | None, list | None]:
    if key is None:
        return None, None
    m = (mode_block.get("metrics") or {}).get(key)
    return (m["mean"], m["ci"]) if m else (None, None)


def _delta(deltas: dict, key: str | None) -> tuple[float | None, list | None]:
    if key is None or key not in deltas:
        return None, None
    return deltas[key]["delta"], deltas[key]["ci"]


def task_entry(summary: dict, specialist: str) -> dict:
    """One task of ``report.json`` from the runner's ``summary.json`` (see the module docstring)."""
    task = summary["task"]
    primary, secondary = metrics_of(task)
    modes = {}
    for mode, block in summary["modes"].items():
        score, score_ci = _metric(block, primary)
        sec, sec_ci = _metric(block, secondary)
        modes[mode] = {
            "score": score,
            "score_ci": score_ci,
            "secondary": sec,
            "secondary_ci": sec_ci,
            "nll": block.get("nll"),
            "nll_ci": block.get("nll_ci"),
            "n": block.get("n"),
            "scored_n": block.get("scored_n"),
            "truncated": block.get("truncated"),
        }
    paired = {}
    for mode, d in (summary.get("deltas_vs_full_ft") or {}).items():
        score, score_ci = _delta(d, primary)
        sec, sec_ci = _delta(d, secondary)
        nll, nll_ci = _delta(d, "nll")
        paired[mode] = {
            "score": score,
            "score_ci": score_ci,
            "secondary": sec,
            "secondary_ci": sec_ci,
            "nll": nll,
            "nll_ci": nll_ci,
        }
    ref = modes.get(REFERENCE_MODE, {})
    retention = {}
    for mode in ("prefillshare", "naive"):
        if mode in modes:
            retention[mode] = {
                k: (modes[mode][k] / ref[k] if ref.get(k) and modes[mode][k] is not None else None)
                for k in ("score", "secondary")
            }
    n = max((b["n"] or 0) for b in modes.values()) if modes else 0
    meta = summary.get("meta") or {}
    settings = meta.get("settings") or {}
    return {
        "task": task,
        "specialist": specialist,
        "primary_metric": primary,
        "secondary_metric": secondary,
        "n": n,
        "settings": {
            k: settings.get(k)
            for k in ("limit", "max_new_tokens", "prompting", "decode_path")
            + (("block_weights",) if "block_weights" in settings else ())  # only when recorded
        },
        "data": meta.get("data"),
        "modes": modes,
        "paired_vs_full_ft": paired,
        "retention": retention,
    }


def _excludes_zero(ci, sign: int) -> bool:
    """CI (of base − full-ft) entirely on the side ``sign`` (−1: below zero, +1: above)."""
    if not ci or ci[0] is None:
        return False
    return ci[1] < 0 if sign < 0 else ci[0] > 0


def full_ft_beats_base(entry: dict) -> dict:
    """Does Full-FT beat base on this task with a paired 95% CI that excludes 0? Per metric (primary,
    secondary: higher is better; NLL: lower is better)."""
    d = entry["paired_vs_full_ft"].get("base") or {}
    return {
        "score": _excludes_zero(d.get("score_ci"), -1),
        "secondary": _excludes_zero(d.get("secondary_ci"), -1),
        "nll": _excludes_zero(d.get("nll_ci"), +1),
    }


def build_study_report(
    cfg: StudyConfig,
    summaries: Mapping[str, list[dict]],
    *,
    specialists_meta: dict,
    sweeps: Mapping[str, dict],
    serving: dict | None,
    phases: dict,
    hardware: str,
    model: str,
) -> dict:
    """``report.json`` (see the module docstring and docs/study.md)."""
    tasks = [task_entry(s, spec) for spec, ss in summaries.items() for s in ss]
    resolved = {}
    for spec in summaries:
        entries = [t for t in tasks if t["specialist"] == spec]
        resolved[spec] = {t["task"]: full_ft_beats_base(t) for t in entries}
    return {
        "kind": "ccft-study",
        "config": cfg.source,
        "suite": cfg.suite,
        "model": model,
        "hardware": hardware,
        "modes": cfg.modes,
        "phase_seconds": phases.get("phase_seconds", {}),
        "sittings": phases.get("sittings"),
        "load_average": phases.get("load_average", {}),
        "specialists": specialists_meta,
        "tasks": tasks,
        "full_ft_beats_base": resolved,
        "sweeps": {
            k: ({kk: vv for kk, vv in v.items() if kk != "per_item"} if v else v) for k, v in sweeps.items()
        },
        "serving": serving,
        "metrics": {"primary": PRIMARY_MEANING, "secondary": SECONDARY_MEANING},
    }


def _pct(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _ci_pct(ci) -> str:
    return "" if not ci or ci[0] is None else f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _pp(x, ci) -> str:
    if x is None:
        return "–"
    return f"{100 * x:+.1f}pp" + ("" if not ci else f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]")


def _nll(x, ci=None) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" + ("" if not ci else f" [{ci[0]:.3f}, {ci[1]:.3f}]")


def _dnll(x, ci) -> str:
    if x is None:
        return "–"
    return f"{x:+.4f}" + ("" if not ci else f" [{ci[0]:+.4f}, {ci[1]:+.4f}]")


def _table(report: dict, value: str, fmt_abs, fmt_delta) -> list[str]:
    modes = report["modes"]
    lines = ["| specialist | task | n | " + " | ".join(modes) + " |", "|---|---|---|" + "---|" * len(modes)]
    for t in report["tasks"]:
        key = {"score": "primary_metric", "secondary": "secondary_metric", "nll": None}[value]
        if key and t[key] is None:
            continue
        cells = []
        for m in modes:
            b = t["modes"].get(m)
            if b is None:
                cells.append("–")
                continue
            cell = fmt_abs(b[value], b[f"{value}_ci"])
            d = t["paired_vs_full_ft"].get(m)
            if d is not None and d.get(value) is not None:
                cell += f"<br>Δ {fmt_delta(d[value], d[f'{value}_ci'])}"
            cells.append(cell)
        name = t["task"] + (f" ({t[key]})" if key else "")
        lines.append(f"| {t['specialist']} | {name} | {t['n']} | " + " | ".join(cells) + " |")
    return lines


def _resolved_word(ci, sign_good: int) -> str:
    if not ci or ci[0] is None:
        return "not measured"
    if ci[0] > 0:
        return "CI above 0" if sign_good > 0 else "CI above 0 (worse)"
    if ci[1] < 0:
        return "CI below 0 (worse)" if sign_good > 0 else "CI below 0"
    return "CI includes 0"


def study_reading(report: dict) -> str:
    """The per-specialist reading of the tables, generated from the numbers (no hand-written claims)."""
    out = []
    for spec in report["specialists"]:
        entries = [t for t in report["tasks"] if t["specialist"] == spec and t["modes"].get("full-ft")]
        if not entries:
            continue
        lines = [f"**{spec}**"]
        for t in entries:
            d = t["paired_vs_full_ft"]
            parts = []
            for label, key, pct in (
                ("primary", "score", True),
                ("secondary", "secondary", True),
                ("NLL/token", "nll", False),
            ):
                if t["modes"]["full-ft"].get(key) is None:
                    continue
                bits = []
                for mode in ("base", "naive", "prefillshare"):
                    x = (d.get(mode) or {}).get(key)
                    ci = (d.get(mode) or {}).get(f"{key}_ci")
                    if x is None:
                        continue
                    val = _pp(x, ci) if pct else _dnll(x, ci)
                    bits.append(f"{mode} {val} ({_resolved_word(ci, +1 if pct else -1)})")
                parts.append(f"{label}: " + "; ".join(bits))
            nd, pd = (d.get("naive") or {}).get("nll"), (d.get("prefillshare") or {}).get("nll")
            rec = ""
            if nd and pd is not None and nd > 0:
                rec = f" CCFT recovers {100 * (1 - pd / nd):.0f}% of the naive-sharing NLL gap."
            lines.append(f"- {t['task']} (n={t['n']}), Δ vs full-ft — " + " | ".join(parts) + "." + rec)
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _ratio(retention: dict, mode: str, key: str) -> str:
    v = (retention.get(mode) or {}).get(key)
    return "–" if v is None else f"{v:.2f}"


def _sweep_row(pts: dict, rhos: list, label: str) -> str:
    return " | ".join(_nll(pts[(label, r)].get("nll")) if (label, r) in pts else "–" for r in rhos)


def _loss(value) -> str:
    """A final train loss for the README: 3 decimals, or "not logged" (no ``loss`` entry in the log history:
    ``logging_steps`` above ``max_steps``)."""
    return "not logged" if value is None else f"{value:.3f}"


def study_readme(report: dict, command: str, sittings_notes: str | None = None) -> str:
    """``README.md`` of ``reports/study/``: setup, the headline tables, retention, sweeps, serving, reading,
    rendered from the template ``ccft/evals/templates/study_README.md`` (``string.Template`` fields).

    Args:
        sittings_notes: the text of ``OUT/SITTINGS.md`` when present: what the person who ran the study wrote
            about each sitting (pauses, other jobs on the CPU, thread counts). Quoted verbatim under its own
            heading, marked as written by hand, so a regenerated README never loses it.
    """
    ps = report["phase_seconds"]
    total = sum(ps.values())
    specs = []
    for name, s in report["specialists"].items():
        tr = s.get("training", {})
        loss = {m: _loss(tr.get("final_loss", {}).get(m)) for m in ("ccft", "full-ft")}
        specs.append(
            f"- **{name}**: recipe `{s['recipe']}` with {s.get('overrides') or 'no overrides'}; "
            f"{tr.get('train_rows')} rows ({tr.get('train_data')}), {tr.get('steps')} steps, "
            f"final train loss ccft {loss['ccft']}, full-ft {loss['full-ft']}; runs "
            f"`{s['runs']['ccft']}`, `{s['runs']['full-ft']}`"
        )
    retention = [
        "| specialist | task | prefillshare ÷ full-ft (primary) | naive ÷ full-ft (primary) | "
        "prefillshare ÷ full-ft (secondary) | naive ÷ full-ft (secondary) |",
        "|---|---|---|---|---|---|",
    ]
    for t in report["tasks"]:
        cells = [
            _ratio(t["retention"], mode, k)
            for k in ("score", "secondary")
            for mode in ("prefillshare", "naive")
        ]
        retention.append(f"| {t['specialist']} | {t['task']} | " + " | ".join(cells) + " |")
    resolved = []
    for spec, per_task in report["full_ft_beats_base"].items():
        parts = []
        for task, r in per_task.items():
            which = [k for k in ("score", "secondary", "nll") if r[k]]
            parts.append(f"{task}: {', '.join(which) if which else 'none'}")
        resolved.append(f"- {spec}: " + "; ".join(parts))
    sweeps = []
    for spec, sw in report["sweeps"].items():
        if not sw:
            continue
        pts = {(p["label"], p["rho"]): p for p in sw.get("points", []) if p.get("over") == "positions"}
        rhos = sorted({r for _, r in pts})
        sweeps.append(
            f"**{spec}** ({sw['meta']['task']}, n={sw['meta']['n_items']}; NLL/token over ρ = "
            f"{', '.join(str(r) for r in rhos)} of prompt positions shared):\n\n"
            "| curve | "
            + " | ".join(f"ρ={r}" for r in rhos)
            + " |\n|---|"
            + "---|" * len(rhos)
            + "\n"
            + "\n".join(
                f"| {label} | {_sweep_row(pts, rhos, label)} |" for label in ("naive", "prefillshare")
            )
            + "\n"
        )
    serving = report.get("serving") or {}
    serving_md = serving.get("markdown") or "Not run in this report."
    done = sorted({t["specialist"] for t in report["tasks"]})
    partial = (
        ""
        if report.get("complete", True)
        else (
            f"> **Partial report**: finished specialists: {', '.join(done) or 'none'}. The study resumes "
            f"where it stopped; rerun `{command}` to continue.\n\n"
        )
    )
    fields = {
        "partial": partial,
        "command": command,
        "sittings": report["sittings"],
        "model": report["model"],
        "hardware": report["hardware"],
        "phase_seconds": ", ".join(f"{k} {v:.0f}" for k, v in ps.items()),
        "total_s": f"{total:.0f}",
        "total_min": f"{total / 60:.0f}",
        "load_average": ", ".join(f"{k} {v}" for k, v in report["load_average"].items()),
        "sittings_block": _sittings_block(sittings_notes),
        "specialists": "\n".join(specs),
        "primary_meaning": "; ".join(f"`{k}` = {v}" for k, v in report["metrics"]["primary"].items()),
        "primary_table": "\n".join(_table(report, "score", lambda x, ci: _pct(x) + _ci_pct(ci), _pp)),
        "secondary_meaning": "; ".join(f"`{k}` = {v}" for k, v in report["metrics"]["secondary"].items()),
        "secondary_table": "\n".join(_table(report, "secondary", lambda x, ci: _pct(x) + _ci_pct(ci), _pp)),
        "nll_table": "\n".join(_table(report, "nll", _nll, _dnll)),
        "retention": "\n".join(retention),
        "resolved": "\n".join(resolved),
        "sweeps": "\n".join(sweeps) if sweeps else "Not run.",
        "serving": serving_md,
        "reading": study_reading(report),
    }
    template = (resources.files("ccft.evals") / "templates" / "study_README.md").read_text(encoding="utf-8")
    return string.Template(template).substitute(fields)


def _sittings_block(notes: str | None) -> str:
    if not notes or not notes.strip():
        return ""
    quoted = "\n".join(f"> {line}".rstrip() for line in notes.strip().splitlines())
    return (
        "## Sittings (notes written by hand in `SITTINGS.md`, not generated)\n\n"
        "The phase times above are wall time; these notes say what else shared the machine.\n\n"
        f"{quoted}\n\n"
    )
