"""``ccft eval --task gsm8k --mode MODE [--decoder DIR ...] [--limit N]``: the first evaluation.

Scores one or more modes on the same GSM8K test rows: response NLL per token and strict /
flexible exact match from batched greedy generation, with 95% bootstrap CIs; writes
``OUT/gsm8k.json`` and ``OUT/gsm8k.md``.
"""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate decoders in base / full-ft / naive / prefillshare mode")
    p.add_argument("--task", default="gsm8k", choices=["gsm8k"])
    p.add_argument("--mode", action="append", required=True,
                   choices=["base", "full-ft", "naive", "prefillshare"], help="repeat for several modes")
    p.add_argument("--decoder", action="append", default=[],
                   help="decoder folder (repeat: a ccft one for prefillshare, a full-ft one for full-ft/naive)")
    p.add_argument("--base", default=None, help="base model (default: the one recorded by the decoder)")
    p.add_argument("--limit", type=int, default=50, help="test rows for NLL and exact match")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", default="reports/eval", help="output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..checkpoint import load_decoder, read_meta
    from ..config import BUILTIN_DATASETS
    from ..data import build_dataset, load_rows
    from ..errors import ConfigError
    from ..evaluate import (decoder_for_mode, gsm8k_exact_match, hardware, paired_deltas, row_nll,
                            summarize_mode)
    from ..models import DEFAULT_BASE, describe_model, load_base

    metas = {d: read_meta(d) for d in args.decoder}  # fails fast on a non-decoder folder
    base_name = args.base or next((m["base"].get("path") or m["base"]["name"] for m in metas.values()), DEFAULT_BASE)
    base = load_base(base_name)
    decoders = {}
    for d in args.decoder:
        dec = load_decoder(d, base=base)
        if dec.method in decoders:
            raise ConfigError(f"two decoders trained with method={dec.method!r}; pass one per method")
        decoders[dec.method] = dec
    for mode in args.mode:
        decoder_for_mode(mode, decoders)  # every mode has its decoder before any compute
    spec = BUILTIN_DATASETS[args.task]
    rows = load_rows(str(spec["test"]), columns=spec["columns"], limit=args.limit)
    handoff = next(iter(decoders.values())).handoff_tokens if decoders else 1
    ds = build_dataset(rows, base.tokenizer, max_length=100_000, handoff_tokens=handoff)
    per_mode, report = {}, {}
    for mode in args.mode:
        dec = decoder_for_mode(mode, decoders)
        nll = row_nll(mode, base, dec, ds, batch_size=args.batch_size, progress=True)
        em = gsm8k_exact_match(mode, base, dec, [e.prompt_ids for e in ds.examples], [r["response"] for r in rows],
                               max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, progress=True)
        per_mode[mode] = {"nll_rows": nll, "em_strict_rows": em.strict, "em_flexible_rows": em.flexible}
        report[mode] = summarize_mode(nll, em)
        print(f"[ccft] {mode:12s} nll={report[mode]['nll']:.4f} strict={report[mode]['exact_match_strict']:.3f} "
              f"flexible={report[mode]['exact_match_flexible']:.3f} n={len(nll)} truncated={em.truncated}")
    result = {"task": args.task, "model": describe_model(base.name), "hardware": hardware(),
              "decoders": {m: str(d) for m, d in zip([x.method for x in decoders.values()], args.decoder)},
              "modes": report, "deltas_vs_full_ft": paired_deltas(per_mode), "per_row": per_mode}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.task}.json").write_text(json.dumps(result, indent=2))
    from ..report import modes_table

    (out / f"{args.task}.md").write_text(f"# {args.task}\n\n{modes_table(result)}\n")
    print(f"[ccft] wrote {out / (args.task + '.json')}")
    return 0
