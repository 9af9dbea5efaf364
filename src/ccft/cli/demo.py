"""``ccft demo recipes/demo.yaml``: the main job, end to end on real data.

Phases (wall time of each is recorded):
  setup         convert the embedded base once, validate the recipe and data
  train_ccft    CCFT decoder (C_base from the frozen base)
  train_full_ft Full-FT decoder: same rows, steps, seed and adapter
  eval_nll      response NLL/token of base, full-ft, naive, prefillshare on held-out GSM8K test rows
  eval_em       strict / flexible exact match from batched greedy generation on the first em_rows of those
  report        reports/demo/results.json and reports/demo/README.md
A finished training run (its folder has ccft.json with the same recipe) is reused, and an
interrupted one resumes from its last checkpoint, so rerunning the demo never redoes finished work.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train CCFT + Full-FT on GSM8K and compare the four modes")
    p.add_argument("recipe", nargs="?", default="recipes/demo.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides (eval.KEY=value for the eval section)")
    p.add_argument("--out", default="reports/demo", help="report folder")
    p.add_argument("--runs", default="runs/demo", help="folder for the two decoders")
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


def _train_or_reuse(cfg, raw: dict):
    from ccft.core.checkpoint import read_meta
    from ccft.train.run import run_training

    out = Path(cfg.output_dir)
    if (out / "ccft.json").is_file():
        meta = read_meta(out)
        if meta.get("recipe") == raw and meta.get("steps") == cfg.max_steps:
            print(f"[ccft demo] reusing finished run {out}", flush=True)
            history = json.loads((out / "log_history.json").read_text())
            return history, meta["data"]["train_rows"]
    result = run_training(cfg, recipe=raw)
    return result.log_history, result.train_rows


def run(args) -> int:
    import torch

    from ccft.core.checkpoint import load_decoder
    from ccft.core.models import describe_model, load_base, resolve_model_path
    from ccft.evals.evaluate import gsm8k_exact_match, hardware, paired_deltas, row_nll, summarize_mode
    from ccft.evals.report import modes_table, reading
    from ccft.train.config import TrainConfig, load_recipe, resolve_data
    from ccft.train.data import build_dataset, load_rows

    times: dict[str, float] = {}
    total = time.time()
    cfg, ecfg, raw = load_recipe(args.recipe, args.overrides)
    runs = Path(args.runs)
    with _phase(times, "setup"):
        resolve_model_path(cfg.base)  # converts the embedded model once
    histories, train_rows = {}, {}
    for method in ("ccft", "full-ft"):
        m_raw = dict(raw, method=method, output_dir=str(runs / method))
        m_raw.pop("eval", None)
        m_cfg = TrainConfig(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)
                                  if f.init and f.name in raw}, "method": method,
                               "output_dir": str(runs / method)})
        with _phase(times, f"train_{method.replace('-', '_')}"):
            histories[method], train_rows[method] = _train_or_reuse(m_cfg, m_raw)
    base = load_base(cfg.base, dtype=cfg.dtype)
    decoders = {m: load_decoder(runs / m, base=base) for m in ("ccft", "full-ft")}
    path, columns = resolve_data("gsm8k:test")
    rows = load_rows(path, columns=columns, limit=ecfg.nll_rows)
    ds = build_dataset(rows, base.tokenizer, max_length=100_000, handoff_tokens=cfg.handoff_tokens,
                       chat_template=cfg.chat_template_flag, system_prompt=cfg.system_prompt)
    which = {"base": None, "full-ft": decoders["full-ft"], "naive": decoders["full-ft"],
             "prefillshare": decoders["ccft"]}
    per_mode, nlls, ems = {}, {}, {}
    with _phase(times, "eval_nll"), torch.no_grad():
        for mode in ecfg.modes:
            nlls[mode] = row_nll(mode, base, which[mode], ds, batch_size=ecfg.batch_size, progress=True)
            print(f"[ccft demo] {mode:12s} NLL/token {sum(nlls[mode]) / len(nlls[mode]):.4f} "
                  f"(n={len(nlls[mode])})", flush=True)
    prompts = [e.prompt_ids for e in ds.examples[: ecfg.em_rows]]
    answers = [r["response"] for r in rows[: ecfg.em_rows]]
    with _phase(times, "eval_em"), torch.no_grad():
        for mode in ecfg.modes:
            ems[mode] = gsm8k_exact_match(mode, base, which[mode], prompts, answers,
                                          max_new_tokens=ecfg.max_new_tokens, batch_size=ecfg.batch_size,
                                          progress=True)
            print(f"[ccft demo] {mode:12s} EM strict {sum(ems[mode].strict)}/{len(prompts)} flexible "
                  f"{sum(ems[mode].flexible)}/{len(prompts)} truncated {ems[mode].truncated}", flush=True)
    with _phase(times, "report"):
        modes = {}
        for mode in ecfg.modes:
            modes[mode] = summarize_mode(nlls[mode], ems[mode], n_resamples=ecfg.bootstrap, seed=ecfg.seed)
            per_mode[mode] = {"nll_rows": nlls[mode], "em_strict_rows": ems[mode].strict,
                              "em_flexible_rows": ems[mode].flexible}
        result = {
            "model": describe_model(cfg.base),
            "data": {"train": f"GSM8K train, rows {cfg.data_offset}..{cfg.data_offset + train_rows['ccft'] - 1} "
                              f"(chat template, response = reference solution + EOS)",
                     "eval_nll": f"GSM8K test, first {len(ds)} rows", "eval_em": f"GSM8K test, first {len(prompts)} rows",
                     "licence": "GSM8K: MIT (openai/grade-school-math)"},
            "hardware": hardware(),
            "train_rows": train_rows["ccft"],
            "steps": cfg.max_steps,
            "settings": {k: v for k, v in raw.items() if k != "eval"} | {"eval": dataclasses.asdict(ecfg)},
            "loss_curve": {m: [[h["step"], h["loss"]] for h in histories[m] if "loss" in h] for m in histories},
            "eval_curve": {m: [[h["step"], h["eval_loss"]] for h in histories[m] if "eval_loss" in h]
                           for m in histories},
            "phase_seconds": times,
            "modes": modes,
            "deltas_vs_full_ft": paired_deltas(per_mode, n_resamples=ecfg.bootstrap, seed=ecfg.seed),
            "per_row": per_mode,
            "samples": {m: ems[m].samples[:3] for m in ems},
        }
        times["total"] = round(time.time() - total, 1)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from ccft.core.checkpoint import atomic_write_text

        atomic_write_text(out / "results.json", json.dumps(result, indent=2))
        atomic_write_text(out / "README.md", demo_readme(result, args.recipe))
    print(modes_table(result))
    print()
    print(reading(result))
    print(f"\n[ccft demo] wrote {out / 'results.json'} and {out / 'README.md'} in {times['total']:.0f}s")
    return 0


def demo_readme(result: dict, recipe: str) -> str:
    from ccft.evals.report import modes_table, reading

    t = result["phase_seconds"]
    curve = result["loss_curve"]
    curves = "\n".join(f"- {m}: loss {c[0][1]:.3f} (step {c[0][0]}) → {c[-1][1]:.3f} (step {c[-1][0]})"
                       for m, c in curve.items() if c)
    s = result["settings"]
    return f"""# ccft demo: PrefillShare vs Full-FT vs naive sharing on GSM8K

