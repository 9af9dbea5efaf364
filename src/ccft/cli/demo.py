"""``ccft demo [RECIPE]``: the main job, end to end on real data (RECIPE: a file, or a packaged recipe's name;
default the packaged ``demo``, which ``ccft recipes cp demo .`` copies with its suite).

Phases (wall time of each is recorded):
  setup         convert the embedded base once, validate the recipe and data
  train_ccft    CCFT decoder (C_base from the frozen base)
  train_full_ft Full-FT decoder: same rows, steps, seed and adapter
  eval          base, full-ft, naive, prefillshare on held-out items of the recipe's ``eval.task`` (GSM8K
                test): response NLL/token on the first ``eval.nll_rows``, exact match from batched greedy
                generation on the first ``eval.em_rows`` of them. This is ``ccft eval`` with the recipe's
                settings (``ccft.evals.evaluate.evaluate_decoders``: the eval runner, the registry's task,
                the prompts rendered as the decoders were trained)
  report        OUT/TASK/ (the runner's result folder: meta.json, items.MODE.jsonl, summary.json),
                OUT/results.json (training facts + the eval summary) and OUT/README.md
A finished training run (its folder has ccft.json with the same recipe) is reused, and an
interrupted one resumes from its last checkpoint; the evaluation resumes item by item unless a
decoder was (re)trained in this run. Rerunning the demo never redoes finished work.
"""

from __future__ import annotations

import dataclasses
import json
import time


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train CCFT + Full-FT on GSM8K and compare the four modes")
    p.add_argument(
        "recipe",
        nargs="?",
        default="demo",
        help="recipe YAML, or a packaged recipe's name (default: demo; `ccft recipes list`)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides (eval.KEY=value for the eval section)")
    p.add_argument("--out", default="reports/demo", help="report folder")
    p.add_argument("--runs", default="runs/demo", help="folder for the two decoders")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the recipe, its evaluation suite, both methods' data, the base tokenizer and the "
        "output folders, then stop (nothing is written)",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="re-render OUT/README.md (and the paired differences in OUT/results.json) from the committed "
        "OUT/results.json and per-item records; trains and evaluates nothing",
    )
    p.set_defaults(func=run)


def _phase(times: dict, name: str):
    class _T:
        def __enter__(self):
            print(f"[ccft demo] == {name} ==", flush=True)
            self.t = time.time()

        def __exit__(self, *exc):
            times[name] = round(time.time() - self.t, 1)
            print(f"[ccft demo] {name}: {times[name]:.0f}s", flush=True)

    return _T()


