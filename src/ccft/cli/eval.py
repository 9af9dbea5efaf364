"""``ccft eval --task T [--task T2 ...] --mode M [--mode M2 ...] --decoder DIR ... [--limit N] [--out DIR]``.

Scores every requested mode on the same items of each task (response NLL per token on the task's
reference answers, plus greedy generations scored by the task), with 95% bootstrap CIs and paired
deltas against ``full-ft``. Results go to ``OUT/TASK/`` (``meta.json``, ``items.MODE.jsonl`` written
per item, ``summary.json``) plus ``OUT/TASK.json`` / ``OUT/TASK.md``. Rerunning the same command
resumes: finished items are read back, never recomputed. ``ccft report OUT -o REPORT`` turns one or
more such folders into tables and plots.

Examples::

    ccft eval --task gsm8k --mode full-ft --mode naive --mode prefillshare \\
        --decoder runs/demo/full-ft --decoder runs/demo/ccft --limit 50 --out reports/eval
    ccft eval --task gsm8k --mode base --base smollm2-135m-instruct --limit 20
    ccft eval --suite evals/demo.yaml --decoder runs/demo/full-ft --decoder runs/demo/ccft
    ccft eval --suite evals/study.yaml --specialist math --decoder runs/study/math/ccft \\
        --decoder runs/study/math/full-ft --out reports/study/math
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ccft.core.modes import MODES, get_mode
from ccft.evals.prompting import PROMPT_FORMAT_CHOICES


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate decoders in base / full-ft / naive / prefillshare mode on tasks",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--task",
        action="append",
        default=None,
        help="task name from the registry (repeat for several; default: gsm8k; `--task list` lists them)",
    )
    p.add_argument(
        "--suite",
        default=None,
        help="an evaluation suite YAML (evals/*.yaml): its tasks, items, modes, batch size, bootstrap and "
        'seed; the options given here override it (docs/evaluation.md, "Suites")',
    )
    p.add_argument(
        "--specialist",
        default=None,
        help="with a per-specialist --suite (evals/study.yaml): whose tasks to run on the given decoders",
    )
    p.add_argument(
        "--mode",
        action="append",
        default=None,
        choices=list(MODES),
        help="repeat for several modes (default: the --suite's modes, else every mode the given decoders "
        "allow)",
    )
    p.add_argument(
        "--decoder",
        action="append",
        default=[],
        help="decoder folder (repeat: a ccft one for prefillshare, a full-ft one for full-ft/naive)",
    )
    p.add_argument("--base", default=None, help="base model (default: the one recorded by the decoders)")
    p.add_argument("--limit", type=int, default=None, help="items per task (default: the task's default)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's setting")
    p.add_argument(
        "--batch-size", type=int, default=None, help="items per batch (does not change results; default 8)"
    )
    p.add_argument("--nll-only", action="store_true", help="reference NLL only, no generation")
    p.add_argument(
        "--engine",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every mode through ccft.SharedPrefillEngine: each producer prefills a group of items once "
        "for the generations and reference NLL of every mode reading it (default, or the suite's "
        "`engine:`); --no-engine: the reference ccft.generate path it is tested equal to",
    )
    p.add_argument(
        "--cache-format",
        choices=["native", "int8"],
        default=None,
        help="the format naive/prefillshare read C_base in (issue 35): int8 serves every such decoder on the "
        "compact C_base (keys per channel, values per token in 8 bits; the reference path), native on C_base "
        "as computed (default: each decoder's own, recorded in its ccft.json)",
    )
    p.add_argument(
        "--prompt-format",
        choices=list(PROMPT_FORMAT_CHOICES),
        default="decoder",
        help="decoder (default): render chat-task prompts with the chat template and system prompt the "
        "decoders were trained with (their recorded recipe), as `ccft demo` does; task: each "
        "task's own prompt format",
    )
    p.add_argument(
        "--samples", type=int, default=None, help="samples per item (default: the task's; >1 samples)"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling and bootstrap seed (default 0)")
    p.add_argument(
        "--bootstrap", type=int, default=None, help="bootstrap resamples for the CIs (default 2000)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="discard earlier results in OUT instead of resuming"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--out", default="reports/eval", help="output folder (one sub-folder per task)")
    p.set_defaults(func=run)


def load_models(decoder_dirs, base_name=None, modes=None, device="cpu"):
    """(base, {method: (decoder, path)}) for the given decoder folders; fails before loading anything when a
    folder is not a decoder or a mode in ``modes`` has no decoder of its method."""
    from ccft.core.checkpoint import load_decoder, read_meta
    from ccft.core.errors import ConfigError
    from ccft.core.models import DEFAULT_BASE, EMBEDDED_MODELS, load_base

    metas = {d: read_meta(d) for d in decoder_dirs}  # fails fast on a non-decoder folder
    methods = {m.get("method") for m in metas.values()}
    for mode in modes or []:
        key = get_mode(mode).decoder_method
        if key is not None and key not in methods:
            raise ConfigError(
                f"mode {mode!r} needs a decoder trained with method={key!r}; pass it with --decoder"
            )

    def recorded(m):  # an embedded base by its name (what results record: no machine path), else its folder
        name = m["base"]["name"]
        return name if name in EMBEDDED_MODELS else (m["base"].get("path") or name)

    base_name = base_name or next((recorded(m) for m in metas.values()), DEFAULT_BASE)
    dtypes = {m.get("dtype", "float32") for m in metas.values()}
    base = load_base(base_name, dtype=next(iter(dtypes)) if len(dtypes) == 1 else "float32", device=device)
    decoders = {}
    for d in decoder_dirs:
        dec = load_decoder(d, base=base)
        if dec.method in decoders:
            raise ConfigError(
                f"two decoders trained with method={dec.method!r} ({decoders[dec.method][1]} and {d}); "
                "pass one per method"
            )
        decoders[dec.method] = (dec, str(d))
    return base, decoders


def eval_plan(args):
    """The ``EvalSuite`` this command runs: ``--suite`` (one specialist's part with ``--specialist``) or the
    ``--task`` list (default gsm8k), with ``--limit``, ``--max-new-tokens``, ``--batch-size``,
    ``--bootstrap``, ``--seed`` and ``--engine`` over the suite's values when given. Raises ConfigError for a
    bad suite or both ``--suite`` and ``--task``."""
    import dataclasses

    from ccft.core.errors import ConfigError
    from ccft.evals.suite import EvalSuite, SuiteTask, load_suite
    from ccft.train.config import EvalConfig

    if args.suite is not None:
        if args.task:
            raise ConfigError("--suite declares the tasks; drop --task (or drop --suite)")
        suite = load_suite(args.suite, args.specialist)
    elif args.specialist is not None:
        raise ConfigError("--specialist chooses a part of a per-specialist --suite; give --suite too")
    else:
        suite = EvalSuite(source="", tasks=tuple(SuiteTask(t) for t in args.task or ["gsm8k"]))
    tasks = tuple(
        dataclasses.replace(
            t,
            limit=args.limit if args.limit is not None else t.limit,
            max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else t.max_new_tokens,
        )
        for t in suite.tasks
    )

    def pick(flag, value, default):
        return flag if flag is not None else value if value is not None else default

    return dataclasses.replace(
        suite,
        tasks=tasks,
        batch_size=pick(args.batch_size, suite.batch_size, 8),
        bootstrap=pick(args.bootstrap, suite.bootstrap, 2000),
        seed=pick(args.seed, suite.seed, 0),
        engine=pick(args.engine, suite.engine, EvalConfig.engine),
    )


def run(args) -> int:
    from ccft.core.errors import ConfigError
    from ccft.core.io import check_output_folder
    from ccft.evals.prompting import resolve_prompt_format
    from ccft.evals.report import task_markdown
    from ccft.evals.runner import EvalMemo, EvalSettings, get_task, run_task, task_names
    from ccft.evals.settings import default_modes, mode_specs, shared_handoff

    if args.task == ["list"]:
        print("\n".join(task_names()))
        return 0
    plan = eval_plan(args)  # the suite (if any) with the command line over it; fails before any model loads
    check_output_folder(args.out, "--out")
    task_objs = [get_task(t.task) for t in plan.tasks]  # unknown names fail before loading any model
    for task, t in zip(task_objs, plan.tasks):  # so does missing or damaged task data (one line, exit 2)
        task.load(t.limit if t.limit is not None else getattr(task, "default_limit", None))
    from_suite = args.mode is None and bool(args.suite)
    args.mode = list(plan.modes) if from_suite else args.mode
    try:
        base, loaded = load_models(args.decoder, args.base, args.mode, device=args.device)
    except ConfigError as e:
        if not (args.suite and from_suite):
            raise
        raise ConfigError(
            f"{e} (the modes {list(plan.modes)} come from the suite {args.suite}; choose others with --mode)"
        ) from None
    decoders = {method: dec for method, (dec, _) in loaded.items()}
    paths = {method: path for method, (_, path) in loaded.items()}
    modes = list(dict.fromkeys(args.mode or default_modes(decoders)))
    specs = mode_specs(modes, decoders, paths)
    handoff = shared_handoff(decoders.values())
    prompt_format = resolve_prompt_format(args.prompt_format, decoders.values())
    out = Path(args.out)
    memo = EvalMemo()  # tasks with the same prompts (humaneval, humaneval-plus) share generations and NLLs
    for task, t in zip(task_objs, plan.tasks):
        settings = EvalSettings(
            limit=t.limit if t.limit is not None else getattr(task, "default_limit", None),
            generate_limit=t.generate_limit,
            max_new_tokens=t.max_new_tokens,
            generate=not args.nll_only,
            seed=plan.seed,
            handoff_tokens=handoff,
            samples=args.samples,
            engine=plan.engine,
            prompt_format=prompt_format,
            cache_format=args.cache_format,
        )
        print(f"[ccft] {settings.as_dict(task)['task']}: prompts: {settings.prompting(task)}", flush=True)
        try:
            res = run_task(
                task,
                base,
                specs,
                out,
                settings=settings,
                batch_size=plan.batch_size,
                progress=not args.no_progress,
                overwrite=args.overwrite,
                n_resamples=plan.bootstrap,
                memo=memo,
            )
        except KeyboardInterrupt:
            print(
                f"\n[ccft] interrupted: finished items are saved in {out}/; rerun the same command to resume",
                file=sys.stderr,
                flush=True,
            )
            return 130
        s = res.summary
        for mode, m in s["modes"].items():
            metrics = " ".join(f"{k}={v['mean']:.3f}" for k, v in m.get("metrics", {}).items())
            nll = f"nll={m['nll']:.4f}" if "nll" in m else ""
            print(
                f"[ccft] {s['task']:12s} {mode:12s} {nll} {metrics} n={m['n']} "
                f"(computed now: {res.computed.get(mode, 0)})",
                flush=True,
            )
        name = s["task"]
        from ccft.core.io import atomic_write_text

        atomic_write_text(out / f"{name}.json", json.dumps(s, indent=2, default=str))
        atomic_write_text(out / f"{name}.md", task_markdown(s))
        print(f"[ccft] wrote {out / name}/ and {out / (name + '.md')}", flush=True)
    return 0
