"""The accuracy–memory frontier of partial-depth sharing: per specialist, what a decoder's own prompt KV in
its first m layers buys back in accuracy, and what it costs in KV bytes and prefill work (issue 35, items 5–6;
docs/study.md, "Frontier").

Points of one task (the same items, settings and seed as the study's evaluation of it):

* ``full-ft``: the Full-FT decoder on its own prefill (the accuracy reference; m = L);
* ``naive``: the Full-FT decoder on ``C_base`` (m = 0); ``naive m=k``: the same decoder reading its own K/V
  of the prompt in layers ``0..k−1`` and ``C_base`` above (no training);
* ``prefillshare m=0``: the study's CCFT decoder on ``C_base``;
* ``prefillshare m=k``: a CCFT decoder trained at sharing depth k (``share_from_layer: k``, its own K/V of the
  prompt in layers ``0..k−1``, ``C_base`` above; ``ccft.core.depth``), evaluated on that hybrid cache;
* ``prefillshare int8 (native-trained)`` / ``prefillshare int8 (int8-trained)``, for each compact format of
  ``cache_formats``: the study's CCFT decoder served on the compact C_base (``ccft.core.compact``), and a CCFT
  decoder trained on it (``cache_format: int8``) served on it.

Each point has the task's primary and secondary metric and NLL/token with 95% bootstrap CIs, the paired
bootstrap Δ against Full-FT on the same items (``ccft.evals.stats.paired_bootstrap_delta``), the KV bytes
one session of N agents holds (``session_kv_bytes``) and the prefill work of that session
(``session_prefill_layer_tokens``), for each N of ``agents``.

Memory model (PrefillShare's Eq. 9, generalised to depth m; in words): a session of N agents shares one prompt
of P tokens and each agent adds U tokens of its own (its response). Without sharing every agent holds its own
KV of all P + U tokens in all L layers: ``N·(P + U)·L`` layer-tokens. With sharing at depth m the base's
``C_base`` is held once (``P·L``), every agent holds its own K/V of the prompt in its first m layers
(``N·P·m``) and of its own tokens in every layer (``N·U·L``): ``P·L·(1 + N·m/L) + N·U·L``. m = 0 is the
paper's Eq. 9. A compact C_base scales its term ``P·L`` by its bytes ÷ the native cache's (``kv_nbytes``).
Bytes = layer-tokens × 2 (K and V) × KV heads × head dim × bytes per element. Prefill work counts the
layer-tokens run over the prompt: ``N·P·L`` without sharing, ``P·(L + N·m)`` with it. Both are computed from
the evaluated items' mean prompt and response lengths, not measured in a server.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from ccft.core.errors import ConfigError

#: the compact C_base formats a frontier may add (``ccft.core.compact.CACHE_FORMATS`` less ``native``)
COMPACT_FORMATS = ("int8",)

__all__ = [
    "FRONTIER_KEYS",
    "FrontierConfig",
    "parse_frontier",
    "session_kv_bytes",
    "session_prefill_layer_tokens",
    "frontier_points",
    "frontier_markdown",
    "plot_frontier",
    "choose_depth",
]

FRONTIER_KEYS = {"depths", "specialists", "agents", "target_retention", "cache_formats"}


class FrontierConfig:
    """``frontier:`` of a study config: the sharing depths to train (each ≥ 1; m = 0 is the study's own CCFT
    decoder), the specialists to run them for, the agent counts N of the memory columns, the retention
    target of ``choose_depth`` (prefillshare's primary metric ÷ Full-FT's), and the compact C_base formats
    whose two points (served on it, trained on it) are added."""

    def __init__(
        self,
        depths: Sequence[int] = (),
        specialists: Sequence[str] = (),
        agents: Sequence[int] = (4, 8),
        target_retention: float = 0.95,
        cache_formats: Sequence[str] = (),
    ):
        self.depths = [int(m) for m in depths]
        self.cache_formats = list(cache_formats)
        self.specialists = list(specialists)
        self.agents = [int(n) for n in agents]
        self.target_retention = float(target_retention)

    def as_dict(self) -> dict:
        return {
            "depths": self.depths,
            "specialists": self.specialists,
            "agents": self.agents,
            "target_retention": self.target_retention,
            "cache_formats": self.cache_formats,
        }


def parse_frontier(raw, where: str, specialists: Sequence[str]) -> FrontierConfig | None:
    """The validated ``frontier:`` section (None when absent or empty).

    Raises:
        ConfigError: not a mapping, an unknown key, a depth that is not an integer ≥ 1, a specialist the
            study does not train, an agent count < 1, a target outside (0, 1]; the message names ``where`` and
            the key.
    """
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where}: frontier must be a mapping ({{depths: [1, 2, 4, 8], specialists: [tools]}})"
        )
    bad = sorted(set(raw) - FRONTIER_KEYS)
    if bad:
        raise ConfigError(f"{where}: frontier: unknown key(s) {bad}; use {sorted(FRONTIER_KEYS)}")
    depths = raw.get("depths") or []
    if not isinstance(depths, list) or not all(
        isinstance(m, int) and not isinstance(m, bool) for m in depths
    ):
        raise ConfigError(f"{where}: frontier.depths must be a list of integers, e.g. [1, 2, 4, 8]")
    if any(m < 1 for m in depths) or len(set(depths)) != len(depths):
        raise ConfigError(
            f"{where}: frontier.depths {depths}: each depth once and ≥ 1 "
            "(m = 0 is the study's own CCFT decoder)"
        )
    names = raw.get("specialists", list(specialists))
    if not isinstance(names, list) or not names:
        raise ConfigError(
            f"{where}: frontier.specialists must list specialists of the study, e.g. [tools, code]"
        )
    unknown = [n for n in names if n not in specialists]
    if unknown:
        raise ConfigError(
            f"{where}: frontier.specialists {unknown} are not specialists of this study; use some of "
            f"{sorted(specialists)}"
        )
    agents = raw.get("agents", [4, 8])
    if not isinstance(agents, list) or not agents or not all(isinstance(n, int) and n >= 1 for n in agents):
        raise ConfigError(f"{where}: frontier.agents must list agent counts ≥ 1, e.g. [4, 8]")
    target = raw.get("target_retention", 0.95)
    if not isinstance(target, (int, float)) or isinstance(target, bool) or not 0 < target <= 1:
        raise ConfigError(f"{where}: frontier.target_retention={target!r}: give a share in (0, 1], e.g. 0.95")
    formats = raw.get("cache_formats") or []
    if not isinstance(formats, list) or any(f not in COMPACT_FORMATS for f in formats):
        raise ConfigError(
            f"{where}: frontier.cache_formats={formats!r}: list compact C_base formats from "
            f"{list(COMPACT_FORMATS)} (the native cache is every other point)"
        )
    if not depths and not formats:
        return None
    return FrontierConfig(sorted(depths), names, agents, target, formats)


def session_kv_bytes(
    *,
    layers: int,
    depth: int | None,
    agents: int,
    prompt_tokens: float,
    own_tokens: float,
    bytes_per_layer_token: int,
    cbase_ratio: float = 1.0,
) -> float:
    """KV bytes one session of ``agents`` agents holds (module docstring, "Memory model").

    Args:
        layers: L.  depth: m, the layers below which each agent holds its own prompt K/V (0 = PrefillShare's
            full sharing); None = no sharing (every agent prefills the prompt itself, Full-FT).
        agents: N.  prompt_tokens: P, the shared prompt.  own_tokens: U, each agent's own tokens.
        bytes_per_layer_token: 2 · KV heads · head dim · bytes per element.
        cbase_ratio: bytes of the stored C_base ÷ the native cache's (1: native; int8 ≈ 1/3.93 of fp32).
    Returns:
        bytes (float; means of token counts may be fractional).
    Raises:
        ConfigError: a depth outside 0..L.
    """
    L, N, P, U = int(layers), int(agents), float(prompt_tokens), float(own_tokens)
    if depth is None:
        layer_tokens = N * (P + U) * L
    else:
        if not 0 <= depth <= L:
            raise ConfigError(f"depth m={depth} outside 0..{L} (the model has {L} layers)")
        layer_tokens = P * L * float(cbase_ratio) + N * P * depth + N * U * L
    return layer_tokens * bytes_per_layer_token


def session_prefill_layer_tokens(
    *, layers: int, depth: int | None, agents: int, prompt_tokens: float
) -> float:
    """Layer-tokens run over the shared prompt for one session: ``N·P·L`` without sharing (``depth`` None),
    ``P·(L + N·m)`` with sharing at depth m (the base's full prefill once, each agent's partial one)."""
    L, N, P = int(layers), int(agents), float(prompt_tokens)
    if depth is None:
        return N * P * L
    return P * (L + N * int(depth))


def _scores(records: Mapping[str, dict], ids: Sequence[str], metric: str | None) -> list[float] | None:
    if metric is None:
        return None
    out = []
    for i in ids:
        r = records[i]
        v = r.get("nll") if metric == "nll" else (r.get("scores") or {}).get(metric)
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return None
        out.append(float(v))
    return out


def m0_reference(label: str) -> str | None:
    """The m = 0 point a frontier point is paired against: ``prefillshare m=0`` for every other PrefillShare
    point (depths and compact formats), ``naive`` for ``naive m=k``; None for full-ft and the m = 0 points."""
    mode = label.split(" ")[0]
    if mode == "prefillshare" and label != "prefillshare m=0":
        return "prefillshare m=0"
    if mode == "naive" and label != "naive":
        return "naive"
    return None


def paired_against_m0(
    records: Mapping[str, Mapping[str, dict]],
    ids: Sequence[str],
    metrics: tuple[str, str | None],
    *,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """label → ``{"primary" | "secondary" | "nll": {"delta", "ci"}}``: each point minus its m = 0 point
    (``m0_reference``) on the items ``ids``, by the same paired bootstrap as the deltas against Full-FT."""
    from ccft.evals.stats import paired_bootstrap_delta

    primary, secondary = metrics
    out: dict = {}
    for label, recs in records.items():
        ref = m0_reference(label)
        if ref is None or ref not in records:
            continue
        out[label] = {}
        for key, metric in (("primary", primary), ("secondary", secondary), ("nll", "nll")):
            xs, ys = _scores(recs, ids, metric), _scores(records[ref], ids, metric)
            if xs is not None and ys is not None:
                d = paired_bootstrap_delta(xs, ys, n_resamples=n_resamples, seed=seed)
                out[label][key] = {"delta": d["delta"], "ci": list(d["ci"])}
    return out


def frontier_points(
    task: str,
    records: Mapping[str, Mapping[str, dict]],
    *,
    metrics: tuple[str, str | None],
    layers: int,
    bytes_per_layer_token: int,
    agents: Sequence[int],
    cbase_ratio: Mapping[str, float] | None = None,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """The frontier of one task from its per-item records.

    Args:
        task: the task's name.  metrics: its (primary, secondary) metric keys (``config.metrics_of``).
        records: point label → item id → record (``items.MODE.jsonl`` rows); labels ``full-ft``, ``naive``,
            ``prefillshare m=0``, ``prefillshare m=K``. Every point is scored on the items every point has.
        layers: L of the base.  bytes_per_layer_token: 2 · KV heads · head dim · bytes per element.
        agents: the N of the memory columns.
        cbase_ratio: label → the stored C_base's bytes ÷ the native cache's, for points on a compact C_base.
    Returns:
        ``{"task", "primary_metric", "secondary_metric", "n", "prompt_tokens", "own_tokens", "layers",
        "points": [{"label", "mode", "depth", "primary", "primary_ci", "secondary", "secondary_ci", "nll",
        "nll_ci", "paired_vs_full_ft": {metric: {"delta", "ci"}}, "paired_vs_m0"
        (``paired_against_m0``; not on full-ft and the m = 0 points), "retention", "kv_bytes": {N: bytes},
        "prefill_layer_tokens": {N: ...}}]}``; ``depth`` None for full-ft.
    Raises:
        ConfigError: no full-ft point, or no item common to every point.
    """
    from ccft.evals.stats import mean_ci, paired_bootstrap_delta

    if "full-ft" not in records:
        raise ConfigError(f"{task}: the frontier needs the full-ft point (the accuracy reference)")
    common = set.intersection(*(set(r) for r in records.values()))
    if not common:
        raise ConfigError(f"{task}: no item is evaluated at every frontier point")
    ref = records["full-ft"]
    ids = sorted(common, key=lambda i: (ref[i].get("index", 0), i))
    primary, secondary = metrics
    prompt = sum(ref[i].get("prompt_tokens", 0) for i in ids) / len(ids)
    # each agent's own tokens: its mean response length over the points that share (generation may differ)
    own_of = {
        label: sum(recs[i].get("new_tokens", 0) for i in ids) / len(ids) for label, recs in records.items()
    }
    ref_scores = {m: _scores(ref, ids, m) for m in (primary, secondary, "nll")}
    points = []
    for label, recs in records.items():
        mode = label.split(" ")[0]
        depth = None if mode == "full-ft" else int(label.split("m=")[1]) if "m=" in label else 0
        fmt = next((f for f in COMPACT_FORMATS if f" {f} " in f"{label} "), "native")
        point: dict = {"label": label, "mode": mode, "depth": depth, "cache_format": fmt}
        for key, metric in (("primary", primary), ("secondary", secondary), ("nll", "nll")):
            xs = _scores(recs, ids, metric)
            if xs is None:
                point[key], point[f"{key}_ci"] = None, None
                continue
            s = mean_ci(xs, n_resamples=n_resamples, seed=seed)
            point[key], point[f"{key}_ci"] = s["mean"], list(s["ci"])
        point["paired_vs_full_ft"] = {}
        if label != "full-ft":
            for key, metric in (("primary", primary), ("secondary", secondary), ("nll", "nll")):
                xs, ys = _scores(recs, ids, metric), ref_scores[metric]
                if xs is not None and ys is not None:
                    d = paired_bootstrap_delta(xs, ys, n_resamples=n_resamples, seed=seed)
                    point["paired_vs_full_ft"][key] = {"delta": d["delta"], "ci": list(d["ci"])}
        full = ref_scores[primary]
        point["retention"] = (
            point["primary"] / (sum(full) / len(full))
            if full and sum(full) > 0 and point["primary"] is not None
            else None
        )
        point["kv_bytes"] = {
            str(n): session_kv_bytes(
                layers=layers,
                depth=depth,
                agents=n,
                prompt_tokens=prompt,
                own_tokens=own_of[label],
                bytes_per_layer_token=bytes_per_layer_token,
                cbase_ratio=(cbase_ratio or {}).get(label, 1.0),
            )
            for n in agents
        }
        point["prefill_layer_tokens"] = {
            str(n): session_prefill_layer_tokens(layers=layers, depth=depth, agents=n, prompt_tokens=prompt)
            for n in agents
        }
        points.append(point)
    vs_m0 = paired_against_m0(records, ids, metrics, n_resamples=n_resamples, seed=seed)
    for point in points:
        if point["label"] in vs_m0:
            point["paired_vs_m0"] = vs_m0[point["label"]]
    points.sort(key=lambda p: (p["depth"] is None, p["mode"] != "naive", p["depth"] or 0))
    return {
        "task": task,
        "primary_metric": primary,
        "secondary_metric": secondary,
        "n": len(ids),
        "prompt_tokens": prompt,
        "own_tokens": own_of,
        "layers": layers,
        "points": points,
    }


def choose_depth(frontier: dict, target_retention: float) -> dict:
    """The smallest trained depth m whose prefillshare retention (primary ÷ Full-FT's) meets the target, and
    how sure: ``"resolved"`` when the paired Δ's CI against Full-FT lies above ``−(1 − target)·FullFT``,
    ``"point estimate only"`` when only the mean meets it. ``{"depth": None, ...}`` when no depth does."""
    full = next(p for p in frontier["points"] if p["mode"] == "full-ft")
    margin = -(1 - target_retention) * (full["primary"] or 0.0)
    for p in frontier["points"]:
        if (
            p["mode"] != "prefillshare"
            or p.get("cache_format", "native") != "native"
            or p["retention"] is None
            or p["retention"] < target_retention
        ):
            continue
        d = p["paired_vs_full_ft"].get("primary")
        sure = "resolved" if d and d["ci"][0] >= margin else "point estimate only"
        return {
            "depth": p["depth"],
            "retention": p["retention"],
            "confidence": sure,
            "target": target_retention,
        }
    return {
        "depth": None,
        "retention": None,
        "confidence": "no trained depth meets it",
        "target": target_retention,
    }


def _fmt(x, pct=False, sign=False) -> str:
    if x is None:
        return "–"
    v = 100 * x if pct else x
    return (f"{v:+.1f}" if sign else f"{v:.1f}") if pct else (f"{v:+.3f}" if sign else f"{v:.3f}")


def _delta_cell(d: dict | None, pct: bool = False) -> str:
    """``Δ [lo, hi]`` of a paired difference ('' when there is none); NLL with 4 decimals (its CIs are
    narrow), the primary metric in points."""
    if d is None:
        return ""
    if pct:
        return (
            f"{_fmt(d['delta'], pct=True, sign=True)} "
            f"[{_fmt(d['ci'][0], pct=True, sign=True)}, {_fmt(d['ci'][1], pct=True, sign=True)}]"
        )
    return f"{d['delta']:+.4f} [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]"


def frontier_markdown(frontiers: Mapping[str, Sequence[dict]], plots: Mapping[str, str] | None = None) -> str:
    """The frontier tables (one per specialist and task) as Markdown."""
    lines = ["## Frontier: sharing depth against accuracy and memory", ""]
    for spec, tasks in frontiers.items():
        for f in tasks:
            agents = list(f["points"][0]["kv_bytes"])
            lines += [
                f"### {spec}: {f['task']} (n = {f['n']}, L = {f['layers']}, "
                f"mean prompt {f['prompt_tokens']:.0f} tokens)",
                "",
                f"Primary metric {f['primary_metric']} (%), Δ paired against Full-FT and against m = 0 of "
                "the point's own mode (PrefillShare m = 0 for PrefillShare's depths and formats, naive for "
                "naive's), each with its 95% CI; KV of one session and the layer-tokens prefilled for it at "
                "N agents, relative to Full-FT's (module `ccft.evals.study.frontier`).",
                "",
                "| point | own prompt KV layers | C_base format | primary | Δ primary vs Full-FT | "
                "Δ primary vs m = 0 | NLL/token | Δ NLL vs Full-FT | Δ NLL vs m = 0 | "
                + " | ".join(f"KV MB (N={n})" for n in agents)
                + " | "
                + " | ".join(f"prefill × full (N={n})" for n in agents)
                + " |",
                "|" + "---|" * (9 + 2 * len(agents)),
            ]
            full = next(p for p in f["points"] if p["mode"] == "full-ft")
            for p in f["points"]:
                dp = p["paired_vs_full_ft"].get("primary")
                dn = p["paired_vs_full_ft"].get("nll")
                mp = (p.get("paired_vs_m0") or {}).get("primary")
                mn = (p.get("paired_vs_m0") or {}).get("nll")
                own = "all" if p["depth"] is None else str(p["depth"])
                cells = [
                    p["label"],
                    own,
                    p.get("cache_format", "native") if p["mode"] != "full-ft" else "–",
                    _fmt(p["primary"], pct=True),
                    _delta_cell(dp, pct=True),
                    _delta_cell(mp, pct=True),
                    _fmt(p["nll"]),
                    _delta_cell(dn),
                    _delta_cell(mn),
                ]
                cells += [f"{p['kv_bytes'][n] / 1e6:.2f}" for n in agents]
                cells += [
                    f"{p['prefill_layer_tokens'][n] / full['prefill_layer_tokens'][n]:.2f}" for n in agents
                ]
                lines.append("| " + " | ".join(cells) + " |")
            if f.get("choice"):
                c = f["choice"]
                lines += [
                    "",
                    (
                        f"Smallest depth with prefillshare retention ≥ {c['target']:.0%}: m = {c['depth']} "
                        f"(retention {c['retention']:.0%}; {c['confidence']})."
                        if c["depth"] is not None
                        else f"No trained depth reaches a retention of {c['target']:.0%} ({c['confidence']})."
                    ),
                ]
            plot = (plots or {}).get(f"{spec}/{f['task']}")
            if plot:
                lines += ["", f"![{spec} {f['task']} frontier]({plot})"]
            lines.append("")
    return "\n".join(lines)


def plot_frontier(frontier: dict, path) -> None:
    """Primary metric (with its CI) against one session's KV MB at the largest N, one point per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = list(frontier["points"][0]["kv_bytes"])[-1]
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in frontier["points"]:
        if p["primary"] is None:
            continue
        x = p["kv_bytes"][n] / 1e6
        y = 100 * p["primary"]
        lo, hi = (100 * c for c in p["primary_ci"])
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3)
        ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(f"KV of one session, MB (N = {n} agents)")
    ax.set_ylabel(f"{frontier['primary_metric']} (%)")
    ax.set_title(f"{frontier['task']}: sharing depth frontier (n = {frontier['n']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
