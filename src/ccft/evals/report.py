"""Markdown for evaluation results: the four-mode table, paired deltas and an honest reading."""

from __future__ import annotations

MODE_ORDER = ("base", "full-ft", "naive", "prefillshare")
MODE_NOTE = {"base": "frozen base, own prefill", "full-ft": "Full-FT decoder, own prefill (reference)",
             "naive": "Full-FT decoder on C_base", "prefillshare": "CCFT decoder on C_base (the method)"}


def _ci(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def modes_table(result: dict) -> str:
    """The per-mode Markdown table (NLL with CI, strict/flexible exact match with CI, n, truncated)."""
    lines = ["| mode | what runs | NLL/token ↓ (95% CI) | EM strict (95% CI) | EM flexible (95% CI) | n NLL | n EM | truncated |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in MODE_ORDER:
        r = result["modes"].get(mode)
        if not r:
            continue
        em = r.get("em_ci", {})
        lines.append(
            f"| {mode} | {MODE_NOTE[mode]} | {r.get('nll', float('nan')):.4f} {_ci(r.get('nll_ci'))} | "
            f"{_pct(r.get('exact_match_strict'))} {_ci(em.get('strict'))} | "
            f"{_pct(r.get('exact_match_flexible'))} {_ci(em.get('flexible'))} | {r.get('n', '')} | "
            f"{r.get('em_n', '')} | {r.get('truncated', '')} |")
    deltas = result.get("deltas_vs_full_ft") or {}
    if deltas:
        lines += ["", "Paired deltas against full-ft on the same rows (mode − full-ft, 95% paired bootstrap CI):", "",
                  "| mode | ΔNLL/token | ΔEM strict | ΔEM flexible |", "|---|---|---|---|"]
        for mode in MODE_ORDER:
            d = deltas.get(mode)
            if not d:
                continue
            cell = lambda k, pct=False, d=d: (  # noqa: E731
                f"{(100 if pct else 1) * d[k]['delta']:+.{1 if pct else 4}f}{'pp' if pct else ''} "
                f"[{(100 if pct else 1) * d[k]['ci'][0]:+.{1 if pct else 4}f}, "
                f"{(100 if pct else 1) * d[k]['ci'][1]:+.{1 if pct else 4}f}]" if k in d else "")
            lines.append(f"| {mode} | {cell('nll')} | {cell('exact_match_strict', True)} | "
                         f"{cell('exact_match_flexible', True)} |")
    return "\n".join(lines)


def reading(result: dict) -> str:
    """A plain-words reading of naive vs prefillshare vs full-ft, derived from the numbers (never hand-written)."""
    m = result["modes"]
    d = result.get("deltas_vs_full_ft") or {}
    out = []
    if {"base", "full-ft", "prefillshare"} <= m.keys():
        out.append(f"Both decoders moved away from the base: response NLL/token {m['base']['nll']:.3f} (base) → "
                   f"{m['full-ft']['nll']:.3f} (Full-FT, own prefill) and {m['prefillshare']['nll']:.3f} "
                   f"(CCFT on C_base).")
    if "naive" in d and "prefillshare" in d and "nll" in d["naive"] and "nll" in d["prefillshare"]:
        n, p = d["naive"]["nll"], d["prefillshare"]["nll"]
        sig = lambda x: "excludes 0" if x["ci"][0] > 0 or x["ci"][1] < 0 else "includes 0"  # noqa: E731
        out.append(f"Naive sharing (Full-FT decoder reading C_base) costs {n['delta']:+.4f} NLL/token against "
                   f"Full-FT (CI {_ci(n['ci'])}, {sig(n)}); PrefillShare costs {p['delta']:+.4f} "
                   f"(CI {_ci(p['ci'])}, {sig(p)}).")
        if n["delta"] > 0:
            rec = 1 - p["delta"] / n["delta"]
            out.append(f"CCFT recovers {100 * rec:.0f}% of the naive-sharing NLL gap on these rows.")
    if "full-ft" in m and "exact_match_flexible" in m["full-ft"]:
        em = {k: v.get("exact_match_flexible") for k, v in m.items() if "exact_match_flexible" in v}
        widths = [v["em_ci"]["flexible"][1] - v["em_ci"]["flexible"][0] for v in m.values() if "em_ci" in v]
        out.append("Exact match (flexible): " + ", ".join(f"{k} {_pct(v)}" for k, v in em.items()) +
                   f". With n={m['full-ft'].get('em_n')} problems the 95% intervals are about "
                   f"{100 * max(widths):.0f} points wide, so exact-match differences between modes of a few "
                   "points are not resolved here; the NLL deltas are the sensitive measurement.")
    return "\n\n".join(out)


# ------------------------------------------------------------------------------------------------
# Reports over result folders (`ccft report RUNS... -o DIR`): tables per task and mode, deltas vs
# Full-FT with paired 95% bootstrap CIs, per-task plots and the sharing-sweep plot, report.json.

_SWEEP_NOTE = {"naive": "Full-FT decoder", "prefillshare": "CCFT decoder", "full-ft": "Full-FT decoder, own prefill",
               "base": "base, own prefill"}


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


def _is_rate(metric: str, summary_modes: dict) -> bool:
    vals = [m["metrics"][metric]["mean"] for m in summary_modes.values() if metric in m.get("metrics", {})]
    return bool(vals) and all(0.0 <= v <= 1.0 for v in vals) and "nll" not in metric and "loss" not in metric


def primary_metric(summary: dict) -> str | None:
    """The task's declared primary metric, else the first metric any mode reports."""
    want = (summary.get("meta") or {}).get("primary_metric")
    keys = sorted({k for m in summary["modes"].values() for k in m.get("metrics", {})})
    if want and (want in keys or not keys):
        return want
    return keys[0] if keys else None


def provenance(meta: dict, n=None) -> str:
    """One line naming model (with quantisation), data, n and hardware."""
    n = n if n is not None else meta.get("n_items")
    return (f"model: {meta.get('model')}; data: {meta.get('data')}; n = {n}; hardware: {meta.get('hardware')}")


def task_markdown(summary: dict, plot: str | None = None) -> str:
    """Markdown section of one task: provenance, per-mode table, paired deltas vs Full-FT, task aggregates."""
    meta = summary.get("meta") or {}
    modes = summary["modes"]
    metrics = sorted({k for m in modes.values() for k in m.get("metrics", {})})
    prim = primary_metric(summary)
    if prim in metrics:
        metrics.remove(prim)
        metrics.insert(0, prim)
    s = meta.get("settings") or {}
    env_line = environment_line(meta)
    lines = [f"### {summary.get('task')}", "",
             f"- {provenance(meta)}"] + ([f"- {env_line}"] if env_line else []) + [
             f"- decoding: greedy, max {s.get('max_new_tokens')} new tokens, same items and settings in every mode; "
             f"prompting: {s.get('prompting') or 'as defined by the task'}; handoff_tokens = {s.get('handoff_tokens', 1)}"
             + (f"; {s.get('samples')} samples per item (temperature {s.get('temperature')}, top-p {s.get('top_p')})"
                if (s.get("samples") or 1) > 1 else ""),
             ""]
    head = ["mode", "what runs", "NLL/token ↓ (95% CI)"] + [f"{k} (95% CI)" for k in metrics] + ["n", "truncated"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in sorted(modes, key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else 9):
        m = modes[mode]
        row = [mode, MODE_NOTE.get(mode, ""), _cell(m.get("nll"), m.get("nll_ci"))]
        for k in metrics:
            x = m.get("metrics", {}).get(k)
            row.append(_cell(x["mean"], x["ci"], pct=_is_rate(k, modes)) if x else "")
        row += [str(m.get("n", "")) + ("" if m.get("complete", True) else " (incomplete)"), str(m.get("truncated", ""))]
        lines.append("| " + " | ".join(row) + " |")
    deltas = summary.get("deltas_vs_full_ft") or {}
    if deltas:
        lines += ["", "Paired deltas against full-ft on the same items (mode − full-ft, 95% paired bootstrap CI):", ""]
        head = ["mode", "ΔNLL/token"] + [f"Δ{k}" for k in metrics] + ["n pairs"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for mode in sorted(deltas, key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else 9):
            d = deltas[mode]
            row = [mode, _cell(d["nll"]["delta"], d["nll"]["ci"], sign=True) if "nll" in d else ""]
            for k in metrics:
                row.append(_cell(d[k]["delta"], d[k]["ci"], pct=_is_rate(k, modes), sign=True) if k in d else "")
            row.append(str(max((v.get("n", 0) for v in d.values()), default=0)))
            lines.append("| " + " | ".join(row) + " |")
    aggs = {m: v["task_aggregate"] for m, v in modes.items() if v.get("task_aggregate")}
    if aggs:
        lines += ["", "Task aggregates (as computed by the task):", ""]
        for mode, agg in aggs.items():
            flat = ", ".join(f"{k} = {v:.4g}" if isinstance(v, (int, float)) else f"{k} = {v}" for k, v in agg.items())
            lines.append(f"- {mode}: {flat}")
    if plot:
        lines += ["", f"![{summary.get('task')}]({plot})"]
    return "\n".join(lines) + "\n"


_ENV_KEYS = ("language", "version", "isolation", "canonical_passed", "canonical_total", "mbxp_canonical_passed",
             "mbxp_canonical_total", "reference_passed", "reference_total", "checker_python")


def environment_line(meta: dict) -> str:
    """The K8 execution-environment check of a task in words ('' for tasks that execute nothing)."""
    if meta.get("unavailable"):
        return (f"**unavailable**: {meta['unavailable']} — accuracy not scored (never counted as 0); "
                "NLL on the reference answers only")
    env = meta.get("environment")
    if not isinstance(env, dict) or not any(k in env for k in _ENV_KEYS):
        return ""
    facts = ", ".join(f"{k.replace('_', ' ')} {env[k]}" for k in _ENV_KEYS if env.get(k) not in (None, ""))
    return f"execution environment checked before scoring ({'ok' if env.get('ok', True) else 'FAILED'}): {facts}"


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
    lines = ["| task | mode | metric | score (95% CI) | Δ vs full-ft (95% paired CI) | NLL/token (95% CI) | "
             "ΔNLL vs full-ft (95% paired CI) | n | setup |", "|---|---|---|---|---|---|---|---|---|"]
    for j, s in enumerate(summaries, 1):
        prim = primary_metric(s)
        deltas = s.get("deltas_vs_full_ft") or {}
        for mode in sorted(s["modes"], key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else 9):
            m = s["modes"][mode]
            x = m.get("metrics", {}).get(prim) if prim else None
            rate = bool(prim) and _is_rate(prim, s["modes"])
            d = deltas.get(mode, {})
            score = _cell(x["mean"], x["ci"], pct=rate) if x else ("unavailable" if (s.get("meta") or {}).get(
                "unavailable") else "")
            lines.append(
                f"| {s.get('task')} | {mode} | {prim or ''} | {score} | "
                f"{_cell(d[prim]['delta'], d[prim]['ci'], pct=rate, sign=True) if prim in d else ''} | "
                f"{_cell(m.get('nll'), m.get('nll_ci'))} | "
                f"{_cell(d['nll']['delta'], d['nll']['ci'], sign=True) if 'nll' in d else ''} | {m.get('n')} | [{j}] |")
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
    lines = [f"### Sharing sweep: {meta.get('task')}", "",
             f"- {provenance(meta)}",
             "- ρ over positions: per row the decoder recomputes k = max(handoff, ⌈(1−ρ)·n⌉) prompt tokens on C_base "
             "of the first n−k; over layers: the first ⌈ρ·L⌉ layers read C_base, the others the decoder's own "
             f"prefill (L = {meta.get('num_layers')}). ρ = 1 is PrefillShare / naive sharing; full-ft = own prefill.",
             ""]
    if plot:
        lines += [f"![sharing sweep]({plot})", ""]
    head = ["curve", "decoder", "axis", "ρ", "NLL/token ↓ (95% CI)", "ΔNLL vs full-ft (95% paired CI)"]
    head += [f"{k} (95% CI)" for k in accs] + ["n"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in pts:
        d = p.get("delta_nll_vs_full_ft")
        row = [p["label"], _SWEEP_NOTE.get(p["label"], ""), p["over"] or "own prefill",
               "" if p["rho"] is None else f"{p['rho']:g}", _cell(p.get("nll"), p.get("nll_ci")),
               _cell(d["delta"], d["ci"], sign=True) if d else ""]
        for k in accs:
            x = p.get("metrics", {}).get(k)
            row.append(_cell(x["mean"], x["ci"], pct=True) + f" (n={x['n']})" if x else "")
        row.append(str(p["n"]))
        lines.append("| " + " | ".join(row) + " |")
    if not has_acc:
        lines += ["", "Accuracy was not generated in this sweep (`ccft sweep --gen-rows N` adds it)."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_task(summary: dict, path) -> None:
    """Bar charts per mode: the primary metric and NLL/token, with 95% CI error bars (PNG)."""
    plt = _plt()
    modes = [m for m in MODE_ORDER if m in summary["modes"]] + [m for m in summary["modes"] if m not in MODE_ORDER]
    prim = primary_metric(summary)
    panels = [("NLL/token ↓", lambda m: (m.get("nll"), m.get("nll_ci")))]
    if prim:
        panels.insert(0, (prim, lambda m: ((m.get("metrics", {}).get(prim) or {}).get("mean"),
                                           (m.get("metrics", {}).get(prim) or {}).get("ci"))))
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep: dict, path) -> None:
    """NLL/token (and accuracy, if generated) against ρ, one panel per axis; full-ft own prefill as a line (PNG)."""
    plt = _plt()
    pts = sweep["points"]
    axes_names = [a for a in ("positions", "layers") if any(p["over"] == a for p in pts)]
    accs = sorted({k for p in pts if p["over"] for k in p.get("metrics", {})})
    rows = 1 + (1 if accs else 0)
    fig, axes = plt.subplots(rows, max(1, len(axes_names)), figsize=(4.6 * max(1, len(axes_names)), 3.4 * rows),
                             squeeze=False)
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
            for label in ("naive", "prefillshare"):
                series = sorted((p for p in pts if p["label"] == label and p["over"] == over), key=lambda p: p["rho"])
                if key == "nll" and paired:
                    vals = [(p["rho"], p["delta_nll_vs_full_ft"]["delta"], p["delta_nll_vs_full_ft"]["ci"])
                            for p in series if p.get("delta_nll_vs_full_ft")]
                elif key == "nll":
                    vals = [(p["rho"], p.get("nll"), p.get("nll_ci")) for p in series if p.get("nll") is not None]
                else:
                    vals = [(p["rho"], p["metrics"][key]["mean"], p["metrics"][key]["ci"]) for p in series
                            if key in p.get("metrics", {})]
                if not vals:
                    continue
                xs = [v[0] for v in vals]
                ax.plot(xs, [v[1] for v in vals], "o-", color=colors[label],
                        label=f"{label} ({_SWEEP_NOTE[label]})")
                ax.fill_between(xs, [v[2][0] for v in vals], [v[2][1] for v in vals], color=colors[label], alpha=0.15)
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
                    ax.axhline(y, linestyle=style, color="#1f77b4" if label == "full-ft" else "#777777",
                               label=_SWEEP_NOTE[label])
            ax.set_xlabel(f"sharing ratio ρ over {over}")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if r == 0 and col == 0:
                ax.legend(fontsize=7)
    meta = sweep["meta"]
    fig.suptitle(f"Sharing sweep, {meta.get('task')} — {meta.get('model')}, n={meta.get('n_items')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ collecting runs


def _legacy_summary(data: dict, path) -> dict:
    """A demo ``results.json`` (or an old ``ccft eval`` ``gsm8k.json``) as an eval summary with item records."""
    from ccft.evals.runner import paired_deltas_by_id, summarize_records

    per_row = data.get("per_row") or {}
    records = {}
    for mode, rows in per_row.items():
        recs = [{"id": str(i), "index": i, "nll": v} for i, v in enumerate(rows.get("nll_rows", []))]
        for key, metric in (("em_strict_rows", "exact_match_strict"), ("em_flexible_rows", "exact_match_flexible")):
            for i, v in enumerate(rows.get(key, [])):
                if i >= len(recs):
                    recs.append({"id": str(i), "index": i})
                recs[i].setdefault("scores", {})[metric] = float(v)
        records[mode] = recs
    d = data.get("data") or {}
    meta = {"task": data.get("task", "gsm8k"), "model": data.get("model"), "hardware": data.get("hardware"),
            "data": d.get("eval_nll") if isinstance(d, dict) else d, "primary_metric": "exact_match_flexible",
            "n_items": max((len(r) for r in records.values()), default=0), "source": str(path)}
    modes = {m: summarize_records(r) for m, r in records.items()}
    for m in modes.values():
        m.update(model=meta["model"], data=meta["data"], hardware=meta["hardware"])
    return {"kind": "ccft-eval", "task": meta["task"], "meta": meta, "modes": modes,
            "deltas_vs_full_ft": paired_deltas_by_id(records), "records": records, "folder": str(path)}


def collect_runs(paths) -> tuple[list[dict], list[dict]]:
    """(eval summaries, sweep summaries) found under ``paths`` (folders searched recursively, or files)."""
    import json
    from pathlib import Path

    from ccft.evals.runner import load_task_folder

    evals, sweeps, seen = [], [], set()
    for root in map(Path, paths):
        if not root.exists():
            from ccft.core.errors import ConfigError

            raise ConfigError(f"{root} does not exist; pass result folders written by `ccft eval` / `ccft sweep`")
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
                    evals.append(_legacy_summary(data, f))
    return evals, sweeps


def build_report(paths, out_dir, *, title: str = "ccft report") -> dict:
    """Write ``out_dir/README.md``, ``out_dir/report.json`` and PNG plots from result folders; returns report.json."""
    import json
    import time
    from pathlib import Path

    from ccft.core.checkpoint import atomic_write_text
    from ccft.core.errors import ConfigError

    evals, sweeps = collect_runs(paths)
    if not evals and not sweeps:
        raise ConfigError(f"no results under {', '.join(map(str, paths))}: expected folders written by "
                          "`ccft eval --out` (meta.json + items.MODE.jsonl) or `ccft sweep --out` (sweep.json)")
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
    md = [f"# {title}", "",
          f"Generated by `ccft report` on {time.strftime('%Y-%m-%d %H:%M')} from: "
          + ", ".join(f"`{p}`" for p in paths) + ".", ""]
    if plot_error:
        md += [f"_{plot_error}_", ""]
    if evals:
        md += ["## Headline", "",
               "Primary metric and response NLL per token of each mode on the same items, with 95% percentile "
               "bootstrap intervals over items; deltas are paired (mode − full-ft, items resampled jointly).", "",
               headline_table(evals), "", "## Tasks", ""]
        for s in evals:
            md.append(task_markdown(s, plots.get(s["task"])))
        envs = environments_table(evals)
        if envs:
            md += ["## Execution environments (K8)", "",
                   "Checked before any model was scored: canonical solutions must pass in the exact sandbox; a "
                   "language whose toolchain is missing is reported unavailable, never scored as 0.", "", envs, ""]
    if sweeps:
        md += ["## Sharing sweep", ""]
        for i, sw in enumerate(sweeps):
            md.append(sweep_markdown(sw, plots.get(f"sweep:{i}")))
    from ccft.evals.evaluate import hardware

    report = {"title": title, "generated": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": [str(p) for p in paths],
              "report_hardware": hardware(), "plots": plots, "plot_error": plot_error,
              "headline": [{"task": s.get("task"), "mode": mode, "primary_metric": primary_metric(s),
                            "score": (m.get("metrics", {}).get(primary_metric(s)) or {}).get("mean"),
                            "score_ci": (m.get("metrics", {}).get(primary_metric(s)) or {}).get("ci"),
                            "nll": m.get("nll"), "nll_ci": m.get("nll_ci"), "n": m.get("n"),
                            "delta_vs_full_ft": (s.get("deltas_vs_full_ft") or {}).get(mode),
                            "model": (s.get("meta") or {}).get("model"), "data": (s.get("meta") or {}).get("data"),
                            "hardware": (s.get("meta") or {}).get("hardware")}
                           for s in evals for mode, m in s["modes"].items()],
              "tasks": evals, "sweeps": sweeps}
    atomic_write_text(out / "README.md", "\n".join(md))
    atomic_write_text(out / "report.json", json.dumps(report, indent=2, default=str))
    return report


def _slug(s) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(s)).strip("-") or "task"
