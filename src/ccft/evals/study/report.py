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


def task_entry(
    summary: dict, specialist: str, records: Mapping | None = None, *, n_resamples: int = 2000, seed: int = 0
) -> dict:
    """One task of ``report.json`` from the runner's ``summary.json`` (see the module docstring).

    ``records`` (mode → item records; default ``summary["records"]`` when the summary carries them) adds
    ``paired_prefillshare_vs_naive``: the paired bootstrap of prefillshare − naive on the same items, computed
    as the deltas against Full-FT are (``ccft.evals.report.paired_difference``)."""
    from ccft.evals.report import paired_difference

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
    per_mode = records if records is not None else summary.get("records")
    vs_naive = None
    if per_mode:
        d = paired_difference(per_mode, "prefillshare", "naive", n_resamples=n_resamples, seed=seed)
        if d:
            vs_naive = {}
            for key, metric in (("score", primary), ("secondary", secondary), ("nll", "nll")):
                x, ci = _delta(d, metric)
                vs_naive[key], vs_naive[f"{key}_ci"] = x, (list(ci) if ci else ci)
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
        **({"paired_prefillshare_vs_naive": vs_naive} if vs_naive is not None else {}),
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
    records: Mapping[str, Mapping[str, Mapping]] | None = None,
) -> dict:
    """``report.json`` (see the module docstring and docs/study.md). ``records``: specialist → task → mode →
    item records, for the paired prefillshare − naive differences (``task_entry``)."""
    tasks = [
        task_entry(
            s,
            spec,
            ((records or {}).get(spec) or {}).get(s["task"]),
            n_resamples=cfg.bootstrap,
            seed=cfg.seed,
        )
        for spec, ss in summaries.items()
        for s in ss
    ]
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
    pair = any(t.get("paired_prefillshare_vs_naive") for t in report["tasks"])
    cols = list(modes) + (["prefillshare − naive (paired)"] if pair else [])
    lines = ["| specialist | task | n | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
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
        if pair:
            d = t.get("paired_prefillshare_vs_naive") or {}
            cells.append("–" if d.get(value) is None else fmt_delta(d[value], d.get(f"{value}_ci")))
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
            pn = t.get("paired_prefillshare_vs_naive") or {}
            pn_bits = [
                f"{label} {(_pp if pct else _dnll)(pn[key], pn.get(f'{key}_ci'))} "
                f"({_resolved_word(pn.get(f'{key}_ci'), +1 if pct else -1)})"
                for label, key, pct in (
                    ("primary", "score", True),
                    ("secondary", "secondary", True),
                    ("NLL/token", "nll", False),
                )
                if pn.get(key) is not None
            ]
            if pn_bits:
                parts.append("prefillshare − naive: " + "; ".join(pn_bits))
            nd, pd = (d.get("naive") or {}).get("nll"), (d.get("prefillshare") or {}).get("nll")
            nci = (d.get("naive") or {}).get("nll_ci")
            rec = ""
            if nd and pd is not None and nci and nci[0] is not None and nci[0] > 0:
                rec = f" CCFT recovers {100 * (1 - pd / nd):.0f}% of the naive-sharing NLL gap."
            elif nd is not None and pd is not None:
                rec = (
                    " The naive-sharing NLL gap does not resolve (CI includes 0 or lies below), so no share "
                    "of it is given."
                )
            lines.append(f"- {t['task']} (n={t['n']}), Δ vs full-ft — " + " | ".join(parts) + "." + rec)
        out.append("\n".join(lines))
    return "\n\n".join(out)


#: a retention ratio is printed only where Full-FT's mean rests on at least this many items (a ratio of 1
#: or 4 passes is noise, whatever its value)
MIN_RETENTION_ITEMS = 10


def _ratio(retention: dict, mode: str, key: str, ref: dict | None = None) -> str:
    v = (retention.get(mode) or {}).get(key)
    if v is None:
        return "–"
    ref = ref or {}
    mean, n = ref.get(key), ref.get("scored_n") or ref.get("n")
    if mean is not None and n and round(mean * n) < MIN_RETENTION_ITEMS:
        return f"– (full-ft {round(mean * n)} of {n})"
    return f"{v:.2f}"


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
            _ratio(t["retention"], mode, k, t["modes"].get(REFERENCE_MODE))
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
        "title": study_title(report),
        "results": study_results(report),
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
        "plots": "\n\n".join(f"![{k}]({v})" for k, v in (report.get("plots") or {}).items())
        or "None written.",
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


def _task_list(tasks: list[str]) -> str:
    """Task names for a title; many MultiPL-E languages as one entry."""
    mpl = [t for t in tasks if t.startswith("multipl-e-")]
    if len(mpl) > 3:
        rest = [t for t in tasks if not t.startswith("multipl-e-")]
        return ", ".join(rest + [f"MultiPL-E ({len(mpl)} languages)"])
    return ", ".join(tasks)


def study_title(report: dict) -> str:
    """A title naming what was compared, on which model, tasks (with n) and hardware: the study, the frontier
    and a MultiPL-E-only run each get their own."""
    from ccft.evals.report import short_hardware

    by_spec: dict[str, list[str]] = {}
    ns = set()
    for t in report["tasks"]:
        by_spec.setdefault(t["specialist"], []).append(t["task"])
        ns.add(t["n"])
    specs = "; ".join(f"{spec} ({_task_list(ts)})" for spec, ts in by_spec.items())
    n = f"n = {ns.pop()} each" if len(ns) == 1 else f"n = {min(ns)}–{max(ns)} per task"
    model = str(report.get("model") or "").split(",")[0]
    fr = report.get("frontier")
    if fr:
        cfg = fr.get("config") or {}
        fmts = cfg.get("cache_formats") or []
        what = (
            "ccft frontier: PrefillShare at sharing depth m = "
            + ", ".join(str(m) for m in [0, *cfg.get("depths", [])])
            + (f" and on the {'/'.join(fmts)} C_base" if fmts else "")
            + ", against Full-FT and naive sharing"
        )
    else:
        what = "ccft study: PrefillShare vs Full-FT vs naive sharing"
    return f"{what} — {specs}, {n}; {model}, {short_hardware(report.get('hardware'))}"


_COMPARE = (("prefillshare", "full-ft"), ("naive", "full-ft"), ("prefillshare", "naive"))


def _task_pairs(t: dict) -> dict:
    """``(mode, reference)`` → metric key → ``{"delta", "ci"}`` of one task entry."""
    out = {}
    for mode, ref in _COMPARE:
        block = (
            t.get("paired_prefillshare_vs_naive")
            if ref == "naive"
            else (t.get("paired_vs_full_ft") or {}).get(mode)
        )
        if not block:
            continue
        out[(mode, ref)] = {
            k: {"delta": block[k], "ci": block.get(f"{k}_ci")}
            for k in ("score", "secondary", "nll")
            if block.get(k) is not None and block.get(f"{k}_ci")
        }
    return out


def study_results(report: dict) -> str:
    """The README's short "Results": per task, which paired differences resolve (95% CI excludes 0) on the
    primary and secondary metric and NLL/token — PrefillShare − Full-FT, naive − Full-FT and PrefillShare −
    naive — and, with a frontier, what each depth and format changes against m = 0. Generated from the CIs
    in the tables below."""
    from ccft.evals.report import results_verdict

    lines, wins = [], []
    for t in report["tasks"]:
        pairs = _task_pairs(t)
        if not pairs:
            continue
        metrics = [
            (k, name, True, True)
            for k, name in (("score", t["primary_metric"]), ("secondary", t["secondary_metric"]))
            if name
        ] + [("nll", "NLL/token", False, False)]
        lines.append(
            f"- **{t['specialist']} / {t['task']}** (n = {t['n']}): {results_verdict(pairs, metrics)}"
        )
        for (mode, ref), block in pairs.items():
            d = block.get("score")
            if d and d["ci"][0] is not None and (d["ci"][0] > 0 or d["ci"][1] < 0):
                wins.append((t, mode, ref, d))
    head = []
    if wins:
        head.append(
            "Primary-metric differences that resolve: "
            + "; ".join(
                f"{t['task']} {mode} − {ref} {100 * d['delta']:+.1f} pp "
                f"[{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}]"
                for t, mode, ref, d in wins
            )
            + "; every other primary-metric difference has a CI that includes 0."
        )
    else:
        head.append("No primary-metric difference between the modes resolves (every CI includes 0).")
    out = " ".join(head) + "\n\n" + "\n".join(lines)
    fr = (report.get("frontier") or {}).get("specialists") or {}
    if fr:
        out += "\n\n" + frontier_results(fr)
    return out


def frontier_results(frontiers: Mapping[str, list]) -> str:
    """Per frontier task: each depth and format paired against m = 0 of its own mode (``paired_vs_m0``), the
    resolved differences named, the rest summed up as not resolved."""
    lines = [
        "Frontier, each point paired against m = 0 of its own mode (PrefillShare m = k and int8 against "
        "PrefillShare m = 0, naive m = k against naive):"
    ]
    for spec, fs in frontiers.items():
        for f in fs:
            for key, name, pct in (("primary", f["primary_metric"], True), ("nll", "NLL/token", False)):
                res, unres = [], []
                for p in f["points"]:
                    d = (p.get("paired_vs_m0") or {}).get(key)
                    if not d:
                        continue
                    ci = d["ci"]
                    if ci[0] > 0 or ci[1] < 0:
                        val = (
                            f"{100 * d['delta']:+.1f} pp [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"
                            if pct
                            else f"{d['delta']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]"
                        )
                        worse = (ci[0] > 0) != pct
                        res.append(f"{p['label']} {val} ({'worse' if worse else 'better'})")
                    else:
                        unres.append(p["label"])
                if not res and not unres:
                    continue
                text = ("resolved: " + "; ".join(res) + ". " if res else "") + (
                    f"Not resolved for {'every point' if not res else 'the other points'} (CI includes 0)."
                    if unres
                    else ""
                )
                lines.append(f"- **{spec} / {f['task']}**, {name}: {text.strip()}")
    return "\n".join(lines)


#: frontier point label → (folder under OUT/SPEC, mode of its records); "" = the study's own task folder
def _frontier_folder(label: str) -> tuple[str, str]:
    if label in ("full-ft", "naive"):
        return "", label
    if label == "prefillshare m=0":
        return "", "prefillshare"
    mode, rest = label.split(" ", 1)
    if rest.startswith("m="):
        return f"frontier/{'naive-' if mode == 'naive' else ''}m{rest[2:]}", mode
    fmt = rest.split(" ")[0]
    return f"frontier/{fmt}-{'trained' if f'({fmt}-trained)' in rest else 'served'}", mode


def rerender_study_report(out_dir, command: str, *, n_resamples: int = 2000) -> dict:
    """``ccft study CONFIG --report-only``: ``OUT/README.md`` re-rendered from the committed
    ``OUT/report.json`` and per-item records, training and evaluating nothing. What the records add is
    computed first, the same way a run computes it: each task's paired prefillshare − naive difference
    (``task_entry``) and each frontier point's difference against m = 0 (``frontier.paired_against_m0``),
    with the seed each task folder's ``meta.json`` records; both are written back into ``report.json``.
    Returns the report."""
    import json
    from pathlib import Path

    from ccft.core.errors import ConfigError
    from ccft.core.io import atomic_write_json, atomic_write_text
    from ccft.evals.results import folder_records, load_task_folder
    from ccft.evals.study.frontier import frontier_markdown, paired_against_m0

    out = Path(out_dir)
    path = out / "report.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --report-only re-renders a finished study's report")
    report = json.loads(path.read_text())
    seeds = {}
    for t in report["tasks"]:
        folder = out / t["specialist"] / t["task"]
        if not (folder / "meta.json").is_file():
            continue
        summary = load_task_folder(folder)
        seed = int(((summary.get("meta") or {}).get("settings") or {}).get("seed", 0))
        seeds[(t["specialist"], t["task"])] = seed
        entry = task_entry(summary, t["specialist"], n_resamples=n_resamples, seed=seed)
        if "paired_prefillshare_vs_naive" in entry:
            t["paired_prefillshare_vs_naive"] = entry["paired_prefillshare_vs_naive"]
    fr = report.get("frontier")
    if fr:
        for spec, fs in fr["specialists"].items():
            for f in fs:
                recs = {}
                for p in f["points"]:
                    sub, mode = _frontier_folder(p["label"])
                    folder = out / spec / sub / f["task"] if sub else out / spec / f["task"]
                    recs[p["label"]] = {r["id"]: r for r in folder_records(folder).get(mode, [])}
                ref = recs["full-ft"]
                common = set.intersection(*(set(r) for r in recs.values()))
                ids = sorted(common, key=lambda i: (ref[i].get("index", 0), i))
                if len(ids) != f["n"]:
                    raise ConfigError(f"{spec}/{f['task']}: {len(ids)} common items, the report has {f['n']}")
                vs = paired_against_m0(
                    recs,
                    ids,
                    (f["primary_metric"], f["secondary_metric"]),
                    n_resamples=n_resamples,
                    seed=seeds.get((spec, f["task"]), 0),
                )
                for p in f["points"]:
                    if p["label"] in vs:
                        p["paired_vs_m0"] = vs[p["label"]]
    atomic_write_json(path, report, default=str)
    notes = out / "SITTINGS.md"
    readme = study_readme(report, command, notes.read_text(encoding="utf-8") if notes.is_file() else None)
    if fr:
        readme = readme.rstrip("\n") + "\n\n" + frontier_markdown(fr["specialists"], fr.get("plots") or {})
    atomic_write_text(out / "README.md", readme)
    return report
