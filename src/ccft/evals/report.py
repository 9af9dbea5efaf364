"""Markdown, plots and report.json for evaluation results in the runner's format (``ccft.evals.records``).

``modes_table`` / ``reading`` render one task's summary (``summary.json`` of ``ccft eval`` and
``ccft demo``); ``build_report`` collects result folders (``ccft report RUNS... -o DIR``): tables per
task and mode, deltas vs Full-FT with paired 95% bootstrap CIs, per-task plots and the sharing-sweep
plot, report.json. Mode names, their order and what runs in each come from ``ccft.core.modes``
(docs/design.md, "Modes").
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from ccft.core.deprecation import moved_name_getattr
from ccft.core.errors import ConfigError
from ccft.core.io import atomic_write_text, display_path, save_figure
from ccft.core.modes import MODES, REFERENCE_MODE, get_mode
from ccft.evals.records import paired_deltas_by_id, summarize_records
from ccft.evals.results import hardware, load_task_folder


def _order(mode: str) -> int:
    """Position of a mode in ``MODES`` (unknown names last)."""
    return MODES.index(mode) if mode in MODES else len(MODES)


def _note(mode: str) -> str:
    """What runs in ``mode`` (``Mode.note``), '' for a name that is not a mode."""
    return get_mode(mode).note if mode in MODES else ""


def _ci(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


_DECODER_NAME = {"full-ft": "Full-FT decoder", "ccft": "CCFT decoder", None: "base"}  # by Mode.decoder_method


def _sweep_note(label: str) -> str:
    """Which model a sweep curve or reference runs: its mode's decoder, and ', own prefill' for an own-prefill
    mode."""
    if label not in MODES:
        return ""
    m = get_mode(label)
    who = _DECODER_NAME[m.decoder_method]
    return who if m.shared_prefill else f"{who}, own prefill"


def _fmt(x, pct: bool = False, sign: bool = False) -> str:
    if x is None:
        return ""
    if pct:
        return f"{100 * x:+.1f}pp" if sign else f"{100 * x:.1f}%"
    return f"{x:+.4f}" if sign else f"{x:.4f}"


def _cell(value, ci=None, pct: bool = False, sign: bool = False) -> str:
    if value is None:
        return ""
    s = _fmt(value, pct, sign)
    if ci:
        lo, hi = (_fmt(c, pct, sign).replace("pp", "").replace("%", "") for c in ci)
        s += f" [{lo}, {hi}]"
    return s


def is_rate(metric: str, summary_modes: dict) -> bool:
    """Whether ``metric`` is a rate (shown in % and pp): every mode's mean lies in [0, 1] and it is not an NLL
    or a loss. ``summary_modes`` is a summary's ``modes`` mapping."""
    vals = [m["metrics"][metric]["mean"] for m in summary_modes.values() if metric in m.get("metrics", {})]
    return bool(vals) and all(0.0 <= v <= 1.0 for v in vals) and "nll" not in metric and "loss" not in metric


def primary_metric(summary: dict) -> str | None:
    """The headline metric of a summary: its task's declared one (``primary_metric_of`` of the registered
    task, the rule ``ccft study`` reads too), else the one its ``meta`` recorded, else the first metric any
    mode reports. A declared metric the modes do not report is passed over."""
    keys = sorted({k for m in summary["modes"].values() for k in m.get("metrics", {})})
    for want in (_declared_primary(summary.get("task")), (summary.get("meta") or {}).get("primary_metric")):
        if want and (want in keys or not keys):
            return want
    return keys[0] if keys else None


def _declared_primary(task: str | None) -> str | None:
    from ccft.evals.protocol import get_task, primary_metric_of, task_names

    return primary_metric_of(get_task(task)) if task and task in task_names() else None


def provenance(meta: dict, n=None) -> str:
    """One line naming model (with quantisation), data, n and hardware."""
    n = n if n is not None else meta.get("n_items")
    return f"model: {meta.get('model')}; data: {meta.get('data')}; n = {n}; hardware: {meta.get('hardware')}"


def _metric_order(summary: dict) -> list[str]:
    """Every metric of a summary, the primary one first."""
    metrics = sorted({k for m in summary["modes"].values() for k in m.get("metrics", {})})
    prim = primary_metric(summary)
    if prim in metrics:
        metrics.remove(prim)
        metrics.insert(0, prim)
    return metrics


