"""The serving benchmark's replay on a tiny model: both systems finish every request of one trace with
the same decode work, the budget holds, and the KV / prefill counts follow Eq. 9."""

from __future__ import annotations

import pytest

import ccft
from ccft.bench import serve as serve_bench
from ccft.inference import SharedPrefillEngine
from ccft.serving import workloads
from conftest import make_lora, make_tiny_folder

AGENTS = list(serve_bench.AGENTS)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    base = ccft.load_base(str(make_tiny_folder(tmp_path_factory.mktemp("serve"), tokenizer, seed=2)))
    decs = {name: make_lora(base, name, i, 4) for i, name in enumerate(AGENTS)}
    return SharedPrefillEngine(base, decoders=decs, max_batch=32)


def _trace(tokenizer, sessions):
    return workloads.generate("react", sessions=sessions, turns=2, agents=AGENTS, shared_tokens=128, unique_tokens=8,
                              growth_tokens=16, max_new_tokens=3, rate=None, seed=0, tokenizer=tokenizer)


def test_replay_both_modes_same_work(engine, tokenizer):
    trace = _trace(tokenizer, 2)
    shared = serve_bench.run_point(engine, trace, share=True, budget=None, block_tokens=16)
    no_share = serve_bench.run_point(engine, trace, share=False, budget=None, block_tokens=16)
    n = len(trace)  # 2 sessions x 2 turns x 4 agents
    assert n == 16 and shared["requests"] == no_share["requests"] == n
    assert shared["generated_tokens"] == no_share["generated_tokens"] == 3 * n
    assert shared["prefills"] == 4 and no_share["prefills"] == 16  # one per session-turn vs one per agent call
    # peak live KV: both sessions in their last turn (context 128 + 16) at once; Eq. 9 with the generation included
    bpt = engine.kv_bytes_per_token
    assert shared["peak_live_kv_bytes"] == 2 * (144 - 1 + 4 * (8 + 1 + 3)) * bpt
    assert no_share["peak_live_kv_bytes"] == 2 * 4 * (144 - 1 + 8 + 1 + 3) * bpt
    assert shared["prefix_hit_ratio"] > no_share["prefix_hit_ratio"] > 0  # the second turn reuses blocks


def test_replay_under_budget_queues(engine, tokenizer):
    trace = _trace(tokenizer, 2)
    bpt = engine.kv_bytes_per_token
    budget = 2 * (128 + 16 - 1 + 4 * 12) * bpt + 128 * bpt  # roughly what sharing needs, far below no-share's
    r = serve_bench.run_point(engine, trace, share=False, budget=budget, block_tokens=16)
    assert r["requests"] == 16 and r["admission_waits"] > 0
    assert r["peak_total_kv_bytes"] <= budget
