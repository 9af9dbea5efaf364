"""Item records -> summaries: the one result format of ``ccft eval``, ``ccft demo`` and ``ccft report``.

An item record (one JSON line of ``items.MODE.jsonl``) holds ``id``, ``index``, ``prompt_sha``,
``prompt_tokens``; ``nll`` (mean NLL per response token, nats), ``nll_sum``, ``nll_tokens`` when the
item has a reference; ``text``, ``finish_reason``, ``new_tokens``, ``scores`` (``{metric: float}``)
when it was generated (and ``samples`` with n > 1 samples per item).

A mode's summary: ``n`` items, mean NLL with a 95% percentile-bootstrap CI over items, every metric's
mean with its CI and ``n``, ``scored_n``, ``truncated`` (generations that hit ``max_new_tokens``),
the task's own aggregate. Deltas against ``full-ft`` (``ccft.core.modes.REFERENCE_MODE``) are
paired by item id (paired bootstrap over the items both modes finished).
"""

from __future__ import annotations

from typing import Any, Sequence

from ccft.core.modes import REFERENCE_MODE
from ccft.evals.stats import mean_ci, paired_bootstrap_delta

__all__ = ["paired_deltas_by_id", "summarize_records", "summarize_task"]


def summarize_records(records: Sequence[dict], task=None, *, n_resamples: int = 2000, seed: int = 0) -> dict:
    """Per-mode block: n, mean NLL/token and every metric with 95% percentile-bootstrap CIs over items.

    ``task.aggregate`` (when ``task`` has one) adds ``task_aggregate``; if it raises, ``task_aggregate_error``
    names the error and the run's own numbers are kept.
    """
    out: dict[str, Any] = {"n": len(records)}
    nll = [r["nll"] for r in records if r.get("nll") is not None]
    if nll:
        m = mean_ci(nll, n_resamples=n_resamples, seed=seed)
        out.update(nll=m["mean"], nll_ci=list(m["ci"]), nll_n=len(nll))
        weighted = [r for r in records if r.get("nll") is not None and "nll_sum" in r]
        if len(weighted) == len(nll):  # NLL over all response tokens pooled (rows weighted by length)
            out["nll_token_weighted"] = sum(r["nll_sum"] for r in weighted) / max(
                1, sum(r["nll_tokens"] for r in weighted)
            )
    scored = [r for r in records if "scores" in r]
    if scored:
        metrics: dict[str, dict] = {}
        keys = sorted({k for r in scored for k in r["scores"]})
        for k in keys:
            vals = [r["scores"][k] for r in scored if k in r["scores"]]
            m = mean_ci(vals, n_resamples=n_resamples, seed=seed)
            metrics[k] = {"mean": m["mean"], "ci": list(m["ci"]), "n": len(vals)}
        out["metrics"] = metrics
        out["scored_n"] = len(scored)
        out["truncated"] = sum(r.get("finish_reason") == "length" for r in scored)
        if task is not None and hasattr(task, "aggregate"):
            try:
                per_item = {
                    r["id"]: [x["scores"] for x in r["samples"]] if "samples" in r else [r["scores"]]
                    for r in scored
                }
                agg = task.aggregate(per_item)
                out["task_aggregate"] = agg if isinstance(agg, dict) else {"value": agg}
            except Exception as e:  # a task's own aggregate must not lose the run's numbers
                out["task_aggregate_error"] = f"{type(e).__name__}: {e}"
    return out


def paired_deltas_by_id(
    per_mode: dict[str, Sequence[dict]],
    reference: str = REFERENCE_MODE,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """Paired-bootstrap deltas (mode − reference) of NLL and every metric, on the items both modes
    finished."""
    if reference not in per_mode:
        return {}
    ref = {r["id"]: r for r in per_mode[reference]}
    out = {}
    for mode, recs in per_mode.items():
        if mode == reference:
            continue
        d: dict[str, Any] = {}
        pairs = [(r, ref[r["id"]]) for r in recs if r["id"] in ref]
        nll = [
            (a["nll"], b["nll"]) for a, b in pairs if a.get("nll") is not None and b.get("nll") is not None
        ]
        if nll:
            p = paired_bootstrap_delta(
                [x for x, _ in nll], [y for _, y in nll], n_resamples=n_resamples, seed=seed
            )
            d["nll"] = {"delta": p["delta"], "ci": list(p["ci"]), "n": p["n"]}
        keys = sorted({k for a, b in pairs for k in a.get("scores", {}) if k in b.get("scores", {})})
        for k in keys:
            xy = [
                (a["scores"][k], b["scores"][k])
                for a, b in pairs
                if k in a.get("scores", {}) and k in b.get("scores", {})
            ]
            p = paired_bootstrap_delta(
                [x for x, _ in xy], [y for _, y in xy], n_resamples=n_resamples, seed=seed
            )
            d[k] = {"delta": p["delta"], "ci": list(p["ci"]), "n": p["n"]}
        out[mode] = d
    return out


def summarize_task(
    meta: dict, records: dict[str, list[dict]], task=None, *, n_resamples: int = 2000, seed: int = 0
) -> dict:
    """``summary.json`` of a task folder: ``meta`` + per-mode summaries + paired deltas vs Full-FT.

    Each mode's block also names the model, data and hardware (from ``meta``) and whether it is
    ``complete`` (all ``meta["n_items"]`` items finished).
    """
    modes = {m: summarize_records(r, task, n_resamples=n_resamples, seed=seed) for m, r in records.items()}
    for s in modes.values():
        s.update(
            model=meta.get("model"),
            data=meta.get("data"),
            hardware=meta.get("hardware"),
            complete=s["n"] == meta.get("n_items"),
        )
    return {
        "kind": "ccft-eval",
        "task": meta.get("task"),
        "meta": meta,
        "modes": modes,
        "deltas_vs_full_ft": paired_deltas_by_id(records, n_resamples=n_resamples, seed=seed),
    }