def run(args) -> int:
    from ccft.core.checkpoint import load_decoder
    from ccft.core.errors import ConfigError
    from ccft.core.io import atomic_write_text, check_output_folder
    from ccft.core.models import describe_model, load_base, resolve_model_path
    from ccft.evals.evaluate import evaluate_decoders
    from ccft.evals.protocol import task_names
    from ccft.evals.report import modes_table, paired_difference, reading
    from ccft.evals.results import FolderConflictError, hardware
    from ccft.train.config import METHODS, load_recipe
    from ccft.train.recipes import recipe_argument
    from ccft.train.run import check_run, method_config, train_or_reuse

    if getattr(args, "report_only", False):
        return render_report(args.out, args.recipe)
    times: dict[str, float] = {}
    total = time.time()
    cfg, ecfg, raw = load_recipe(recipe_argument(args.recipe), args.overrides)
    if ecfg.task not in task_names():  # before any training: the evaluation comes last
        raise ConfigError(
            f"{args.recipe}: eval.task: unknown task {ecfg.task!r}; known tasks: {', '.join(task_names())}"
        )
    # nothing is written before the folders and both methods' data rows are checked (a failed start leaves
    # --runs and --out as they were)
    runs = check_output_folder(args.runs, "--runs")
    out = check_output_folder(args.out, "--out")
    rows = {}
    for method in METHODS:
        rows[method] = len(check_run(method_config(cfg, raw, method, runs / method)[0], store=False)[0])
    if args.dry_run:
        print(
            f"[ccft demo] recipe OK: base={cfg.base} decoder={cfg.decoder_kind} train rows="
            f"{'/'.join(str(rows[m]) for m in METHODS)} ({', '.join(METHODS)}) max_steps={cfg.max_steps}; "
            f"eval task={ecfg.task} nll_rows={ecfg.nll_rows} em_rows={ecfg.em_rows} "
            f"modes={','.join(ecfg.modes)}; "
            f"would write {runs / METHODS[0]}, {runs / METHODS[1]} and {out}"
        )
        return 0
    with _phase(times, "setup"):
        resolve_model_path(cfg.base)  # converts the embedded model once
    histories, train_rows, reused = {}, {}, {}
    for method in METHODS:
        m_cfg, m_raw = method_config(cfg, raw, method, runs / method)
        with _phase(times, f"train_{method.replace('-', '_')}"):
            histories[method], train_rows[method], reused[method] = train_or_reuse(
                m_cfg, m_raw, prefix="[ccft demo]"
            )
    base = load_base(cfg.base, dtype=cfg.dtype)
    decoders = {m: load_decoder(runs / m, base=base) for m in METHODS}
    paths = {m: str(runs / m) for m in METHODS}
    with _phase(times, "eval"):
        try:  # new decoders: earlier items are stale
            res = evaluate_decoders(
                base, decoders, ecfg, out, decoder_paths=paths, overwrite=not all(reused.values())
            )
        except (
            FolderConflictError
        ) as e:  # the folder is the demo's own output: an earlier demo with other settings
            print(f"[ccft demo] starting the evaluation over: {e}", flush=True)
            res = evaluate_decoders(base, decoders, ecfg, out, decoder_paths=paths, overwrite=True)
    summary = res.summary
    for mode, m in summary["modes"].items():
        metrics = " ".join(f"{k} {v['mean']:.3f} (n={v['n']})" for k, v in m.get("metrics", {}).items())
        print(
            f"[ccft demo] {mode:12s} NLL/token {m.get('nll', float('nan')):.4f} (n={m['n']}) {metrics} "
            f"truncated {m.get('truncated', 0)}",
            flush=True,
        )
    with _phase(times, "report"):
        result = {
            "kind": "ccft-demo",
            "model": describe_model(cfg.base),
            "data": {
                "train": f"{cfg.train_data}, rows "
                f"{cfg.data_offset}..{cfg.data_offset + train_rows['ccft'] - 1} (response = "
                "reference solution + EOS)",
                "eval": summary["meta"]["data"],
            },
            "hardware": hardware(),
            "train_rows": train_rows["ccft"],
            "steps": cfg.max_steps,
            "settings": {k: v for k, v in raw.items() if k != "eval"} | {"eval": dataclasses.asdict(ecfg)},
            "loss_curve": {
                m: [[h["step"], h["loss"]] for h in histories[m] if "loss" in h] for m in histories
            },
            "eval_curve": {
                m: [[h["step"], h["eval_loss"]] for h in histories[m] if "eval_loss" in h] for m in histories
            },
            "phase_seconds": times,
            "eval_folder": summary["task"],
            "eval": summary,
            "prefillshare_vs_naive": paired_difference(
                res.records, "prefillshare", "naive", n_resamples=ecfg.bootstrap, seed=ecfg.seed
            ),
        }
        times["total"] = round(time.time() - total, 1)
        atomic_write_text(out / "results.json", json.dumps(result, indent=2, default=str))
        atomic_write_text(out / "README.md", demo_readme(result, args.recipe))
    print(modes_table(summary))
    print()
    print(reading(summary, result["prefillshare_vs_naive"]))
    print(
        f"\n[ccft demo] wrote {out / summary['task']}/, {out / 'results.json'} and {out / 'README.md'} in "
        f"{times['total']:.0f}s"
    )
    return 0


def _decode_path_line(path: str | None, block_weights: str | None = None) -> str:
    """The report's line for the evaluation's decode path (``EvalSettings.as_dict``'s ``decode_path`` and,
    when set, ``block_weights``)."""
    if path is not None and path.startswith("SharedPrefillEngine"):
        weights = (
            f"; the base's linear layers from the GGUF's Q4_1 / Q8_0 blocks (block_weights={block_weights}, "
            'docs/inference.md, "Block weights")'
            if block_weights not in (None, "off")
            else ""
        )
        return (
            "every mode on `ccft.SharedPrefillEngine`: each group of items prefilled once per producer "
            "(C_base for base, naive and prefillshare; the Full-FT decoder's own prefix for full-ft), read "
            f'by the reference NLL and the greedy generation (docs/evaluation.md, "Decode path"){weights}'
        )
    return f"{path or 'reference (ccft.generate)'}: per mode, one prompt pass for the NLL, one for generation"


def render_report(out_dir, recipe: str) -> int:
    """``ccft demo --report-only``: ``OUT/README.md`` re-rendered from ``OUT/results.json`` and the per-item
    records of ``OUT/TASK/`` (the paired PrefillShare − naive difference is computed from them, with the
    run's bootstrap settings, and kept in ``results.json``). Nothing is trained or evaluated."""
    from pathlib import Path

    from ccft.core.errors import ConfigError
    from ccft.core.io import atomic_write_text
    from ccft.evals.report import paired_difference
    from ccft.evals.results import folder_records

    out = Path(out_dir)
    path = out / "results.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --report-only re-renders a finished demo's report")
    result = json.loads(path.read_text())
    ev = (result.get("settings") or {}).get("eval") or {}
    records = folder_records(out / result["eval_folder"])
    result["prefillshare_vs_naive"] = paired_difference(
        records, "prefillshare", "naive", n_resamples=ev.get("bootstrap", 2000), seed=ev.get("seed", 0)
    )
    atomic_write_text(path, json.dumps(result, indent=2, default=str))
    atomic_write_text(out / "README.md", demo_readme(result, recipe))
    print(f"[ccft demo] re-rendered {out / 'README.md'} from {path}")
    return 0


