"""``ccft precompute RECIPE.yaml [key=value ...] [--out DIR] [--cache-format int8]``: write C_base for a
recipe's data to a store.

Prints the size estimate (layers × 2 × kv_heads × head_dim × prefix tokens × dtype bytes; with
``--cache-format int8`` the int8 codes and bfloat16 scales, ``ccft.core.compact.kv_nbytes``) before the base
is loaded, refuses when the store would not fit the free disk space, reuses valid shards and recomputes
stale or corrupt ones (a store in another format is stale). Train on it with ``ccft train RECIPE.yaml
base_cache_store=DIR`` (an int8 store needs ``cache_format: int8``; ``ccft.train.cache_store``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "precompute",
        help="precompute C_base for a recipe's data into a store (sharded safetensors)",
        description="Compute the base model's prefix KV (C_base) for every training (and eval) row "
        "of a recipe once, into memory-mappable safetensors shards keyed by base "
        "fingerprint + token ids.",
    )
    p.add_argument("recipe", nargs="?", help="recipe YAML, or a packaged recipe's name (`ccft recipes list`)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument(
        "--out",
        default=None,
        help="store folder (default: the recipe's base_cache_store, else OUTPUT_DIR/c_base)",
    )
    p.add_argument("--estimate-only", action="store_true", help="print the size estimate and stop")
    p.add_argument(
        "--verify",
        choices=["sha256", "size"],
        default="sha256",
        help="how existing shards are checked (default: full sha256)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="rows per prefill batch")
    p.add_argument(
        "--cache-format",
        default=None,
        help="how C_base is stored: native (as computed) or int8 (codes + bfloat16 scales, about 1/4 of "
        "fp32); default: the recipe's cache_format",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from transformers import AutoConfig

    from ccft.core.compact import check_cache_format
    from ccft.core.io import check_output_folder
    from ccft.core.models import load_base, parse_dtype, resolve_model_path
    from ccft.train.cache_store import (
        bytes_per_token,
        check_free_space,
        human,
        precompute,
        prefixes_of,
        store_bytes,
    )
    from ccft.train.config import load_recipe
    from ccft.train.recipes import recipe_argument
    from ccft.train.run import check_run

    # C_base is computed for the training data only: the recipe's eval: section is not read
    cfg, _, _ = load_recipe(
        recipe_argument(args.recipe) if args.recipe else None, args.overrides, with_eval=False
    )
    fmt = check_cache_format(args.cache_format or cfg.cache_format, where="--cache-format")
    out = check_output_folder(args.out or cfg.base_cache_store or Path(cfg.output_dir) / "c_base", "--out")
    train, ev = check_run(cfg, store=False)
    examples = list(train.examples) + (list(ev.examples) if ev is not None else [])
    path = resolve_model_path(cfg.base)
    config = AutoConfig.from_pretrained(path)
    dtype = parse_dtype(cfg.dtype)
    prefixes = prefixes_of(examples, cfg.handoff_tokens)
    tokens = sum(len(p) for p in prefixes)
    need = store_bytes(config, dtype, map(len, prefixes), fmt)
    existing = out
    while not existing.exists():  # --estimate-only creates nothing; the store's folder is made by precompute
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    print(
        f"[ccft] estimate: {len(prefixes)} prefixes, {tokens} prefix tokens × "
        f"{bytes_per_token(config, dtype)} B"
        + ("" if fmt == "native" else f", stored as {fmt} codes and scales,")
        + f" = {human(need)} for C_base ({cfg.dtype}); "
        f"{human(free)} free at {out}",
        flush=True,
    )
    if args.estimate_only:
        return 0
    check_free_space(out, need)
    base = load_base(cfg.base, dtype=cfg.dtype)
    report = precompute(
        base,
        examples,
        out,
        handoff_tokens=cfg.handoff_tokens,
        batch_size=args.batch_size,
        verify=args.verify,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        cache_format=fmt,
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    print(
        f"[ccft] C_base store at {out}; train with `ccft train {args.recipe or 'RECIPE'} "
        f"base_cache_store={out}" + ("" if fmt == "native" else f" cache_format={fmt}") + "`"
    )
    return 0