Produced by `make demo` (`ccft demo {recipe}`). Every number below was measured in that run.

- **Model**: {result['model']} (base, frozen); decoders are LoRA adapters (r={s.get('lora_r', 16)}) on it.
- **Training data**: {result['data']['train']}; {result['train_rows']} rows, {result['steps']} optimizer steps,
  batch {s.get('per_device_train_batch_size')} × accumulation {s.get('gradient_accumulation_steps', 1)},
  learning rate {s.get('learning_rate')}, seed {s.get('seed', 42)}; both decoders get the same rows, steps and seed.
- **Evaluation data**: NLL on {result['data']['eval_nll']}; exact match on {result['data']['eval_em']}
  (greedy, max {s['eval']['max_new_tokens']} new tokens).
- **Hardware**: {result['hardware']}.
- **Wall time per phase (s)**: {', '.join(f'{k} {v:.0f}' for k, v in t.items())}.

## Results

{modes_table(result)}

NLL is the mean over rows of each row's mean negative log-likelihood per response token
(response + EOS), teacher-forced. Intervals are 95% percentile bootstrap over rows
({s['eval']['bootstrap']} resamples); deltas are paired (same rows resampled for both modes).

## Training curves

{curves}

## Reading

{reading(result)}

This is a CPU-scale run of a 135M model with a LoRA decoder and a few dozen steps: it shows the
mechanism (a decoder reading another model's cache loses accuracy unless trained to do so), not
the accuracy an 8B model reaches. The recipe `{recipe}` lists the settings for a full GPU run.
"""
