"""``ccft`` entry point: ``ccft {train,eval,demo,report,sweep,precompute,bench,serve} ...``."""

from __future__ import annotations

import argparse
import sys

from ccft.core.errors import CCFTError


def build_parser() -> argparse.ArgumentParser:
    from ccft.cli import bench, demo, precompute, report, serve, sweep, train
    from ccft.cli import eval as eval_cmd

    parser = argparse.ArgumentParser(prog="ccft", description="Cache-conditioned fine-tuning (PrefillShare).")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in (train, eval_cmd, demo, report, sweep, precompute, bench, serve):
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # key=value overrides may come after flags (``ccft train R.yaml --dry-run max_steps=3``).
    stray = [u for u in unknown if u.startswith("-") or "=" not in u]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if unknown:
        if not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = list(args.overrides or []) + unknown
    try:
        return int(args.func(args) or 0)
    except CCFTError as e:
        print(f"ccft {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
