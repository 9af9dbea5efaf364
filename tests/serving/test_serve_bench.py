"""The serving benchmark's replay on a tiny model: both systems finish every request of one trace with
the same decode work, the budget holds, and the KV / prefill counts follow Eq. 9."""

from __future__ import annotations

import pytest
import torch

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
    return workloads.generate(
        "react",
        sessions=sessions,
        turns=2,
        agents=AGENTS,
        shared_tokens=128,
        unique_tokens=8,
        growth_tokens=16,
        max_new_tokens=3,
        rate=None,
        seed=0,
        tokenizer=tokenizer,
    )


def test_replay_both_modes_same_work(engine, tokenizer):
    trace = _trace(tokenizer, 2)
    shared = serve_bench.run_point(engine, trace, share=True, budget=None, block_tokens=16)
    no_share = serve_bench.run_point(engine, trace, share=False, budget=None, block_tokens=16)
    n = len(trace)  # 2 sessions x 2 turns x 4 agents
    assert n == 16 and shared["requests"] == no_share["requests"] == n
    assert shared["generated_tokens"] == no_share["generated_tokens"] == 3 * n
    assert (
        shared["prefills"] == 4 and no_share["prefills"] == 16
    )  # one per session-turn vs one per agent call
    # every request computes its own 8 unique tokens + 1 handoff token on top of its context, in both systems
    assert shared["tail_tokens"] == no_share["tail_tokens"] == n * (8 + 1)
    # peak live KV: both sessions in their last turn (context 128 + 16) at once; Eq. 9 with the generation
    # included
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


def test_work_ratio_known_answer(tokenizer):
    """Token work of the trace: no-share computes every whole prompt, shared each turn's context once."""
    w = serve_bench.work(_trace(tokenizer, 2))  # 2 sessions x 2 turns x 4 agents; contexts 128 then 144
    gen = 16 * 3
    assert w["no_share_tokens"] == 2 * (4 * (128 + 8) + 4 * (144 + 8)) + gen == 2352
    assert w["shared_tokens"] == 2 * (128 + 144) + 16 * 8 + gen == 720
    assert w["work_ratio"] == 2352 / 720
    # with reuse: per session the initial context and the 16-token record, once or once per agent
    assert w["no_share_tokens_with_reuse"] == gen + 16 * 8 + 2 * 4 * (128 + 16) == 1328
    assert w["shared_tokens_with_reuse"] == gen + 16 * 8 + 2 * (128 + 16) == 464


def test_bench_run_eight_agents_both_policies_chunked(tmp_path, tokenizer):
    """``ccft bench serve`` on a tiny model: 8 agents, chunked prefill, FCFS and MLFQ on a trace with varied
    output lengths; the new keys are there and every request equals offline ccft.generate under both."""
    import argparse

    folder = make_tiny_folder(tmp_path / "tiny", tokenizer, seed=3)
    p = argparse.ArgumentParser()
    serve_bench.add_arguments(p)
    args = p.parse_args(
        [
            "--model",
            str(folder),
            "--agents",
            "8",
            "--sessions",
            "1",
            "2",
            "--turns",
            "2",
            "--shared-tokens",
            "96",
            "--unique-tokens",
            "8",
            "--growth-tokens",
            "16",
            "--max-new-tokens",
            "4",
            "--new-tokens-spread",
            "0.5",
            "--prefill-chunk-tokens",
            "48",
            "--policy",
            "both",
            "--max-running",
            "12",
            "--check-outputs",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "serve.json"),
        ]
    )
    result = serve_bench.run(args)
    assert f"({torch.backends.cpu.get_cpu_capability()})" in result["hardware"]  # e.g. "(AVX2)"
    assert result["weights"] == "fp32"  # the base lane's weight path (a tiny HF folder: no GGUF blocks)
    assert "base weights fp32)" in serve_bench.table(result)
    assert result["agents"] == 8 and result["workload"]["agents"][4:] == [
        "critic",
        "search",
        "writer",
        "verifier",
    ]
    sat = next(p for p in result["points"] if p["sessions"] == result["saturation_sessions"])
    assert result["work_ratio_at_saturation"] == sat["work_ratio"] > 1
    assert result["throughput_ratio"] == sat["throughput_ratio"]
    assert result["throughput_vs_work_at_saturation"] == sat["throughput_ratio"] / sat["work_ratio"]
    for point in result["points"]:
        for into in (point, point["policies"]["mlfq"]):
            for mode in ("shared", "no_share"):
                assert into[mode]["ttft_p95_s"] > 0 and into[mode]["tpot_p95_s"] > 0
                assert into[mode]["prefill_chunks"] > 0 and into[mode]["prefill_chunk_tokens"] == 48
        assert point["shared"]["policy"] == "fcfs" and point["policies"]["mlfq"]["shared"]["policy"] == "mlfq"
    eq = result["outputs_vs_offline"]
    assert eq["equal"] == eq["requests"] == 16
    assert eq["by_policy"]["mlfq"]["equal"] == eq["by_policy"]["mlfq"]["requests"] == 16
    assert "work ratio" in serve_bench.table(result)


def test_cost_work_ratio_weighs_prompt_and_generated_tokens_by_their_measured_cost(tmp_path):
    """cost_work: prompt tokens at the shared system's prefill s/token, generated tokens at its decode
    s/token; a hand-computed point, and --from-json re-derives a saved result without measuring."""
    import argparse
    import json

    from ccft.bench import serve as bs

    shared = {
        "prefill_s": 2.0,
        "prefill_tokens": 900,
        "tail_tokens": 100,
        "decode_s": 4.0,
        "generated_tokens": 200,
    }
    no_share = {
        "prefill_s": 9.0,
        "prefill_tokens": 3900,
        "tail_tokens": 100,
        "decode_s": 5.0,
        "generated_tokens": 200,
    }
    into = {"shared": shared, "no_share": no_share, "throughput_ratio": 2.0}
    assert bs.cost_work({**into, "shared": {k: v for k, v in shared.items() if k != "tail_tokens"}}) == {}
    got = bs.cost_work(into)
    # c_p = 2 s / 1000 prompt tokens = 2 ms, c_d = 20 ms: shared 2 + 4 = 6 s, no-share 8 + 4 = 12 s
    assert got["prefill_s_per_token"] == pytest.approx(0.002) and got["decode_s_per_token"] == pytest.approx(
        0.02
    )
    assert got["cost_work_ratio"] == pytest.approx(2.0) and got["throughput_vs_cost"] == pytest.approx(1.0)
    saved = {
        "points": [{"sessions": 1, **into}],
        "saturation_sessions": 1,
        "scheduler": {"policies": ["fcfs"]},
    }
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(saved))
    out = bs.run(argparse.Namespace(from_json=str(path)))
    assert out["cost_work_ratio_at_saturation"] == pytest.approx(2.0)
    assert out["throughput_vs_cost_at_saturation"] == pytest.approx(1.0)
