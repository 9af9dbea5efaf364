"""``ccft bench peers``: the pieces that need no peer — requests per system, the counters read from each
server's /metrics, the statistics of a point, saturation and ratios, and the outputs check's rule."""

from __future__ import annotations

import types

import pytest

from ccft.bench import peers
from ccft.serving.client import ReplayRecord
from ccft.serving.workloads import generate


@pytest.fixture(scope="module")
def trace(tokenizer):
    return generate(
        "react",
        sessions=2,
        turns=2,
        agents=["planner", "math", "code"],
        shared_tokens=64,
        unique_tokens=8,
        growth_tokens=16,
        max_new_tokens=4,
        rate=None,
        seed=0,
        tokenizer=tokenizer,
    )


def _system(name, agents=("planner", "math", "code")):
    args = types.SimpleNamespace(max_new_tokens=4, kv_budget_mb=64.0, threads=2, sessions=[1, 2])
    return peers.System(
        name, args, list(agents), {}, kv_bytes_per_token=46080, max_prompt=100, log=lambda m: None
    )


def test_requests_per_system(trace):
    ccft_reqs = _system("ccft").requests(trace)
    llama = _system("llamacpp").requests(trace)
    vllm = _system("vllm").requests(trace)
    assert (
        [r.prompt for r in ccft_reqs]
        == [r.prompt for r in llama]
        == [list(r.prompt_ids) for r in trace.requests]
    )
    assert all(r.shared_prefix_tokens is not None for r in ccft_reqs)
    assert all(r.shared_prefix_tokens is None for r in llama + vllm)  # a ccft extension
    for r in llama:
        on = [x["id"] for x in r.extra["lora"] if x["scale"] == 1.0]
        assert on == [["planner", "math", "code"].index(r.model)] and len(r.extra["lora"]) == 3
    assert all(r.extra["ignore_eos"] and r.extra["temperature"] == 0.0 for r in ccft_reqs + llama + vllm)
    assert [r.depends_on for r in vllm] == [tuple(r.depends_on) for r in trace.requests]


VLLM_METRICS = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="base"} 3000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="base"} 1200.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="base"} 0.25
"""


def test_metric_values_and_counters():
    v = peers.metric_values(VLLM_METRICS)
    assert v["vllm:prefix_cache_hits_total"] == 1200.0 and v["vllm:kv_cache_usage_perc"] == 0.25
    poll = peers.MetricsPoller("http://unused", lambda v: None)
    poll.first = {"vllm:prefix_cache_queries_total": 1000.0, "vllm:prefix_cache_hits_total": 200.0}
    poll.last = v
    s = _system("vllm")
    s.info = {"kv_cache_gib": 2.0}
    assert s.hit_ratio(poll, 999) == pytest.approx(1000 / 2000)
    assert s.peak_kv(v) == pytest.approx(0.25 * 2 * 2**30)
    poll.first, poll.last = {"llamacpp:prompt_tokens_total": 10.0}, {"llamacpp:prompt_tokens_total": 410.0}
    assert _system("llamacpp").hit_ratio(poll, 1000) == pytest.approx(0.6)
    poll.first = {
        "ccft_scheduler_prefix_hit_tokens_total": 0.0,
        "ccft_scheduler_context_reuse_tokens_total": 5.0,
    }
    poll.last = {
        "ccft_scheduler_prefix_hit_tokens_total": 100.0,
        "ccft_scheduler_context_reuse_tokens_total": 305.0,
    }
    assert _system("ccft").hit_ratio(poll, 1000) == pytest.approx(0.4)


def _rec(i, sent, ttft, latency, n=4):
    return ReplayRecord(
        str(i), "m", 0, 0.0, sent=sent, status=200, ttft=ttft, latency=latency, completion_tokens=n
    )


def test_point_stats_known_values():
    recs = [_rec(0, 0.0, 1.0, 4.0), _rec(1, 0.0, 2.0, 8.0), _rec(2, 1.0, 0.5, 2.0)]
    s = peers.point_stats(recs, makespan=6.0)
    assert s["generated_tokens"] == 12 and s["throughput_tok_s"] == 2.0
    assert s["latency_p50_s"] == 4.0 and s["latency_p95_s"] == 8.0 and s["ttft_p95_s"] == 2.0
    assert s["tpot_p95_s"] == pytest.approx(2.0)  # (8 - 2) / 3
    bad = _rec(3, 0.0, None, 1.0)
    bad.status, bad.error = 500, "boom"
    with pytest.raises(RuntimeError, match="1 request"):
        peers.point_stats(recs + [bad], makespan=6.0)


def _pt(n, **tps):
    return {
        "sessions": n,
        "systems": {
            s: {
                "throughput_tok_s": t,
                "latency_p95_s": 10.0 / t,
                "latency_p50_s": 1.0,
                "ttft_p95_s": 0.5,
                "tpot_p95_s": 0.1,
            }
            for s, t in tps.items()
        },
    }


def test_ratios_at_the_peers_saturation_point():
    run = {"points": [_pt(1, ccft=10, vllm=4), _pt(2, ccft=20, vllm=7.7), _pt(4, ccft=40, vllm=8)]}
    peers.derive(run)
    q = run["ratios"]["vllm"]
    assert q["saturation_sessions"] == 2  # 7.7 >= 0.95 * 8
    assert q["throughput_ratio"] == pytest.approx(20 / 7.7) and q["p95_ratio"] == pytest.approx(
        0.5 / (10 / 7.7)
    )
    assert "llamacpp" not in run["ratios"]
    assert "| vllm | 2 |" in peers.table(
        {"runs": {"agents4": {**run, "outputs": {"vllm": {"rows": 8, "rows_equal": 8}}}}}
    )


def test_outputs_check_prefix_rule(trace):
    s = _system("ccft")
    reqs = s.requests(trace)
    refs = {r.request_id: [1, 2, 3] for r in reqs}
    answers = {r.request_id: [1, 2, 3, 9] for r in reqs}  # offline stopped at EOS: a prefix is equal
    answers[reqs[1].request_id] = [1, 5, 3, 9]
    s.generated_ids = lambda url, r: answers[r.request_id]
    out = peers.outputs_check(s, "http://unused", trace, refs)
    assert out["rows"] == len(reqs) and out["rows_equal"] == len(reqs) - 1
    assert out["mismatches"] == [
        {"request": reqs[1].request_id, "agent": reqs[1].model, "first_difference": 1}
    ]


def test_unknown_or_missing_ccft_system_is_refused():
    args = types.SimpleNamespace(systems="vllm", from_json=None)
    with pytest.raises(peers.ConfigError, match="ccft included"):
        peers.run(args, log=lambda m: None)
