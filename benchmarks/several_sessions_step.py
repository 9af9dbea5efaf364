"""One decode step over the agents of several sessions (each session its own context handle), the fused CPU
step against the layer loop it replaced (docs/serving.md, "Several sessions in one decode step").

    python benchmarks/several_sessions_step.py [--ctx 1100] [--steps 12]

The embedded SmolLM2-135M-Instruct in fp32, 2 threads, one context of ``--ctx`` tokens per session, each read
by every agent (random LoRA adapters r=8 of ``ccft bench peers``, ``<cache>/peers/adapters``: run
``ccft bench peers`` once first, or pass ``--adapters DIR``). Prints ms per decode step (mean of ``--steps``
after two warm-up steps) for: the fused step (rows up to ``blocks.F32_FUSED_ROWS`` in one kernel call, more
in parts), the layer loop of several handles (``model._row_views`` off: what ran before), and the parts
against the layer loop above the fused step's rows.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import ccft
from ccft.bench.llamacpp import cache_root
from ccft.inference import model as M


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=1100)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--adapters", default=None, help="folder of the agents' CCFT adapters")
    args = p.parse_args()
    torch.set_num_threads(2)
    root = Path(args.adapters or cache_root() / "peers" / "adapters" / "seed0" / "ccft")
    names = sorted(d.name for d in root.iterdir() if d.is_dir())[:4]
    base = ccft.load_base("smollm2-135m-instruct")
    eng = ccft.SharedPrefillEngine(
        base, decoders={n: ccft.load_decoder(str(root / n), base=base) for n in names}, max_batch=64
    )

    def ms_per_step(sessions: int, agents: int) -> float:
        handles = [eng.prefill([[100 + s + i % 50 for i in range(args.ctx)]]) for s in range(sessions)]
        for h in handles:
            for a in range(agents):
                eng.add_request(
                    h, 0, decoder=names[a % len(names)], max_new_tokens=args.steps + 2, ignore_eos=True
                )
        eng.step()
        eng.step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        dt = (time.perf_counter() - t0) / args.steps
        while eng.active:
            eng.step()
        for h in handles:
            h.unref()
        return 1000 * dt

    row_views, parts = M._row_views, M._fused_in_parts
    for sessions, agents in ((1, 4), (2, 4), (4, 4), (4, 8)):
        fused = ms_per_step(sessions, agents)
        M._fused_in_parts = lambda *a: None
        M._row_views = lambda *a: None
        loop = ms_per_step(sessions, agents)
        M._row_views, M._fused_in_parts = row_views, parts
        print(
            f"sessions={sessions} agents={agents} rows={sessions * agents}: fused {fused:.0f} ms/step, "
            f"layer loop {loop:.0f} ms/step ({loop / fused:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