def modes_table(summary: dict) -> str:
    """One task's Markdown tables: per mode NLL/token and each metric with 95% CIs, n and truncated
    generations; then the paired deltas against full-ft. An ``n scored`` column appears when fewer items were
    generated than scored for NLL (``EvalSettings.generate_limit``, e.g. the demo's ``em_rows``)."""
    modes = summary["modes"]
    metrics = _metric_order(summary)
    partial = any("scored_n" in m and m["scored_n"] != m.get("n") for m in modes.values())
    head = ["mode", "what runs", "NLL/token ↓ (95% CI)"] + [f"{k} (95% CI)" for k in metrics] + ["n"]
    head += (["n scored"] if partial else []) + ["truncated"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in sorted(modes, key=_order):
        m = modes[mode]
        row = [mode, _note(mode), _cell(m.get("nll"), m.get("nll_ci"))]
        for k in metrics:
            x = m.get("metrics", {}).get(k)
            row.append(_cell(x["mean"], x["ci"], pct=is_rate(k, modes)) if x else "")
        row.append(str(m.get("n", "")) + ("" if m.get("complete", True) else " (incomplete)"))
        if partial:
            row.append(str(m.get("scored_n", "")))
        row.append(str(m.get("truncated", "")))
        lines.append("| " + " | ".join(row) + " |")
    deltas = summary.get("deltas_vs_full_ft") or {}
    if deltas:
        lines += [
            "",
            f"Paired deltas against {REFERENCE_MODE} on the same items (mode − {REFERENCE_MODE}, 95% paired "
            "bootstrap CI):",
            "",
        ]
        head = ["mode", "ΔNLL/token"] + [f"Δ{k}" for k in metrics] + ["n pairs"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for mode in sorted(deltas, key=_order):
            d = deltas[mode]
            row = [mode, _cell(d["nll"]["delta"], d["nll"]["ci"], sign=True) if "nll" in d else ""]
            for k in metrics:
                row.append(
                    _cell(d[k]["delta"], d[k]["ci"], pct=is_rate(k, modes), sign=True) if k in d else ""
                )
            row.append(_pairs_cell(d, metrics))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def pair_table(summary: dict, vs_naive: dict | None, mode: str = "prefillshare", ref: str = "naive") -> str:
    """The paired difference ``mode − ref`` (default PrefillShare − naive, the comparison the method exists
    for) as a one-row Markdown table beside ``modes_table``'s deltas against Full-FT ('' when not known)."""
    if not vs_naive:
        return ""
    modes = summary["modes"]
    metrics = _metric_order(summary)
    head = ["difference", "ΔNLL/token"] + [f"Δ{k}" for k in metrics] + ["n pairs"]
    d = vs_naive
    row = [f"{mode} − {ref}", _cell(d["nll"]["delta"], d["nll"]["ci"], sign=True) if "nll" in d else ""]
    for k in metrics:
        row.append(_cell(d[k]["delta"], d[k]["ci"], pct=is_rate(k, modes), sign=True) if k in d else "")
    row.append(_pairs_cell(d, metrics))
    return "\n".join(
        [
            f"Paired difference {mode} − {ref} on the same items (95% paired bootstrap CI), the comparison "
            "the method exists for:",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
            "| " + " | ".join(row) + " |",
        ]
    )


def _pairs_cell(d: dict, metrics) -> str:
    """The paired items behind a deltas row: one number, or NLL's and the scored metrics' when they differ (a
    run that scores generations on fewer items than it computes the NLL on, ``generate_limit``)."""
    n_nll = d.get("nll", {}).get("n")
    n_scored = sorted({d[k]["n"] for k in metrics if k in d})
    if n_nll is None or not n_scored or n_scored == [n_nll]:
        return str(n_nll if n_nll is not None else max(n_scored, default=0))
    return f"{n_nll} (NLL), {'/'.join(map(str, n_scored))} (scored)"


def reading(summary: dict, vs_naive: dict | None = None) -> str:
    """A plain-words reading of naive vs prefillshare vs full-ft, derived from the numbers (never
    hand-written). ``vs_naive``: the paired prefillshare − naive differences (``paired_difference``), when
    known. A share of the naive-sharing NLL gap "recovered" is given only where that gap resolves (its CI
    lies above 0): a ratio of an unresolved gap says nothing."""
    m = summary["modes"]
    d = summary.get("deltas_vs_full_ft") or {}
    out = []
    if {"base", "full-ft", "prefillshare"} <= m.keys() and all(
        "nll" in m[k] for k in ("base", "full-ft", "prefillshare")
    ):
        out.append(
            f"Both decoders moved away from the base: response NLL/token {m['base']['nll']:.3f} (base) → "
            f"{m['full-ft']['nll']:.3f} (Full-FT, own prefill) and {m['prefillshare']['nll']:.3f} "
            f"(CCFT on C_base)."
        )
    if "nll" in d.get("naive", {}) and "nll" in d.get("prefillshare", {}):
        n, p = d["naive"]["nll"], d["prefillshare"]["nll"]
        sig = lambda x: "excludes 0" if x["ci"][0] > 0 or x["ci"][1] < 0 else "includes 0"  # noqa: E731
        out.append(
            f"Naive sharing (Full-FT decoder reading C_base) costs {n['delta']:+.4f} NLL/token against "
            f"Full-FT (CI {_ci(n['ci'])}, {sig(n)}); PrefillShare costs {p['delta']:+.4f} "
            f"(CI {_ci(p['ci'])}, {sig(p)})."
        )
        pn = (vs_naive or {}).get("nll")
        if pn:
            out.append(
                f"PrefillShare − naive on the same items: {pn['delta']:+.4f} NLL/token (CI {_ci(pn['ci'])}, "
                f"{sig(pn)})."
            )
        if n["ci"][0] > 0:
            out.append(
                f"CCFT recovers {100 * (1 - p['delta'] / n['delta']):.0f}% of the naive-sharing NLL gap on "
                "these items."
            )
        else:
            out.append("The naive-sharing NLL gap does not resolve here, so no share of it is given.")
    prim = primary_metric(summary)
    vals = {
        k: v["metrics"][prim]
        for k, v in sorted(m.items(), key=lambda kv: _order(kv[0]))
        if prim in v.get("metrics", {})
    }
    if prim and REFERENCE_MODE in vals:
        rate = is_rate(prim, m)
        width = max(x["ci"][1] - x["ci"][0] for x in vals.values())
        line = f"{prim}: " + ", ".join(f"{k} {_fmt(x['mean'], pct=rate)}" for k, x in vals.items())
        if width > 0:
            line += (
                f". With n={vals[REFERENCE_MODE]['n']} items the 95% intervals are up to "
                + (f"{100 * width:.0f} points" if rate else f"{width:.3g}")
                + " wide, so differences between "
                "modes smaller than that are not resolved here; the NLL deltas are the sensitive measurement"
            )
        out.append(line + ".")
    return "\n\n".join(out)


def task_markdown(summary: dict, plot: str | None = None) -> str:
    """Markdown section of one task: provenance, ``modes_table``, task aggregates, the plot."""
    meta = summary.get("meta") or {}
    modes = summary["modes"]
    s = meta.get("settings") or {}
    env_line = environment_line(meta)
    gen = f"greedy, max {s.get('max_new_tokens')} new tokens"
    if s.get("generate_limit") is not None:
        gen += f" on the first {s['generate_limit']} items"
    lines = (
        [f"### {summary.get('task')}", "", f"- {provenance(meta)}"]
        + ([f"- {env_line}"] if env_line else [])
        + [
            f"- decoding: {gen}, same items and settings in every mode; prompting: "
            f"{s.get('prompting') or 'as defined by the task'}; handoff_tokens = {s.get('handoff_tokens', 1)}"
            + (
                f"; {s.get('samples')} samples per item (temperature {s.get('temperature')}, "
                f"top-p {s.get('top_p')})"
                if (s.get("samples") or 1) > 1
                else ""
            ),
            "",
            modes_table(summary),
        ]
    )
    aggs = {m: v["task_aggregate"] for m, v in modes.items() if v.get("task_aggregate")}
    if aggs:
        lines += ["", "Task aggregates (as computed by the task):", ""]
        for mode, agg in aggs.items():
            flat = ", ".join(
                f"{k} = {v:.4g}" if isinstance(v, (int, float)) else f"{k} = {v}" for k, v in agg.items()
            )
            lines.append(f"- {mode}: {flat}")
    if plot:
        lines += ["", f"![{summary.get('task')}]({plot})"]
    return "\n".join(lines) + "\n"


_ENV_KEYS = (
    "language",
    "version",
    "isolation",
    "canonical_passed",
    "canonical_total",
    "mbxp_canonical_passed",
    "mbxp_canonical_total",
    "reference_passed",
    "reference_total",
    "checker_python",
)


def environment_line(meta: dict) -> str:
    """The K8 execution-environment check of a task in words ('' for tasks that execute nothing)."""
    if meta.get("unavailable"):
        return (
            f"**unavailable**: {meta['unavailable']} — accuracy not scored (never counted as 0); "
            "NLL on the reference answers only"
        )
    env = meta.get("environment")
    if not isinstance(env, dict) or not any(k in env for k in _ENV_KEYS):
        return ""
    facts = ", ".join(f"{k.replace('_', ' ')} {env[k]}" for k in _ENV_KEYS if env.get(k) not in (None, ""))
    return (
        f"execution environment checked before scoring ({'ok' if env.get('ok', True) else 'FAILED'}): {facts}"
    )


def environments_table(summaries: list[dict]) -> str:
    """Per task: available / unavailable and the environment check (K8), for tasks that execute code."""
    rows = []
    for s in summaries:
        meta = s.get("meta") or {}
        env = meta.get("environment")
        if not isinstance(env, dict) or not any(k in env for k in _ENV_KEYS + ("available",)):
            continue
        avail = "no" if meta.get("unavailable") else "yes"
        rows.append(f"| {s.get('task')} | {avail} | {environment_line(meta)} |")
    if not rows:
        return ""
    return "\n".join(["| task | available | check |", "|---|---|---|"] + rows)


def headline_table(summaries: list[dict]) -> str:
    """One row per (task, mode): primary metric and NLL with CIs, their paired deltas vs Full-FT, n."""
    lines = [
        "| task | mode | metric | score (95% CI) | Δ vs full-ft (95% paired CI) | NLL/token (95% CI) | "
        "ΔNLL vs full-ft (95% paired CI) | n | setup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for j, s in enumerate(summaries, 1):
        prim = primary_metric(s)
        deltas = s.get("deltas_vs_full_ft") or {}
        for mode in sorted(s["modes"], key=_order):
            m = s["modes"][mode]
            x = m.get("metrics", {}).get(prim) if prim else None
            rate = bool(prim) and is_rate(prim, s["modes"])
            d = deltas.get(mode, {})
            score = (
                _cell(x["mean"], x["ci"], pct=rate)
                if x
                else ("unavailable" if (s.get("meta") or {}).get("unavailable") else "")
            )
            lines.append(
                f"| {s.get('task')} | {mode} | {prim or ''} | {score} | "
                f"{_cell(d[prim]['delta'], d[prim]['ci'], pct=rate, sign=True) if prim in d else ''} | "
                f"{_cell(m.get('nll'), m.get('nll_ci'))} | "
                f"{_cell(d['nll']['delta'], d['nll']['ci'], sign=True) if 'nll' in d else ''} | "
                f"{m.get('n')} | [{j}] |"
            )
    lines.append("")
    for j, s in enumerate(summaries, 1):
        lines.append(f"[{j}] {provenance(s.get('meta') or {})}  ")
    return "\n".join(lines)


def sweep_markdown(sweep: dict, plot: str | None = None) -> str:
    """The sharing-sweep section: plot, then one row per (curve, axis, ρ)."""
    meta = sweep["meta"]
    pts = sweep["points"]
    has_acc = any(p.get("metrics") for p in pts)
    accs = sorted({k for p in pts for k in p.get("metrics", {})})
    lines = [
        f"### Sharing sweep: {meta.get('task')}",
        "",
        f"- {provenance(meta)}",
        "- ρ over positions: per row the decoder recomputes k = max(handoff, ⌈(1−ρ)·n⌉) prompt tokens on "
        "C_base of the first n−k; over layers: the first ⌈ρ·L⌉ layers read C_base, the others the decoder's "
        f"own prefill (L = {meta.get('num_layers')}). ρ = 1 is PrefillShare / naive sharing; "
        "full-ft = own prefill.",
        "",
    ]
    if plot:
        lines += [f"![sharing sweep]({plot})", ""]
    head = ["curve", "decoder", "axis", "ρ", "NLL/token ↓ (95% CI)", "ΔNLL vs full-ft (95% paired CI)"]
    head += [f"{k} (95% CI)" for k in accs] + ["n"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in pts:
        d = p.get("delta_nll_vs_full_ft")
        row = [
            p["label"],
            _sweep_note(p["label"]),
            p["over"] or "own prefill",
            "" if p["rho"] is None else f"{p['rho']:g}",
            _cell(p.get("nll"), p.get("nll_ci")),
            _cell(d["delta"], d["ci"], sign=True) if d else "",
        ]
        for k in accs:
            x = p.get("metrics", {}).get(k)
            row.append(_cell(x["mean"], x["ci"], pct=True) + f" (n={x['n']})" if x else "")
        row.append(str(p["n"]))
        lines.append("| " + " | ".join(row) + " |")
    if not has_acc:
        lines += ["", "Accuracy was not generated in this sweep (`ccft sweep --gen-rows N` adds it)."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- what the CIs resolve, in words


def paired_difference(
    per_mode: dict, mode: str, reference: str, *, n_resamples: int = 2000, seed: int = 0
) -> dict:
    """``mode − reference`` on the items both finished: NLL and every metric, each ``{"delta", "ci", "n"}``
    (the same paired bootstrap as the deltas against Full-FT, ``paired_deltas_by_id``). ``per_mode``: mode →
    item records (a list, or item id → record). ``{}`` when either mode is missing."""
    if mode not in per_mode or reference not in per_mode:
        return {}
    as_list = {
        m: list(per_mode[m].values()) if isinstance(per_mode[m], dict) else list(per_mode[m])
        for m in (mode, reference)
    }
    return paired_deltas_by_id(as_list, reference, n_resamples=n_resamples, seed=seed).get(mode, {})


def resolved(ci) -> bool:
    """A 95% CI that excludes 0 (the difference resolves at this n)."""
    return bool(ci) and ci[0] is not None and (ci[0] > 0 or ci[1] < 0)


def verdict(ci, higher_is_better: bool, better: str, worse: str) -> str:
    """``resolved: BETTER better`` / ``resolved: WORSE better`` / ``not resolved`` from a CI of
    ``better − worse`` (names as the reader knows them)."""
    if not resolved(ci):
        return "not resolved: CI includes 0"
    up = ci[0] > 0
    return f"resolved: {better if up == higher_is_better else worse} better"


#: the comparisons a report makes between the modes: (mode, reference, label)
COMPARISONS = (
    ("prefillshare", "full-ft", "PrefillShare − Full-FT"),
    ("naive", "full-ft", "naive − Full-FT"),
    ("prefillshare", "naive", "PrefillShare − naive"),
)
_WHO = {"prefillshare": "PrefillShare", "full-ft": "Full-FT", "naive": "naive", "base": "base"}


def comparison_text(delta: float, ci, *, pct: bool, higher_is_better: bool, mode: str, ref: str) -> str:
    """``+6.0 pp [+2.0, +11.0] (resolved: PrefillShare better)`` for one paired difference."""
    if pct:
        val = f"{100 * delta:+.1f} pp [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"
    else:
        val = f"{delta:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]"
    return f"{val} ({verdict(ci, higher_is_better, _WHO.get(mode, mode), _WHO.get(ref, ref))})"


def results_lines(pairs: dict, metrics: list[tuple[str, str, bool, bool]]) -> list[str]:
    """One line per metric: every comparison of ``COMPARISONS`` present in ``pairs`` (``(mode, ref)`` →
    ``{metric: {"delta", "ci"}}``) with its CI and whether it resolves. ``metrics``: (key in the pair blocks,
    name shown, is a rate, higher is better)."""
    out = []
    for key, name, pct, up in metrics:
        bits = []
        for mode, ref, label in COMPARISONS:
            d = (pairs.get((mode, ref)) or {}).get(key)
            if not d or d.get("delta") is None or not d.get("ci"):
                continue
            bits.append(
                f"{label} "
                + comparison_text(d["delta"], d["ci"], pct=pct, higher_is_better=up, mode=mode, ref=ref)
            )
        if bits:
            out.append(f"{name}: " + "; ".join(bits))
    return out


def results_verdict(pairs: dict, metrics: list[tuple[str, str, bool, bool]]) -> str:
    """One sentence: which comparisons resolve on which metric, and that the others do not."""
    yes, no, resolved_on = [], [], set()
    for key, name, _pct, up in metrics:
        open_ = []
        for mode, ref, label in COMPARISONS:
            d = (pairs.get((mode, ref)) or {}).get(key)
            if not d or not d.get("ci"):
                continue
            if resolved(d["ci"]):
                better = _WHO.get(mode, mode) if (d["ci"][0] > 0) == up else _WHO.get(ref, ref)
                yes.append(f"{label} on {name} ({better} better)")
                resolved_on.add(name)
            else:
                open_.append(label)
        if open_ and name not in resolved_on and len(open_) > 1:
            no.append(f"every comparison on {name}")
        else:
            no += [f"{label} on {name}" for label in open_]
    parts = []
    if yes:
        parts.append("Resolved (95% paired CI excludes 0): " + "; ".join(yes) + ".")
    if no:
        parts.append("Not resolved (CI includes 0): " + "; ".join(no) + ".")
    if resolved_on == {"NLL/token"} and len(metrics) > 1:
        parts.append(
            "Only NLL/token separates the modes at this n; on the scored metrics they cannot be told apart."
        )
    elif not resolved_on:
        parts.append("No difference between the modes resolves at this n.")
    return " ".join(parts)


def short_hardware(hardware: str | None) -> str:
    """The CPU (or GPU) and core count of a hardware line, for a title."""
    if not hardware:
        return "unrecorded hardware"
    parts = [p.strip() for p in str(hardware).split(",")]
    return ", ".join(parts[:2]) if "no GPU" in str(hardware) else str(hardware)


# ------------------------------------------------------------------------------------------------ plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_task(summary: dict, path) -> None:
    """Bar charts per mode: the primary metric and NLL/token, with 95% CI error bars (PNG)."""
    plt = _plt()
    modes = sorted(summary["modes"], key=_order)
    prim = primary_metric(summary)
    panels = [("NLL/token ↓", lambda m: (m.get("nll"), m.get("nll_ci")))]
    if prim:
        panels.insert(
            0,
            (
                prim,
                lambda m: (
                    (m.get("metrics", {}).get(prim) or {}).get("mean"),
                    (m.get("metrics", {}).get(prim) or {}).get("ci"),
                ),
            ),
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    colors = {"base": "#999999", "full-ft": "#1f77b4", "naive": "#d62728", "prefillshare": "#2ca02c"}
    for ax, (title, get) in zip(axes[0], panels, strict=True):
        xs, ys, lo, hi = [], [], [], []
        for i, mode in enumerate(modes):
            v, ci = get(summary["modes"][mode])
            if v is None:
                continue
            xs.append(i)
            ys.append(v)
            lo.append(v - ci[0] if ci else 0)
            hi.append(ci[1] - v if ci else 0)
        ax.bar(xs, ys, yerr=[lo, hi], capsize=4, color=[colors.get(modes[i], "#8c564b") for i in xs])
        ax.set_xticks(range(len(modes)), modes, rotation=15)
        ax.set_title(title)
    meta = summary.get("meta") or {}
    fig.suptitle(f"{summary.get('task')} — {meta.get('model')}, n={meta.get('n_items')}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep: dict, path) -> None:
    """NLL/token (and accuracy, if generated) against ρ, one panel per axis; full-ft own prefill as a line
    (PNG)."""
    plt = _plt()
    pts = sweep["points"]
    axes_names = [a for a in ("positions", "layers") if any(p["over"] == a for p in pts)]
    accs = sorted({k for p in pts if p["over"] for k in p.get("metrics", {})})
    rows = 1 + (1 if accs else 0)
    fig, axes = plt.subplots(
        rows, max(1, len(axes_names)), figsize=(4.6 * max(1, len(axes_names)), 3.4 * rows), squeeze=False
    )
    colors = {"naive": "#d62728", "prefillshare": "#2ca02c"}
    refs = {p["label"]: p for p in pts if p["over"] is None}
    metric = accs[0] if accs else None
    # Paired deltas against the Full-FT decoder's own prefill are what the sweep resolves (items vary far more
    # than modes do); absolute NLL is plotted only when no Full-FT reference was measured.
    paired = "full-ft" in refs and any(p.get("delta_nll_vs_full_ft") for p in pts)
    nll_label = "ΔNLL/token vs Full-FT own prefill ↓\n(paired 95% CI)" if paired else "NLL/token ↓ (95% CI)"
    for col, over in enumerate(axes_names):
        for r, (key, ylabel) in enumerate([("nll", nll_label)] + ([(metric, metric)] if metric else [])):
            ax = axes[r][col]
            for label in (m for m in MODES if get_mode(m).shared_prefill):  # the sweep's curves
                series = sorted(
                    (p for p in pts if p["label"] == label and p["over"] == over), key=lambda p: p["rho"]
                )
                if key == "nll" and paired:
                    vals = [
                        (p["rho"], p["delta_nll_vs_full_ft"]["delta"], p["delta_nll_vs_full_ft"]["ci"])
                        for p in series
                        if p.get("delta_nll_vs_full_ft")
                    ]
                elif key == "nll":
                    vals = [
                        (p["rho"], p.get("nll"), p.get("nll_ci")) for p in series if p.get("nll") is not None
                    ]
                else:
                    vals = [
                        (p["rho"], p["metrics"][key]["mean"], p["metrics"][key]["ci"])
                        for p in series
                        if key in p.get("metrics", {})
                    ]
                if not vals:
                    continue
                xs = [v[0] for v in vals]
                ax.plot(
                    xs,
                    [v[1] for v in vals],
                    "o-",
                    color=colors[label],
                    label=f"{label} ({_sweep_note(label)})",
                )
                ax.fill_between(
                    xs, [v[2][0] for v in vals], [v[2][1] for v in vals], color=colors[label], alpha=0.15
                )
            for label, style in (("full-ft", "--"), ("base", ":")):
                p = refs.get(label)
                if p is None:
                    y = None
                elif key == "nll" and paired:
                    y = 0.0 if label == "full-ft" else (p.get("delta_nll_vs_full_ft") or {}).get("delta")
                elif key == "nll":
                    y = p.get("nll")
                else:
                    y = (p.get("metrics", {}).get(key) or {}).get("mean")
                if y is not None:
                    ax.axhline(
                        y,
                        linestyle=style,
                        color="#1f77b4" if label == "full-ft" else "#777777",
                        label=_sweep_note(label),
                    )
            ax.set_xlabel(f"sharing ratio ρ over {over}")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if r == 0 and col == 0:
                ax.legend(fontsize=7)
    meta = sweep["meta"]
    fig.suptitle(
        f"Sharing sweep, {meta.get('task')} — {meta.get('model')}, n={meta.get('n_items')}", fontsize=9
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- collecting runs


def legacy_demo_summary(data: dict, path) -> dict:
    """A ``results.json`` of the ccft 0.1 demo (per-row lists ``per_row``) as a summary in the runner's
    format.

    Only a reader: ``ccft demo`` now writes a runner task folder. Kept so that ``ccft report`` still reads
    demo results written before (such as a committed ``reports/demo/results.json``).
    """
    per_row = data.get("per_row") or {}
    records = {}
    for mode, rows in per_row.items():
        recs = [{"id": str(i), "index": i, "nll": v} for i, v in enumerate(rows.get("nll_rows", []))]
        for key, metric in (
            ("em_strict_rows", "exact_match_strict"),
            ("em_flexible_rows", "exact_match_flexible"),
        ):
            for i, v in enumerate(rows.get(key, [])):
                if i >= len(recs):
                    recs.append({"id": str(i), "index": i})
                recs[i].setdefault("scores", {})[metric] = float(v)
        records[mode] = recs
    d = data.get("data") or {}
    meta = {
        "task": data.get("task", "gsm8k"),
        "model": data.get("model"),
        "hardware": data.get("hardware"),
        "data": d.get("eval_nll") if isinstance(d, dict) else d,
        "primary_metric": "exact_match_flexible",
        "n_items": max((len(r) for r in records.values()), default=0),
        "source": str(path),
    }
    modes = {m: summarize_records(r) for m, r in records.items()}
    for m in modes.values():
        m.update(model=meta["model"], data=meta["data"], hardware=meta["hardware"])
    return {
        "kind": "ccft-eval",
        "task": meta["task"],
        "meta": meta,
        "modes": modes,
        "deltas_vs_full_ft": paired_deltas_by_id(records),
        "records": records,
        "folder": str(path),
    }


def collect_runs(paths) -> tuple[list[dict], list[dict]]:
    """(eval summaries, sweep summaries) found under ``paths`` (folders searched recursively, or files).

    Task folders (``meta.json`` + ``items.MODE.jsonl``, written by ``ccft eval`` and ``ccft demo``), sweep
    folders (``sweep.json``) and ccft 0.1 demo ``results.json`` files (``legacy_demo_summary``).

    Raises:
        ConfigError: a path that does not exist.
    """
    evals, sweeps, seen = [], [], set()
    for root in map(Path, paths):
        if not root.exists():
            raise ConfigError(
                f"{root} does not exist; pass result folders written by `ccft eval` / `ccft sweep`"
            )
        files = [root] if root.is_file() else sorted(root.rglob("*.json"))
        for f in files:
            if f.resolve() in seen:
                continue
            if f.name == "meta.json" and any(f.parent.glob("items.*.jsonl")):
                seen.add(f.resolve())
                evals.append(load_task_folder(f.parent))
            elif f.name == "sweep.json":
                seen.add(f.resolve())
                data = json.loads(f.read_text())
                if data.get("kind") == "ccft-sweep":
                    data["folder"] = str(f.parent)
                    sweeps.append(data)
            elif f.name == "results.json" and f.parent.name != "report":
                data = json.loads(f.read_text())
                if "per_row" in data and "modes" in data:
                    seen.add(f.resolve())
                    evals.append(legacy_demo_summary(data, f))
    return evals, sweeps


def build_report(paths, out_dir, *, title: str = "ccft report") -> dict:
    """Write ``out_dir/README.md``, ``out_dir/report.json`` and PNG plots from result folders; returns
    report.json.

    Raises:
        ConfigError: no results under ``paths``.
    """
    evals, sweeps = collect_runs(paths)
    if not evals and not sweeps:
        raise ConfigError(
            f"no results under {', '.join(map(str, paths))}: expected folders written by "
            "`ccft eval --out` (meta.json + items.MODE.jsonl) or `ccft sweep --out` (sweep.json)"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Same task in several folders: keep them apart by folder.
    names = [s.get("task") for s in evals]
    for s in evals:
        if names.count(s.get("task")) > 1:
            s["task"] = f"{s.get('task')} ({Path(s['folder']).parent.name or s['folder']})"
    plots, plot_error = {}, None
    try:
        _plt()
    except ImportError as e:
        plot_error = f"plots skipped: {e} (pip install matplotlib)"
    if plot_error is None:
        for s in evals:
            fn = _slug(s["task"]) + ".png"
            plot_task(s, out / fn)
            plots[s["task"]] = fn
        for i, sw in enumerate(sweeps):
            fn = "sweep.png" if len(sweeps) == 1 else f"sweep-{_slug(sw['meta'].get('task'))}-{i}.png"
            plot_sweep(sw, out / fn)
            plots[f"sweep:{i}"] = fn
    md = [
        f"# {title}",
        "",
        f"Generated by `ccft report` on {time.strftime('%Y-%m-%d %H:%M')} from: "
        + ", ".join(f"`{display_path(p)}`" for p in paths)
        + ".",
        "",
    ]
    if plot_error:
        md += [f"_{plot_error}_", ""]
    if evals:
        md += [
            "## Headline",
            "",
            "Primary metric and response NLL per token of each mode on the same items, with 95% percentile "
            "bootstrap intervals over items; deltas are paired (mode − full-ft, items resampled jointly).",
            "",
            headline_table(evals),
            "",
            "## Tasks",
            "",
        ]
        for s in evals:
            md.append(task_markdown(s, plots.get(s["task"])))
        envs = environments_table(evals)
        if envs:
            md += [
                "## Execution environments (K8)",
                "",
                "Checked before any model was scored: canonical solutions must pass in the exact sandbox; a "
                "language whose toolchain is missing is reported unavailable, never scored as 0.",
                "",
                envs,
                "",
            ]
    if sweeps:
        md += ["## Sharing sweep", ""]
        for i, sw in enumerate(sweeps):
            md.append(sweep_markdown(sw, plots.get(f"sweep:{i}")))
    report = {
        "title": title,
        "generated": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": [display_path(p) for p in paths],
        "report_hardware": hardware(),
        "plots": plots,
        "plot_error": plot_error,
        "headline": [
            {
                "task": s.get("task"),
                "mode": mode,
                "primary_metric": primary_metric(s),
                "score": (m.get("metrics", {}).get(primary_metric(s)) or {}).get("mean"),
                "score_ci": (m.get("metrics", {}).get(primary_metric(s)) or {}).get("ci"),
                "nll": m.get("nll"),
                "nll_ci": m.get("nll_ci"),
                "n": m.get("n"),
                "delta_vs_full_ft": (s.get("deltas_vs_full_ft") or {}).get(mode),
                "model": (s.get("meta") or {}).get("model"),
                "data": (s.get("meta") or {}).get("data"),
                "hardware": (s.get("meta") or {}).get("hardware"),
            }
            for s in evals
            for mode, m in s["modes"].items()
        ],
        "tasks": evals,
        "sweeps": sweeps,
    }
    atomic_write_text(out / "README.md", "\n".join(md))
    atomic_write_text(out / "report.json", json.dumps(report, indent=2, default=str))
    return report


def _slug(s) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(s)).strip("-") or "task"


__getattr__ = moved_name_getattr(__name__)  # 0.1 names: ccft.core.deprecation.MOVED_NAMES
