"""``ccft sweep --task T --decoder FULL_FT_DIR --decoder CCFT_DIR [--rho ...] [--over ...] --out DIR``.

The sharing sweep (PrefillShare Fig. 2): response NLL per token (and, with ``--gen-rows N``, the
task's accuracy on the first N items) of the Full-FT decoder (naive sharing) and of the CCFT decoder
as the sharing ratio ρ grows, over prompt positions and over layers, on the same items; the Full-FT
decoder on its own prefill and the base are measured alongside as references. Finished points are
kept in ``DIR/points.jsonl``; rerunning resumes. ``ccft report DIR -o REPORT`` draws the plot.

Example::

    ccft sweep --task gsm8k --decoder runs/demo/full-ft --decoder runs/demo/ccft --limit 50 \\
        --out reports/sweep
"""

from __future__ import annotations

from ccft.evals.prompting import PROMPT_FORMAT_CHOICES


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="NLL / accuracy vs the sharing ratio ρ (over positions and layers)")
    p.add_argument("--task", default="gsm8k", help="task name from the registry")
    p.add_argument(
        "--decoder",
        action="append",
        default=[],
        required=True,
        help="a full-ft decoder folder (naive curve) and/or a ccft one (prefillshare curve)",
    )
    p.add_argument("--base", default=None, help="base model (default: the one recorded by the decoders)")
    p.add_argument("--rho", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0], help="sharing ratios")
    p.add_argument("--over", nargs="+", default=["positions", "layers"], choices=["positions", "layers"])
    p.add_argument("--limit", type=int, default=None, help="items (default: the task's default)")
    p.add_argument(
        "--gen-rows",
        type=int,
        default=0,
        help="also generate greedily on the first N items at every point and score accuracy",
    )
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument(
        "--prompt-format",
        choices=list(PROMPT_FORMAT_CHOICES),
        default="decoder",
        help="decoder (default): the decoders' training prompt format, as `ccft eval`; task: the task's",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--out", default="reports/sweep")
    p.set_defaults(func=run)


def run(args) -> int:
    from ccft.cli.eval import load_models
    from ccft.evals.prompting import resolve_prompt_format
    from ccft.evals.runner import get_task
    from ccft.evals.sweep import CURVES, run_sweep

    task = get_task(args.task)
    base, decoders = load_models(args.decoder, args.base, device=args.device)
    curves = {label: decoders[method][0] for label, method in CURVES.items() if method in decoders}
    paths = {label: decoders[method][1] for label, method in CURVES.items() if method in decoders}
    prompt_format = resolve_prompt_format(args.prompt_format, curves.values())
    try:
        summary = run_sweep(
            task,
            base,
            curves,
            args.out,
            rhos=args.rho,
            axes=args.over,
            limit=args.limit,
            batch_size=args.batch_size,
            gen_rows=args.gen_rows,
            max_new_tokens=args.max_new_tokens,
            progress=not args.no_progress,
            overwrite=args.overwrite,
            decoder_paths=paths,
            n_resamples=args.bootstrap,
            prompt_format=prompt_format,
        )
    except KeyboardInterrupt:
        import sys

        print(
            f"\n[ccft] interrupted: finished points are saved in {args.out}/points.jsonl; rerun to resume",
            file=sys.stderr,
            flush=True,
        )
        return 130
    for p in summary["points"]:
        d = p.get("delta_nll_vs_full_ft")
        rho = "" if p["rho"] is None else f"rho={p['rho']:.2f}"
        print(
            f"[ccft] {p['label']:12s} {p['over'] or 'own prefill':11s} {rho:9s} "
            f"nll={p.get('nll', float('nan')):.4f}" + (f" delta_vs_full_ft={d['delta']:+.4f}" if d else ""),
            flush=True,
        )
    print(f"[ccft] wrote {args.out}/sweep.json", flush=True)
    return 0
