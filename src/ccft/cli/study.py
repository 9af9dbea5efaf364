"""``ccft study recipes/study.yaml [KEY=value ...]``: the specialists study (``make study``; docs/study.md).

Phases (wall time of each is added up over sittings in ``OUT/phases.json``):
  setup                  convert the embedded base once, validate every recipe, set up the BFCL checker
  train_SPEC_METHOD      each specialist's decoder from its recipe, method ``ccft`` and ``full-ft``
  eval_SPEC              every task of the specialist in the four modes (``ccft.evals.runner``)
  sweep_SPEC             NLL/token against the sharing ratio ρ on the specialist's first task
  serving                the multi-agent serving benchmark with the trained CCFT decoders as agents
  report                 OUT/report.json, OUT/README.md, plots
Finished work is reused, interrupted work resumes (see ``ccft.evals.study``).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="train the math, code and tools specialists (CCFT + Full-FT) and compare the "
                                     "four modes on their benchmarks")
    p.add_argument("config", nargs="?", default="recipes/study.yaml")
    p.add_argument("overrides", nargs="*", help="KEY=value overrides, dotted for sections "
                                               "(specialists.tools.train.max_steps=20, batch_size=8)")
    p.add_argument("--skip-serving", action="store_true", help="leave out the serving benchmark")
    p.set_defaults(func=run)


def _multipl_e_tasks(spec) -> list[str]:
    from ccft.evals.execution import check_language
    from ccft.evals.protocol import task_names

    names = [n for n in task_names() if n.startswith("multipl-e-")]
    if spec.multipl_e == "all":
        langs = [n.removeprefix("multipl-e-") for n in names]
        return [f"multipl-e-{lang}" for lang in langs if check_language(lang).available]
    return [f"multipl-e-{lang}" for lang in spec.multipl_e]


def run(args) -> int:
    from ccft.core.checkpoint import load_decoder
    from ccft.core.errors import ConfigError
    from ccft.core.models import load_base, resolve_model_path
    from ccft.evals.prompting import resolve_prompt_format
    from ccft.evals.protocol import get_task
    from ccft.evals.results import clear_task_folder, stale_settings
    from ccft.evals.runner import EvalMemo, decode_ahead, run_task
    from ccft.evals.settings import EvalSettings, mode_specs, shared_handoff
    from ccft.evals.study import (
        StudyPhases,
        load_study_config,
        recipe_overrides,
        run_digest,
        stamp_matches,
        write_stamp,
    )
    from ccft.evals.sweep import run_sweep
    from ccft.train.config import METHODS
    from ccft.train.run import method_config, train_or_reuse

    cfg = load_study_config(args.config, args.overrides)
    out, runs = Path(cfg.out), Path(cfg.runs)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        import torch

        torch.set_num_threads(int(cfg.threads))
    phases = StudyPhases(out)
    parsed = {name: recipe_overrides(spec) for name, spec in cfg.specialists.items()}
    bases = {tc.base for tc, _, _ in parsed.values()}
    if len(bases) != 1:
        raise ConfigError(f"{args.config}: the specialists' recipes name different bases {sorted(bases)}; the study "
                          "compares decoders on one frozen base (set specialists.NAME.train.base to one model)")
    base_name = bases.pop()
    dtype = next(iter(parsed.values()))[0].dtype
    with phases("setup"):
        resolve_model_path(base_name)
        wants_bfcl = any("bfcl-multiple" in s.tasks for s in cfg.specialists.values())
        if wants_bfcl:
            from ccft.evals.bfcl import checker_python, setup_checker_env

            if checker_python() is None:
                print("[ccft study] setting up the BFCL checker environment (pip, once)", flush=True)
                setup_checker_env()
    base = None
    summaries: dict[str, list[dict]] = {}
    sweeps: dict[str, dict] = {}
    specialists_meta: dict[str, dict] = {}
    ccft_decoders = {}
    trained: dict[str, dict] = {}
    for name, spec in cfg.specialists.items():  # one specialist at a time: its numbers are complete early
        tc, _, raw = parsed[name]
        trained[name] = {"histories": {}, "rows": {}, "reused": {}}
        for method in METHODS:
            m_cfg, m_raw = method_config(tc, raw, method, runs / name / method)
            with phases(f"train_{name}_{method.replace('-', '_')}"):
                h, rows, reused = train_or_reuse(m_cfg, m_raw, prefix="[ccft study]")
            trained[name]["histories"][method] = h
            trained[name]["rows"][method] = rows
            trained[name]["reused"][method] = reused
            gc.collect()
        if base is None:
            base = load_base(base_name, dtype=dtype, device=_device(cfg.device))
        paths = {m: str(runs / name / m) for m in METHODS}
        decoders = {m: load_decoder(paths[m], base=base) for m in METHODS}
        ccft_decoders[name] = paths["ccft"]
        # earlier results are stale when the decoders they were computed with (the stamp next to them) are not these:
        # a sitting killed between training and evaluation leaves new decoders beside old items. A retrained run
        # that came out bit for bit the same (training is deterministic on one machine) keeps its results. A
        # folder without a stamp (written before stamps) is taken as it is unless a decoder was retrained now.
        digests = {m: run_digest(paths[m]) for m in METHODS}
        stamped = stamp_matches(out / name, digests)
        fresh = stamped is False or (stamped is None and not all(trained[name]["reused"].values()))
        fmt = resolve_prompt_format("decoder", decoders.values())
        handoff = shared_handoff(decoders.values())
        task_list = [(t, ts.limit, ts.max_new_tokens) for t, ts in spec.tasks.items()]
        task_list += [(t, spec.multipl_e_limit, spec.multipl_e_max_new_tokens) for t in _multipl_e_tasks(spec)]
        summaries[name] = []
        records = {}  # per task: mode -> item id -> record (the sweep reuses the points that are eval modes)
        if fresh:  # every result of this specialist goes before the stamp says they are these decoders'
            for t, _, _ in task_list:
                if (out / name / t).is_dir():
                    clear_task_folder(out / name / t)
            for f in ("points.jsonl", "meta.json"):
                (out / name / "sweep" / f).unlink(missing_ok=True)
        write_stamp(out / name, digests)
        memo = EvalMemo()  # humaneval-plus takes humaneval's texts and NLLs (same prompts and references)
        specs = mode_specs(cfg.modes, decoders, paths)
        settings_of = {t: EvalSettings(limit=limit, max_new_tokens=max_new, seed=cfg.seed, handoff_tokens=handoff,
                                       prompt_format=fmt, engine=True) for t, limit, max_new in task_list}
        # a task folder of this study written with other settings (the study config or the task's protocol
        # changed) is the study's own stale output: computed again
        for t, _, _ in task_list:
            diff = {} if fresh else stale_settings(out / name / t, settings_of[t].as_dict(get_task(t)))
            if diff:
                print(f"[ccft study] {name}: {t} was evaluated with other settings {diff} (was, now): computing it "
                      f"again", flush=True)
                clear_task_folder(out / name / t)
        # tasks too small to fill the engine's rows alone (MultiPL-E: 10 items per language) decode together
        small = [t for t, limit, _ in task_list if limit is not None and limit < cfg.batch_size]
        with phases(f"eval_{name}"):
            for task_name, limit, _ in task_list:
                if task_name == (small[0] if small else None):
                    n = decode_ahead([(get_task(t), settings_of[t]) for t in small], base, specs, out / name,
                                     memo=memo, batch_size=cfg.batch_size, overwrite=fresh)
                    if n:
                        print(f"[ccft study] {name}: {n} generations of {len(small)} small tasks decoded together "
                              f"({', '.join(small)})", flush=True)
                print(f"[ccft study] {name}: {task_name} (n={limit})", flush=True)
                res = run_task(get_task(task_name), base, specs, out / name, settings=settings_of[task_name],
                               batch_size=cfg.batch_size, n_resamples=cfg.bootstrap, overwrite=fresh, memo=memo)
                summaries[name].append(res.summary)
                records[task_name] = {m: {r["id"]: r for r in rs} for m, rs in res.records.items()}
        first = next(iter(spec.tasks), None)
        if first and cfg.sweep_limit:
            with phases(f"sweep_{name}"):
                sweeps[name] = run_sweep(get_task(first), base, {"naive": decoders["full-ft"],
                                                                 "prefillshare": decoders["ccft"]},
                                         out / name / "sweep", rhos=cfg.sweep_rhos, axes=("positions",),
                                         limit=cfg.sweep_limit, batch_size=cfg.batch_size, overwrite=fresh,
                                         decoder_paths={"naive": paths["full-ft"], "prefillshare": paths["ccft"]},
                                         n_resamples=cfg.bootstrap, prompt_format=fmt,
                                         eval_records=records.get(first))
        hist = trained[name]["histories"]
        specialists_meta[name] = {
            "recipe": spec.recipe, "overrides": spec.train, "runs": paths,
            "tasks": [t for t, _, _ in task_list],
            "training": {"train_data": tc.train_data, "train_rows": trained[name]["rows"]["ccft"],
                         "steps": tc.max_steps, "learning_rate": tc.learning_rate,
                         "batch": tc.per_device_train_batch_size * tc.gradient_accumulation_steps,
                         "max_length": tc.max_length, "seed": tc.seed,
                         "loss_curve": {m: [[x["step"], x["loss"]] for x in hist[m] if "loss" in x] for m in hist},
                         "final_loss": {m: next((x["loss"] for x in reversed(hist[m]) if "loss" in x), None)
                                        for m in hist}},
        }
        write_report(cfg, args, out, summaries, specialists_meta, sweeps, None, phases, base_name)  # partial
    serving = None
    if not args.skip_serving and cfg.serving.get("enabled", True):
        with phases("serving"):
            serving = _serving(cfg, ccft_decoders, base_name, out)
    with phases("report"):
        write_report(cfg, args, out, summaries, specialists_meta, sweeps, serving, phases, base_name)
    print(f"[ccft study] wrote {out / 'report.json'} and {out / 'README.md'}")
    return 0


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def write_report(cfg, args, out: Path, summaries, specialists_meta, sweeps, serving, phases, base_name) -> None:
    """``OUT/report.json``, ``OUT/README.md`` and the plots from what is finished (called after each specialist)."""
    from ccft.core.io import atomic_write_text
    from ccft.core.models import describe_model
    from ccft.evals.report import plot_sweep, plot_task
    from ccft.evals.results import hardware
    from ccft.evals.study import build_study_report, study_readme

    plots = {}
    for name, ss in summaries.items():
        for s in ss:
            png = out / name / f"{s['task']}.png"
            try:
                plot_task(s, png)
                plots[f"{name}/{s['task']}"] = f"{name}/{png.name}"
            except Exception as e:  # plotting must not lose the numbers
                print(f"[ccft study] plot {png}: {e}", file=sys.stderr)
        if sweeps.get(name):
            try:
                plot_sweep(sweeps[name], out / name / "sweep.png")
                plots[f"{name}/sweep"] = f"{name}/sweep.png"
            except Exception as e:
                print(f"[ccft study] sweep plot: {e}", file=sys.stderr)
    report = build_study_report(cfg, summaries, specialists_meta=specialists_meta, sweeps=sweeps,
                                serving=serving, phases=phases.data, hardware=hardware(),
                                model=describe_model(base_name))
    report["plots"] = plots
    report["complete"] = set(summaries) == set(cfg.specialists)
    command = ("make study" if (args.config == "recipes/study.yaml" and not args.overrides)
               else "ccft study " + " ".join([args.config, *args.overrides]))
    atomic_write_text(out / "report.json", json.dumps(report, indent=2, default=str))
    notes = out / "SITTINGS.md"  # hand-written notes on each sitting, kept across regenerations
    atomic_write_text(out / "README.md", study_readme(report, command,
                                                      notes.read_text(encoding="utf-8") if notes.is_file() else None))


def _serving(cfg, decoders: dict[str, str], base_name: str, out: Path) -> dict:
    """The multi-agent serving benchmark (``ccft bench serve``) with the trained CCFT decoders as agents.

    Agents named like a specialist (math, code, tools) get that specialist's CCFT decoder; the planner has no
    trained specialist and keeps the benchmark's random LoRA adapter. ``cfg.serving`` keys are the benchmark's
    options (``sessions: [1, 2, 4]``, ``turns: 2``, ...). Outputs are checked against offline ``ccft.generate``
    (``--check-outputs``). Resumes: a finished ``serving/serve.json`` is reused when ``serving/decoders.json``
    says it was computed with these decoders (``run_digest``); otherwise (retrained, or no stamp) it runs again.
    """
    import argparse

    from ccft.bench import serve as bench_serve
    from ccft.core.io import atomic_write_text
    from ccft.evals.study import run_digest, stamp_matches, write_stamp

    path = out / "serving" / "serve.json"
    digests = {name: run_digest(folder) for name, folder in decoders.items() if name in bench_serve.AGENTS}
    if path.is_file() and stamp_matches(path.parent, digests):  # computed with these very decoders
        print(f"[ccft study] reusing {path}", flush=True)
        result = json.loads(path.read_text())
    else:
        argv = ["--model", base_name, "--out", str(path), "--check-outputs"]
        for name, folder in decoders.items():
            if name in bench_serve.AGENTS:
                argv += ["--decoder", f"{name}={folder}"]
        for key, value in cfg.serving.items():
            if key == "enabled":
                continue
            argv += [f"--{key.replace('_', '-')}", *(str(v) for v in (value if isinstance(value, list) else [value]))]
        p = argparse.ArgumentParser(prog="ccft study (serving)")
        bench_serve.add_arguments(p)
        args = p.parse_args(argv)
        path.parent.mkdir(parents=True, exist_ok=True)
        result = bench_serve.run(args)
        atomic_write_text(path, json.dumps(result, indent=2, default=str))
        write_stamp(path.parent, digests)  # after the result: a kill in between recomputes it
    eq = result.get("outputs_vs_offline") or {}
    md = (bench_serve.table(result) + "\n\nAgents: " +
          ", ".join(f"{k}: {v}" for k, v in result["decoders"].items()) +
          f".\n\nGreedy outputs under the shared scheduler equal offline `ccft.generate` (prefillshare) for "
          f"{eq.get('equal')}/{eq.get('requests')} requests of one session.")
    keys = ("p95_latency_ratio", "throughput_ratio", "hit_ratio_min", "kv_bytes_vs_eq9", "saturation_sessions")
    return {"file": "serving/serve.json", **{k: result.get(k) for k in keys}, "decoders": result["decoders"],
            "outputs_vs_offline": eq, "markdown": md}
