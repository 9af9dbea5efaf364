"""``ccft study recipes/study.yaml [KEY=value ...]``: the specialists study (``make study``; docs/study.md).

Phases (wall time of each is added up over sittings in ``OUT/phases.json``):
  setup                  convert the embedded base once, validate every recipe, set up the BFCL checker
  train_SPEC_METHOD      each specialist's decoder from its recipe, method ``ccft`` and ``full-ft``
  eval_SPEC              every task of the specialist in the four modes (``ccft.evals.runner``)
  sweep_SPEC             NLL/token against the sharing ratio ρ on the specialist's first task
  serving                the multi-agent serving benchmark with the trained CCFT decoders as agents
  report                 OUT/report.json, OUT/README.md, plots
Finished work is reused, interrupted work resumes. The phases are ``ccft.evals.study.recipe.StudyRecipe``;
this module parses the command line and supplies the serving phase (``ccft bench serve``, a layer above the
evals).
"""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "study",
        help="train the math, code and tools specialists (CCFT + Full-FT) and compare the "
        "four modes on their benchmarks",
    )
    p.add_argument(
        "config",
        nargs="?",
        default="study",
        help="study YAML, or a packaged one's name (default: the packaged study; frontier, multipl-e; "
        "`ccft recipes list`)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="KEY=value overrides, dotted for sections (specialists.tools.train.max_steps=20, batch_size=8)",
    )
    p.add_argument("--skip-serving", action="store_true", help="leave out the serving benchmark")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="re-render OUT/README.md (and the paired differences in OUT/report.json) from the committed "
        "OUT/report.json and per-item records; trains and evaluates nothing",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from ccft.evals.study import load_study_config
    from ccft.evals.study.recipe import StudyRecipe
    from ccft.train.recipes import recipe_argument

    cfg = load_study_config(recipe_argument(args.config), args.overrides)
    command = (
        "make study"
        if (args.config == "recipes/study.yaml" and not args.overrides)
        else "ccft study " + " ".join([args.config, *args.overrides])
    )
    if getattr(args, "report_only", False):
        from ccft.evals.study.report import rerender_study_report

        rerender_study_report(cfg.out, command, n_resamples=cfg.bootstrap)
        print(f"[ccft study] re-rendered {Path(cfg.out) / 'README.md'} from {Path(cfg.out) / 'report.json'}")
        return 0
    serve = _serving if not args.skip_serving and cfg.serving.get("enabled", True) else None
    out = Path(cfg.out)
    StudyRecipe(cfg, command=command, serve=serve, where=str(args.config)).run()
    print(f"[ccft study] wrote {out / 'report.json'} and {out / 'README.md'}")
    return 0


def _serving(cfg, decoders: dict[str, str], base_name: str, out: Path) -> dict:
    """The multi-agent serving benchmark (``ccft bench serve``) with the trained CCFT decoders as agents.

    Agents named like a specialist (math, code, tools) get that specialist's CCFT decoder; the planner has no
    trained specialist and keeps the benchmark's random LoRA adapter. ``cfg.serving`` keys are the benchmark's
    options (``sessions: [1, 2, 4]``, ``turns: 2``, ...). Outputs are checked against offline
    ``ccft.generate`` (``--check-outputs``). Resumes: a finished ``serving/serve.json`` is reused when
    ``serving/decoders.json`` says it was computed with these decoders (``run_digest``); otherwise (retrained,
    or no stamp) it runs again.
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
            argv += [
                f"--{key.replace('_', '-')}",
                *(str(v) for v in (value if isinstance(value, list) else [value])),
            ]
        p = argparse.ArgumentParser(prog="ccft study (serving)")
        bench_serve.add_arguments(p)
        args = p.parse_args(argv)
        path.parent.mkdir(parents=True, exist_ok=True)
        result = bench_serve.run(args)
        atomic_write_text(path, json.dumps(result, indent=2, default=str))
        write_stamp(path.parent, digests)  # after the result: a kill in between recomputes it
    eq = result.get("outputs_vs_offline") or {}
    md = (
        bench_serve.table(result)
        + "\n\nAgents: "
        + ", ".join(f"{k}: {v}" for k, v in result["decoders"].items())
        + f".\n\nGreedy outputs under the shared scheduler equal offline `ccft.generate` (prefillshare) for "
        f"{eq.get('equal')}/{eq.get('requests')} requests of one session."
    )
    keys = (
        "p95_latency_ratio",
        "throughput_ratio",
        "hit_ratio_min",
        "kv_bytes_vs_eq9",
        "saturation_sessions",
    )
    return {
        "file": "serving/serve.json",
        **{k: result.get(k) for k in keys},
        "decoders": result["decoders"],
        "outputs_vs_offline": eq,
        "markdown": md,
    }
