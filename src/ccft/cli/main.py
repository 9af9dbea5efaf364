"""``ccft`` entry point: ``ccft {train,eval,demo,study,report,sweep,precompute,bench,serve,export,recipes}``.

Errors ccft raises on purpose (``CCFTError``) and files it cannot read or write end the command with one
line on stderr, ``ccft CMD: error: ...`` naming the file (and line), and exit status 2; set ``CCFT_DEBUG=1``
for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from ccft.core.errors import CCFTError


def build_parser() -> argparse.ArgumentParser:
    from ccft.cli import bench, demo, export, precompute, recipes, report, serve, study, sweep, train
    from ccft.cli import eval as eval_cmd

    parser = argparse.ArgumentParser(prog="ccft", description="Cache-conditioned fine-tuning (PrefillShare).")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in (train, eval_cmd, demo, study, report, sweep, precompute, bench, serve, export, recipes):
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
    except (CCFTError, OSError, UnicodeError) as e:
        # A bad recipe, data file, path or folder: one line naming the file (and line), exit status 2.
        # OSError/UnicodeError are files the command could not read or write. CCFT_DEBUG=1 shows the
        # traceback.
        if os.environ.get("CCFT_DEBUG"):
            raise
        print(f"ccft {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (line breaks of nested messages become "; ")."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


if __name__ == "__main__":
    sys.exit(main())
