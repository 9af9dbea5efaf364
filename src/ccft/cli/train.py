"""``ccft train RECIPE.yaml [key=value ...]``: train a CCFT or Full-FT decoder from a recipe.

Multi-process runs launch through accelerate: ``ccft train RECIPE.yaml --num-processes 2
[--accelerate-config recipes/accelerate/zero2.yaml]`` re-runs this command under ``accelerate launch``
(``accelerate launch -m ccft.cli.main train RECIPE.yaml`` works as well).
"""

from __future__ import annotations

import dataclasses
import re


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a decoder from a YAML recipe",
        description="Train a CCFT or Full-FT decoder. Any TrainConfig field can be overridden "
        "as key=value (YAML scalars), e.g. max_steps=10 method=full-ft.",
    )
    p.add_argument("recipe", nargs="?", help="recipe YAML, or a packaged recipe's name (`ccft recipes list`)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in output_dir")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the recipe, data files, base tokenizer, output_dir and store, then stop "
        "(nothing is written)",
    )
    p.add_argument("--help-config", action="store_true", help="list the ccft fields of TrainConfig")
    p.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="launch N processes through accelerate (data parallel; CPU processes use gloo)",
    )
    p.add_argument(
        "--accelerate-config",
        default=None,
        help="accelerate config to launch with: recipes/accelerate/{ddp,zero2,zero3}.yaml",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from ccft.train.config import TrainConfig, load_recipe

    if args.help_config:
        from transformers import TrainingArguments

        base_fields = {f.name for f in dataclasses.fields(TrainingArguments)}
        for f in dataclasses.fields(TrainConfig):
            if f.name not in base_fields or f.name == "output_dir":
                print(f"{f.name:22s} {f.metadata.get('help', '')}")
        print("... plus every transformers.TrainingArguments field (learning_rate, max_steps, ...)")
        from ccft.train.config import EvalConfig

        print("\nthe recipe's eval: section (ccft demo / ccft eval; override as eval.KEY=value):")
        doc = dict(re.findall(r"^\s+(\w+): (.+)$", EvalConfig.__doc__ or "", flags=re.M))  # its Attributes
        for f in dataclasses.fields(EvalConfig):
            print(f"eval.{f.name:17s} {doc.get(f.name, '')}")
        return 0
    from ccft.train.recipes import recipe_argument

    # training reads no eval: section (a missing or bad suite is ccft demo's / ccft eval's to report)
    recipe = recipe_argument(args.recipe) if args.recipe else None
    cfg, _, raw = load_recipe(recipe, args.overrides, with_eval=False)
    if (args.accelerate_config or (args.num_processes or 1) > 1) and not args.dry_run:
        from ccft.train.distributed import inside_launcher, relaunch

        if not inside_launcher():
            argv = ["train"] + ([recipe] if recipe else []) + list(args.overrides or [])
            argv += ["--no-resume"] if args.no_resume else []
            return relaunch(argv, num_processes=args.num_processes, config_file=args.accelerate_config)
    if args.dry_run:
        from ccft.train.run import check_run

        ds, ev = check_run(cfg)
        evals = f", eval rows={len(ev)}" if ev is not None else ""
        print(
            f"[ccft] recipe OK: method={cfg.method} decoder={cfg.decoder_kind} base={cfg.base} "
            f"train rows={len(ds)} (dropped {ds.dropped_too_long} > max_length={cfg.max_length}){evals}"
        )
        return 0
    from ccft.train.run import run_training

    result = run_training(cfg, recipe=raw, resume=not args.no_resume)
    if not result.trainer.is_world_process_zero():
        return 0
    curve = result.loss_curve
    loss = (
        f"loss {curve[0][1]:.4f} -> {curve[-1][1]:.4f}"
        if curve
        else f"no step loss logged: fewer steps than logging_steps={cfg.logging_steps}"
    )
    print(
        f"[ccft] trained {cfg.method} decoder -> {result.output_dir} ({result.train_rows} rows, "
        f"{loss}, {result.seconds:.0f}s)"
    )
    return 0
