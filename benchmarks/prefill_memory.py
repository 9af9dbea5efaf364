"""Resident memory of one evaluation group's prefills, with and without sizing the prefix arena first
(docs/study.md, "Peak memory is the evaluation's").

The study's `eval_tools` group: the first 100 bfcl-multiple prompts, prefilled by the base (C_base) and by a
Full-FT LoRA decoder (its own prefill), as ``GroupPrefill`` does for the four modes (a CCFT adapter attached
too, as in the study; freshly initialised adapters); resident memory sampled every 0.05 s.

    .venv/bin/python benchmarks/prefill_memory.py             # arena grown region by region (doubling)
    .venv/bin/python benchmarks/prefill_memory.py --reserve   # GroupPrefill.reserve first (what the
                                                              # runner does)
"""

from __future__ import annotations

import argparse
import threading
import time

import psutil

import ccft
from ccft.evals.generation import GroupPrefill, make_engine
from ccft.evals.runner import get_task
from ccft.evals.scoring import prepare
from ccft.evals.settings import ModeSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reserve", action="store_true", help="size the arena for both prefills first")
    args = ap.parse_args()
    proc = psutil.Process()
    peak = [0.0]

    def rss() -> float:
        return proc.memory_info().rss / 2**30

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss())
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    base = ccft.load_base("smollm2-135m-instruct", dtype="float32")
    ff = ccft.make_decoder(base, "lora", method="full-ft", adapter_name="ff")
    cc = ccft.make_decoder(base, "lora", method="ccft", adapter_name="cc")
    specs = [
        ModeSpec("base"),
        ModeSpec("full-ft", ff, "ff"),
        ModeSpec("naive", ff, "ff"),
        ModeSpec("prefillshare", cc, "cc"),
    ]  # the study's four modes: two producers
    prep = prepare(get_task("bfcl-multiple"), base.tokenizer, 100)
    engine = make_engine(base, specs, max_batch=64)
    print(
        f"{len(prep.prompts)} prompts, {sum(map(len, prep.prompts))} tokens, longest "
        f"{max(map(len, prep.prompts))}; rss {rss():.2f} GiB",
        flush=True,
    )
    group = GroupPrefill(engine, dict(enumerate(prep.prompts)), 1)
    if args.reserve:
        group.reserve(specs)
        print(f"reserved: arena {engine.arena.capacity} token slots, rss {rss():.2f} GiB", flush=True)
    for spec in specs[:2]:  # the base's prefill (C_base, also read by naive and prefillshare), then Full-FT's
        peak[0] = rss()
        t0 = time.perf_counter()
        group.handle(spec)
        print(
            f"prefill {spec.mode}: {time.perf_counter() - t0:.0f} s, arena {engine.arena.capacity} token "
            f"slots, rss after {rss():.2f} GiB, peak during {peak[0]:.2f} GiB",
            flush=True,
        )
    group.close()


if __name__ == "__main__":
    main()