def demo_results(result: dict) -> str:
    """The README's short "Results": each paired difference (PrefillShare − Full-FT, naive − Full-FT,
    PrefillShare − naive) on NLL/token and the task's primary and secondary metric, and whether its 95% CI
    excludes 0 — the words follow from the CIs in the tables below, never written by hand."""
    from ccft.evals.report import is_rate, primary_metric, results_lines, results_verdict

    summary = result["eval"]
    deltas = summary.get("deltas_vs_full_ft") or {}
    pairs = {(m, "full-ft"): deltas.get(m) for m in ("prefillshare", "naive")}
    pairs[("prefillshare", "naive")] = result.get("prefillshare_vs_naive") or {}
    prim = primary_metric(summary)
    keys = [prim] if prim else []
    try:
        from ccft.evals.study.config import metrics_of

        sec = metrics_of(summary["task"])[1]
    except Exception:  # a task the registry does not know: the primary metric only
        sec = None
    if sec and sec != prim and any(sec in (m.get("metrics") or {}) for m in summary["modes"].values()):
        keys.append(sec)
    metrics = [("nll", "NLL/token", False, False)] + [
        (k, k, is_rate(k, summary["modes"]), True) for k in keys
    ]
    lines = results_lines(pairs, metrics)
    if not pairs[("prefillshare", "naive")]:
        lines.append("PrefillShare − naive: not computed (no per-item records of both modes)")
    return (
        "\n".join(f"- {x}." for x in lines)
        + "\n\n"
        + results_verdict(pairs, metrics)
        + " Differences are paired (mode − reference on the same items, 95% percentile bootstrap)."
    )


def demo_readme(result: dict, recipe: str) -> str:
    """``README.md`` of the demo: setup, the eval runner's per-mode table and deltas, curves, the reading."""
    from ccft.evals.report import modes_table, pair_table, reading, short_hardware

    summary = result["eval"]
    meta = summary["meta"]
    es = meta["settings"]
    t = result["phase_seconds"]
    curve = result["loss_curve"]
    curves = "\n".join(
        f"- {m}: loss {c[0][1]:.3f} (step {c[0][0]}) → {c[-1][1]:.3f} (step {c[-1][0]})"
        for m, c in curve.items()
        if c
    )
    s = result["settings"]
    n_gen = es.get("generate_limit") if es.get("generate_limit") is not None else meta["n_items"]
    decoders = (
        f"LoRA adapters (r={s.get('lora_r', 16)})"
        if s.get("decoder_kind", "lora") == "lora"
        else "full-weight copies"
    )
    n_scored = min(n_gen, meta["n_items"])
    title = (
        f"ccft demo: PrefillShare vs Full-FT vs naive sharing — {str(result['model']).split(',')[0]}, "
        f"{decoders.split(' (')[0].replace('adapters', 'decoders')}, {summary['task']} (NLL on "
        f"{meta['n_items']} items, {n_scored} generated), {short_hardware(result['hardware'])}"
    )
    return f"""# {title}

Produced by `make demo` (`ccft demo {recipe}`). Every number below was measured in that run; the
per-item records are in `{result["eval_folder"]}/` (`ccft report` reads them).

## Results

{demo_results(result)}

## Setup

- **Model**: {result["model"]} (base, frozen); decoders are {decoders} on it.
- **Training data**: {result["data"]["train"]}; {result["train_rows"]} rows, {result["steps"]} optimizer \
steps,
  batch {s.get("per_device_train_batch_size")} × accumulation {s.get("gradient_accumulation_steps", 1)},
  learning rate {s.get("learning_rate")}, seed {s.get("seed", 42)}; both decoders get the same rows, \
steps and seed.
- **Evaluation data**: {meta["data"]}. NLL on the first {meta["n_items"]} items; generations scored on \
the first
  {min(n_gen, meta["n_items"])} of them (greedy, max {es["max_new_tokens"]} new tokens).
- **Decode path**: {_decode_path_line(es.get("decode_path"), es.get("block_weights"))}.
- **Prompts** (training and evaluation): {es.get("prompting")}.
- **Hardware**: {result["hardware"]}.
- **Wall time per phase (s)**: {", ".join(f"{k} {v:.0f}" for k, v in t.items())}.

## Per-mode tables

{modes_table(summary)}

{pair_table(summary, result.get("prefillshare_vs_naive"))}

NLL is the mean over items of each item's mean negative log-likelihood per response token
(response + EOS), teacher-forced. Intervals are 95% percentile bootstrap over items
({s["eval"]["bootstrap"]} resamples); deltas are paired (same items resampled for both modes).

## Training curves

{curves}

## Reading

{reading(summary, result.get("prefillshare_vs_naive"))}

This is a CPU-scale run of a 135M model with a LoRA decoder and a few dozen steps: it measures the
mechanism (a decoder reading another model's cache, trained to do so or not) on what "Results" above lists
as resolved, not the accuracy an 8B model reaches. The recipe `{recipe}` lists the settings for a full GPU
run.
"""
