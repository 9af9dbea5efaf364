"""``ccft export DECODER --to peft-alora|gguf-alora|merged OUT``: a decoder for engines that know nothing of
ccft.

``peft-alora``: a CCFT LoRA decoder as a stock PEFT activated-LoRA adapter whose invocation tokens are
the decoder's handoff tokens (``PeftModel.from_pretrained(AutoModelForCausalLM..., OUT)`` gives ccft's
prefillshare logits). ``merged``: a plain transformers folder (a full-weight decoder, or a LoRA one
merged), with ``ccft.json`` so ``ccft.load_decoder`` still loads it. Both get a ``README.md`` model card.
``gguf-alora``: the CCFT LoRA decoder and its base as GGUF files for ``llama-server``, whose aLoRA requests
reuse the base's cached prompt up to the handoff (``ccft.bench.llamacpp_alora``; builds llama.cpp once).
What is refused and why: ``ccft.train.export``; how to serve the result: docs/deploy.md.

Example::

    ccft export runs/math --to peft-alora exports/math-alora
    ccft export runs/math --to gguf-alora exports/math-gguf
    ccft export runs/math --to merged exports/math-merged --eval-summary reports/eval/gsm8k/summary.json
"""

from __future__ import annotations

from ccft.train.export import EXPORT_TARGETS  # stdlib-only module level: light at parse time

TARGETS = (*EXPORT_TARGETS, "gguf-alora")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="decoder -> PEFT aLoRA adapter, llama.cpp aLoRA GGUF, or merged transformers "
        "folder (+ model card)",
    )
    p.add_argument("decoder", help="decoder folder (ccft train output: HF or PEFT files + ccft.json)")
    p.add_argument(
        "--to",
        required=True,
        choices=TARGETS,
        help="peft-alora / gguf-alora (LoRA CCFT decoders; gguf-alora needs handoff_tokens >= 2) or merged",
    )
    p.add_argument("out", help="new (or empty) output folder")
    p.add_argument(
        "--invocation-text",
        default=None,
        help="peft-alora for plain-text prompts only: the fixed text every served prompt ends with "
        "(exactly handoff_tokens tokens)",
    )
    p.add_argument(
        "--eval-summary",
        action="append",
        default=[],
        metavar="FILE",
        help="summary.json of a `ccft eval` task folder: its numbers go into the model card (repeatable)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    import sys
    import warnings
    from pathlib import Path

    from ccft.core.errors import ConfigError

    evals = []
    for f in args.eval_summary:
        try:
            evals.append(json.loads(Path(f).read_text(encoding="utf-8")))
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{f}:{e.lineno}:{e.colno}: --eval-summary is not valid JSON ({e.msg}); pass the "
                "summary.json of a ccft eval task folder"
            ) from None
    if args.to == "gguf-alora":
        if args.invocation_text is not None:
            raise ConfigError(
                "--invocation-text is for --to peft-alora; --to gguf-alora exports chat-prompt decoders"
            )
        from ccft.bench.llamacpp_alora import export_gguf_alora

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            g = export_gguf_alora(args.decoder, args.out, log=lambda m: print(m, file=sys.stderr, flush=True))
        if evals:  # the numbers go into the PEFT export's card (the GGUF folder's README points to it)
            from ccft.core.checkpoint import read_meta
            from ccft.train.card import write_model_card
            from ccft.train.export import EXPORT_META_FILE

            write_model_card(
                g.peft_dir,
                read_meta(args.decoder),
                export=json.loads((g.peft_dir / EXPORT_META_FILE).read_text()),
                evals=evals,
            )
        for w in g.warnings:
            print(f"ccft export: warning: {w}", file=sys.stderr)
        print(
            f"[ccft] exported {args.decoder} as gguf-alora -> {g.out} (adapter {g.adapter_gguf.name}, base "
            f"{g.base_gguf.name}; GGUF invocation tokens {g.invocation_ids}: llama-server turns the adapter "
            f"on one token before them, at the handoff {g.handoff_ids})"
        )
        return 0
    from ccft.train.export import export_decoder

    with warnings.catch_warnings():  # the warnings are printed once, below, as ccft's own lines
        warnings.simplefilter("ignore", UserWarning)
        result = export_decoder(args.decoder, args.to, args.out, invocation_text=args.invocation_text)
    if evals:
        from ccft.core.checkpoint import read_meta
        from ccft.train.card import write_model_card
        from ccft.train.export import EXPORT_META_FILE

        export = (
            json.loads((result.out / EXPORT_META_FILE).read_text())
            if args.to == "peft-alora"
            else {"target": "merged", "exported_from": args.decoder}
        )
        write_model_card(result.out, read_meta(args.decoder), export=export, evals=evals)
    for w in result.warnings:
        print(f"ccft export: warning: {w}", file=sys.stderr)
    inv = (
        f" (invocation tokens {result.invocation.ids} = {result.invocation.text!r})"
        if result.invocation
        else ""
    )
    print(f"[ccft] exported {args.decoder} as {args.to} -> {result.out}{inv}")
    return 0
