"""Sharing sweep (PrefillShare Fig. 2): response NLL (and accuracy where cheap) against the sharing ratio ρ.

The curves are the shared-prefill modes of ``ccft.core.modes`` (``Mode.shared_prefill``), each with the
decoder that mode runs: a Full-FT decoder (curve ``naive``) and a CCFT decoder (curve ``prefillshare``).
At every ρ in
``rhos`` and along each axis (``positions``, ``layers``; see ``ccft.evals.sharing``), the sweep
scores the same items of a task: per-item response NLL per token on the reference answer, and,
for the first ``gen_rows`` items, a greedy generation scored by the task. Two references are
measured on the same items: the own-prefill modes ``full-ft`` (the Full-FT decoder on its own prefill:
the accuracy reference; equal to the naive curve at ρ=0) and ``base``. Items, prompt ids
(``ccft.evals.prompting``), NLL (``ccft.evals.scoring``) and scores (the task's) follow the eval runner.

Output folder: ``meta.json`` (task, model, data, n, hardware, settings), ``points.jsonl`` (one line
per finished (curve, axis, ρ) point with its per-item numbers; a rerun skips finished points) and
``sweep.json`` (summary with 95% bootstrap CIs and paired deltas against ``full-ft``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch
from tqdm.auto import tqdm

from ccft.core.decoder import Decoder, check_base_reader, resolve_handoff
from ccft.core.errors import ConfigError
from ccft.core.generation import generate
from ccft.core.io import atomic_write_text
from ccft.core.modes import MODES, REFERENCE_MODE, decoder_for_mode, get_mode
from ccft.evals.prompting import PromptFormat
from ccft.evals.protocol import normalize_scores, score_texts, task_description, task_name, task_stop
from ccft.evals.results import append_jsonl, describe_base, hardware, read_jsonl
from ccft.evals.scoring import NLL_TOKENS, batch_nll, length_chunks, prepare, prompt_hash
from ccft.evals.sharing import (
    AXES,
    recompute_tokens,
    row_nlls,
    shared_forward,
    shared_generate,
    shared_layer_list,
)
from ccft.evals.stats import mean_ci, paired_bootstrap_delta

RHOS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: curve -> the method of the decoder it runs: every shared-prefill mode of ``ccft.core.modes``
CURVES = {m: get_mode(m).decoder_method for m in MODES if get_mode(m).shared_prefill}
#: the own-prefill modes measured as references, the reference mode (``full-ft``) first
REFERENCES = tuple(
    sorted((m for m in MODES if not get_mode(m).shared_prefill), key=lambda m: m != REFERENCE_MODE)
)


def _key(label: str, over: str | None, rho: float | None) -> str:
    return f"{label}|{over}|{rho}"


@torch.no_grad()
def _point(
    task,
    base,
    decoder: Decoder | None,
    prep,
    *,
    label: str,
    over: str | None,
    rho: float | None,
    batch_size: int,
    gen_rows: int,
    max_new_tokens: int,
    bar,
) -> dict:
    rows = [i for i in range(prep.n) if prep.references[i] is not None]
    nll: dict[int, tuple[float, int]] = {}
    # forwards of rows of similar prompt + reference length (every point recomputes some of the prompt)
    for chunk in length_chunks(
        {i: len(prep.prompts[i]) + len(prep.references[i]) for i in rows}, batch_size, NLL_TOKENS
    ):
        prompts = [prep.prompts[i] for i in chunk]
        refs = [prep.references[i] for i in chunk]
        if over is None:  # a reference: an own-prefill mode (full-ft, base)
            k = decoder.handoff_tokens if decoder is not None else 1
            vals = batch_nll(label, base, decoder, prompts, refs, handoff_tokens=k)
        else:
            vals = row_nlls(*shared_forward(base, decoder, prompts, refs, over=over, rho=rho))
        nll.update(zip(chunk, vals, strict=True))
        bar.update(len(chunk))
    point = {
        "label": label,
        "over": over,
        "rho": rho,
        "ids": [prep.ids[i] for i in sorted(nll)],
        "nll": [nll[i][0] / max(1, nll[i][1]) for i in sorted(nll)],
        "nll_tokens": [nll[i][1] for i in sorted(nll)],
    }
    point.update(_axis_fields(prep, base, decoder, over, rho, sorted(nll)))
    if gen_rows > 0:
        gi = list(range(min(gen_rows, prep.n)))
        scores, texts = [], []
        for s in range(0, len(gi), batch_size):
            chunk = gi[s : s + batch_size]
            by_stop: dict[tuple, list[int]] = {}
            for i in chunk:
                by_stop.setdefault(tuple(task_stop(task, prep.items[i])), []).append(i)
            for stop, idx in by_stop.items():
                prompts = [prep.prompts[i] for i in idx]
                kw = dict(max_new_tokens=max_new_tokens, stop=list(stop))
                if over is None:
                    gens = generate(
                        prompts, mode=label, base=base, decoder=decoder, batch_size=len(idx), **kw
                    )
                else:
                    gens = shared_generate(base, decoder, prompts, over=over, rho=rho, **kw)
                raws = score_texts(task, [(prep.items[i], g.text) for i, g in zip(idx, gens, strict=True)])
                for i, g, raw in zip(idx, gens, raws, strict=True):
                    scores.append((i, normalize_scores(raw)))
                    texts.append((i, g.text))
            bar.update(len(chunk))
        scores.sort(key=lambda x: x[0])
        texts.sort(key=lambda x: x[0])
        point["gen_ids"] = [prep.ids[i] for i, _ in scores]
        point["scores"] = [s for _, s in scores]
        point["texts"] = [t for _, t in texts]
    return point


def run_sweep(
    task,
    base,
    decoders: dict[str, Decoder],
    out_dir: str | Path,
    *,
    rhos: Sequence[float] = RHOS,
    axes: Sequence[str] = AXES,
    limit: int | None = None,
    batch_size: int = 8,
    gen_rows: int = 0,
    max_new_tokens: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    decoder_paths: dict[str, str] | None = None,
    n_resamples: int = 2000,
    prompt_format: PromptFormat | None = None,
    eval_records: Mapping[str, Mapping[str, dict]] | None = None,
) -> dict:
    """Run (or resume) the sharing sweep; returns the ``sweep.json`` summary.

    Args:
        decoders: ``{curve: decoder}`` with curves of ``CURVES``: ``{"naive": full_ft_decoder,
            "prefillshare": ccft_decoder}`` (either may be missing).
        rhos: sharing ratios in [0, 1]; axes: ``positions`` and/or ``layers``.
        gen_rows: items (the first ones) also generated greedily and scored by the task at each point.
        prompt_format: the decoders' training format (``ccft.evals.prompting``); None: the task's own.
        eval_records: ``{mode: {item id: record}}`` of an eval run (``ccft.evals.runner``) of the same task
            with the same base and decoders. The points that are exactly an eval mode take its per-item NLLs
            instead of computing them again: the references (``base``, ``full-ft``), ρ = 1 on either axis (the
            shared mode itself) and the naive curve at ρ = 0 (the Full-FT decoder prefilling the whole prompt:
            mode ``full-ft``). A point is taken only when every item is there with the same prompt
            (``prompt_sha``) and reference token count; it records ``source: "eval:MODE"``. Not used with
            ``gen_rows``.
    Raises:
        ConfigError: bad ρ / axis / curve, no decoder, or a folder holding a sweep with other settings.
    """
    if not decoders:
        raise ConfigError(
            "the sweep needs a Full-FT decoder (naive curve) and/or a CCFT decoder (prefillshare curve)"
        )
    bad = [c for c in decoders if c not in CURVES]
    if bad:
        raise ConfigError(f"unknown sweep curve(s) {bad}; use {', '.join(CURVES)}")
    by_method = {CURVES[label]: d for label, d in decoders.items()}
    bad = [a for a in axes if a not in AXES]
    if bad:
        raise ConfigError(f"unknown sharing axis {bad}; use {', '.join(AXES)}")
    for r in rhos:
        recompute_tokens(10, r)  # validates the range
    handoff = resolve_handoff((d.handoff_tokens for d in decoders.values()), what="the swept decoders")
    for d in decoders.values():
        check_base_reader(base, d)  # K5: before any compute or write
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prep = prepare(
        task,
        base.tokenizer,
        limit if limit is not None else getattr(task, "default_limit", None),
        handoff,
        prompt_format,
    )
    max_new = int(max_new_tokens or getattr(task, "max_new_tokens", None) or 256)
    settings = {
        "task": task_name(task),
        "limit": limit,
        "gen_rows": gen_rows,
        "max_new_tokens": max_new,
        "item_ids_sha": _ids_sha(prep),
    }
    if prompt_format is not None and prompt_format.applies_to(task):
        settings["prompting"] = prompt_format.describe()
    meta_path, points_path = out / "meta.json", out / "points.jsonl"
    if overwrite:
        points_path.unlink(missing_ok=True)
        meta_path.unlink(missing_ok=True)
    created = time.strftime("%Y-%m-%d %H:%M:%S")
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        created = old.get("created", created)  # a resumed sweep keeps the date it was started
        if old.get("settings") != settings or old.get("base_fingerprint") != base.fingerprint:
            raise ConfigError(
                f"{out} holds a sweep with other settings or another base; pass --overwrite or use "
                "another --out folder"
            )
    desc = {
        label: {
            "path": (decoder_paths or {}).get(label),
            "method": d.method,
            "kind": d.kind,
            "fingerprint": d.meta.get("base_fingerprint"),
        }
        for label, d in decoders.items()
    }
    meta = {
        "kind": "ccft-sweep",
        "task": task_name(task),
        "settings": settings,
        "model": describe_base(base),
        "base_fingerprint": base.fingerprint,
        "data": task_description(task),
        "n_items": prep.n,
        "hardware": hardware(),
        "num_layers": base.config.num_hidden_layers,
        "decoders": desc,
        "rhos": list(rhos),
        "axes": list(axes),
        "created": created,
    }
    atomic_write_text(meta_path, json.dumps(meta, indent=2))
    done = {_key(p["label"], p["over"], p["rho"]): p for p in read_jsonl(points_path)}
    plan: list[tuple[str, str | None, float | None]] = [
        (m, None, None)
        for m in REFERENCES
        if not get_mode(m).needs_decoder or get_mode(m).decoder_method in by_method
    ]
    for label in CURVES:
        if label in decoders:
            plan += [(label, over, float(r)) for over in axes for r in rhos]
    todo = [p for p in plan if _key(*p) not in done]
    per_point = prep.n + min(gen_rows, prep.n)
    bar = tqdm(
        total=len(plan) * per_point,
        initial=(len(plan) - len(todo)) * per_point,
        unit="item",
        desc=f"sweep {task_name(task)}",
        disable=not progress,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    try:
        for label, over, rho in todo:
            dec = decoder_for_mode(label, by_method)
            bar.set_postfix_str(f"{label} {over or 'own prefill'} {'' if rho is None else f'ρ={rho:g}'}")
            point = (
                _point_from_eval(eval_records, prep, base, dec, label=label, over=over, rho=rho)
                if eval_records and not gen_rows
                else None
            )
            if point is not None:
                bar.update(per_point)
            else:
                point = _point(
                    task,
                    base,
                    dec,
                    prep,
                    label=label,
                    over=over,
                    rho=rho,
                    batch_size=batch_size,
                    gen_rows=gen_rows,
                    max_new_tokens=max_new,
                    bar=bar,
                )
            append_jsonl(points_path, [point])
            done[_key(label, over, rho)] = point
    finally:
        bar.close()
    summary = summarize_sweep(meta, list(done.values()), n_resamples=n_resamples)
    atomic_write_text(out / "sweep.json", json.dumps(summary, indent=2))
    return summary


def eval_mode_of_point(label: str, over: str | None, rho: float | None) -> str | None:
    """The eval mode (``ccft.core.modes``) a sweep point equals, or None: a reference is its own mode; ρ = 1
    on either axis reads all of C_base (the shared mode itself, ``ccft.evals.sharing``); the naive curve at
    ρ = 0 is the Full-FT decoder prefilling the whole prompt itself (``full-ft``)."""
    if over is None:
        return label
    if rho == 1.0:
        return label
    if rho == 0.0 and get_mode(label).decoder_method == get_mode(REFERENCE_MODE).decoder_method:
        return REFERENCE_MODE
    return None


def _point_from_eval(
    eval_records, prep, base, decoder, *, label: str, over: str | None, rho: float | None
) -> dict | None:
    mode = eval_mode_of_point(label, over, rho)
    recs = eval_records.get(mode) if mode is not None else None
    if not recs:
        return None
    rows = [i for i in range(prep.n) if prep.references[i] is not None]
    got = {}
    for i in rows:
        r = recs.get(prep.ids[i])
        if (
            r is None
            or r.get("prompt_sha") != prompt_hash(prep.prompts[i])
            or r.get("nll_tokens") != len(prep.references[i])
            or r.get("nll_sum") is None
        ):
            return None  # not the same item, prompt or reference: computed instead
        got[i] = r
    point = {
        "label": label,
        "over": over,
        "rho": rho,
        "ids": [prep.ids[i] for i in sorted(got)],
        "nll": [got[i]["nll_sum"] / max(1, got[i]["nll_tokens"]) for i in sorted(got)],
        "nll_tokens": [got[i]["nll_tokens"] for i in sorted(got)],
        "source": f"eval:{mode}",
    }
    point.update(_axis_fields(prep, base, decoder, over, rho, sorted(got)))
    return point


def _axis_fields(prep, base, decoder, over: str | None, rho: float | None, rows: list[int]) -> dict:
    """What a point records about its axis: the shared layers, or the mean prompt tokens recomputed."""
    if over == "layers":
        return {"shared_layers": shared_layer_list(rho, base.config.num_hidden_layers)}
    if over == "positions":
        k0 = decoder.handoff_tokens
        return {
            "recomputed_mean": sum(recompute_tokens(len(prep.prompts[i]), rho, k0) for i in rows)
            / max(1, len(rows))
        }
    return {}


def _ids_sha(prep) -> str:
    import hashlib

    h = hashlib.sha256()
    for i, p in zip(prep.ids, prep.prompts, strict=True):
        h.update(f"{i}:{len(p)}:{sum(p)};".encode())
    return h.hexdigest()[:16]


def summarize_sweep(meta: dict, points: list[dict], *, n_resamples: int = 2000, seed: int = 0) -> dict:
    """``sweep.json``: per point mean NLL with 95% CI, paired delta vs ``full-ft`` own prefill, accuracy if
    scored."""
    ref = next((p for p in points if p["label"] == "full-ft" and p["over"] is None), None)
    ref_nll = dict(zip(ref["ids"], ref["nll"], strict=True)) if ref else {}
    ref_scores = dict(zip(ref.get("gen_ids", []), ref.get("scores", []), strict=True)) if ref else {}
    rows = []
    for p in points:
        r = {"label": p["label"], "over": p["over"], "rho": p["rho"], "n": len(p["nll"])}
        for k in ("shared_layers", "recomputed_mean"):
            if k in p:
                r[k] = p[k]
        if p["nll"]:
            m = mean_ci(p["nll"], n_resamples=n_resamples, seed=seed)
            r.update(nll=m["mean"], nll_ci=list(m["ci"]))
            pairs = [(x, ref_nll[i]) for i, x in zip(p["ids"], p["nll"], strict=True) if i in ref_nll]
            if pairs and ref is not p:
                d = paired_bootstrap_delta(
                    [a for a, _ in pairs], [b for _, b in pairs], n_resamples=n_resamples, seed=seed
                )
                r["delta_nll_vs_full_ft"] = {"delta": d["delta"], "ci": list(d["ci"]), "n": d["n"]}
        if p.get("scores"):
            keys = sorted({k for s in p["scores"] for k in s})
            r["metrics"] = {}
            for k in keys:
                vals = [s[k] for s in p["scores"] if k in s]
                m = mean_ci(vals, n_resamples=n_resamples, seed=seed)
                r["metrics"][k] = {"mean": m["mean"], "ci": list(m["ci"]), "n": len(vals)}
                pairs = [
                    (s[k], ref_scores[i][k])
                    for i, s in zip(p["gen_ids"], p["scores"], strict=True)
                    if i in ref_scores and k in s and k in ref_scores[i]
                ]
                if pairs and ref is not p:
                    d = paired_bootstrap_delta(
                        [a for a, _ in pairs], [b for _, b in pairs], n_resamples=n_resamples, seed=seed
                    )
                    r["metrics"][k]["delta_vs_full_ft"] = {
                        "delta": d["delta"],
                        "ci": list(d["ci"]),
                        "n": d["n"],
                    }
        rows.append(r)
    order = {m: i for i, m in enumerate(REFERENCES + tuple(CURVES))}
    rows.sort(key=lambda r: (order.get(r["label"], 9), r["over"] or "", -1 if r["rho"] is None else r["rho"]))
    return {"kind": "ccft-sweep", "meta": meta, "points": rows, "per_item": points}


__all__ = ["CURVES", "REFERENCES", "RHOS", "eval_mode_of_point", "run_sweep", "summarize_sweep"]
