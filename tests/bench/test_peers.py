"""``ccft bench peers``: the pieces that need no peer — requests per system (the hint only for ccft-hint),
the KV sizes each system is given, the counters read from each server's /metrics, the statistics of a
point, rounds and their spread, ratios at every point and at saturation, the outputs check's rule and the
refusal of a run whose outputs differ, the launch settings recorded, ``--sweep``, and the provenance check
of a resumed file. Servers are fakes: no vLLM or llama.cpp runs here."""

from __future__ import annotations

import argparse
import contextlib
import json
import types

import pytest

from ccft.bench import peers, provenance
from ccft.serving.client import ReplayRecord
from ccft.serving.workloads import generate

AGENTS = ("planner", "math", "code")
#: SmolLM2-135M-Instruct's config.json (the fields the KV size reads)
SMOL_CONFIG = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
}


@pytest.fixture(scope="module")
def trace(tokenizer):
    return generate(
        "react",
        sessions=2,
        turns=2,
        agents=list(AGENTS),
        shared_tokens=64,
        unique_tokens=8,
        growth_tokens=16,
        max_new_tokens=4,
        rate=None,
        seed=0,
        tokenizer=tokenizer,
    )


def _args(**kw):
    base = dict(
        max_new_tokens=4, kv_budget_mb=64.0, threads=2, sessions=[1, 2], model="m", sweep=False, rounds=2
    )
    return types.SimpleNamespace(**{**base, **kw})


def _system(name, agents=AGENTS, **kw):
    return peers.System(
        name,
        _args(**kw.pop("args", {})),
        list(agents),
        {},
        kv_bytes_per_token=46080,
        max_prompt=100,
        log=lambda m: None,
        **kw,
    )


def test_requests_per_system(trace):
    reqs = {s: _system(s).requests(trace) for s in peers.SYSTEMS}
    prompts = [list(r.prompt_ids) for r in trace.requests]
    assert all([r.prompt for r in rs] == prompts for rs in reqs.values())
    # fairness: only ccft-hint is told where the shared context ends; ccft finds it itself, as the peers do
    assert [r.shared_prefix_tokens for r in reqs["ccft-hint"]] == [r.shared_len for r in trace.requests]
    assert all(r.shared_len > 0 for r in trace.requests)
    for s in ("ccft", "ccft-no-share", "vllm", "llamacpp"):
        assert all(r.shared_prefix_tokens is None for r in reqs[s]), s
    for r in reqs["llamacpp"]:
        on = [x["id"] for x in r.extra["lora"] if x["scale"] == 1.0]
        assert on == [list(AGENTS).index(r.model)] and len(r.extra["lora"]) == 3
    assert all(r.extra["ignore_eos"] and r.extra["temperature"] == 0.0 for rs in reqs.values() for r in rs)
    assert [r.depends_on for r in reqs["vllm"]] == [tuple(r.depends_on) for r in trace.requests]


def test_generated_ids_sends_the_hint_only_for_ccft_hint(trace, monkeypatch):
    sent = []

    def post_json(url, body, timeout):
        sent.append(body)
        return {"choices": [{"token_ids": [1, 2]}]}

    monkeypatch.setattr("ccft.bench.llamacpp.post_json", post_json)
    for s in ("ccft", "ccft-hint", "vllm"):
        system = _system(s)
        assert system.generated_ids("http://unused", system.requests(trace)[0]) == [1, 2]
    assert ["shared_prefix_tokens" in b for b in sent] == [False, True, False]
    assert sent[1]["shared_prefix_tokens"] == trace.requests[0].shared_len


def test_sixteen_agents_have_names_adapters_and_slots(tokenizer):
    names = peers.peer_agents(16)
    assert names[:8] == ["planner", "math", "code", "tools", "critic", "search", "writer", "verifier"]
    assert names[8:] == [f"agent{i}" for i in range(8, 16)] and len(set(names)) == 16
    with pytest.raises(peers.ConfigError, match="at least 1"):
        peers.peer_agents(0)
    s = _system("llamacpp", agents=names, args={"kv_budget_mb": 2048.0, "sessions": [1, 2, 4]})
    s.max_prompt = 1184
    # one slot per request in flight would be 64; the budget holds 36 whole slots of 1204 -> 1280 tokens
    ctx = s.llamacpp_context()
    assert ctx["parallel_slots"] == 36 >= 16 and ctx["slot_tokens"] == 1280
    # every request turns on its own adapter of the 16 llama-server loads
    reqs = s.requests(generate("react", sessions=1, turns=1, agents=names, shared_tokens=16,
                               unique_tokens=4, growth_tokens=4, max_new_tokens=2, rate=None, seed=0,
                               tokenizer=tokenizer))  # fmt: skip
    assert sorted(r.model for r in reqs) == sorted(names)
    for r in reqs:
        assert len(r.extra["lora"]) == 16
        assert [x["id"] for x in r.extra["lora"] if x["scale"] == 1.0] == [names.index(r.model)]


def test_kv_bytes_per_token_from_config():
    assert peers.kv_bytes_per_token(SMOL_CONFIG) == 2 * 30 * 3 * 64 * 4 == 46080
    assert peers.kv_bytes_per_token(SMOL_CONFIG, element_bytes=2) == 23040
    assert peers.kv_bytes_per_token({"text_config": {**SMOL_CONFIG, "head_dim": 128}}) == 2 * 30 * 3 * 128 * 4
    with pytest.raises(peers.ConfigError, match="num_hidden_layers"):
        peers.kv_bytes_per_token({"hidden_size": 8})


def test_llamacpp_context_tokens_from_the_kv_budget():
    budget = 2048 * 2**20
    bpt = peers.kv_bytes_per_token(SMOL_CONFIG)
    # 4 agents x 4 sessions in flight, requests of 1184 + 32 + 16 tokens (a slot of 1280 after rounding)
    c = peers.llamacpp_context(budget, bpt, 1232, 16)
    assert c["budget_tokens"] == budget // 46080 == 46603
    assert c["parallel_slots"] == 16 and c["slot_tokens"] == 2816  # 46603 / 16 = 2912 -> 2816 (x 256)
    assert c["ctx_tokens"] == 16 * 2816 == 45056 and c["kv_bytes"] == 45056 * 46080 <= budget
    assert budget - c["kv_bytes"] < 16 * 256 * bpt  # less than 256 tokens a slot short of the budget
    u = peers.llamacpp_context(budget, bpt, 1232, 16, unified=True)
    assert u["ctx_tokens"] == 46592 and u["parallel_slots"] == 16 and budget - u["kv_bytes"] < 256 * bpt
    one = peers.llamacpp_context(budget, bpt, 1232, 16, parallel=4)
    assert one["parallel_slots"] == 4 and one["slot_tokens"] == 11520 and one["ctx_tokens"] == 46080
    # the old rule (slots x request tokens) gave llama.cpp 908 MB of a 2 GiB budget
    assert c["kv_bytes"] > 0.96 * budget
    with pytest.raises(peers.ConfigError, match="less than one request"):
        peers.llamacpp_context(64 * 2**20, bpt, 1500, 4)


def _fake_vllm_server(monkeypatch, tmp_path):
    from ccft.bench import vllm

    env = vllm.VllmEnv(tmp_path, tmp_path / "python", "0.32.0", {"vllm": "0.32.0", "torch": "2.13.0+cpu"})
    monkeypatch.setattr(vllm, "ensure_vllm", lambda log: env)
    monkeypatch.setattr("ccft.core.models.resolve_model_path", lambda m: tmp_path / "model")

    @contextlib.contextmanager
    def server(env, model_dir, loras, *, threads, kv_cache_gib, log, record, **kw):
        record.update(
            {
                "command": vllm.serve_command(env, model_dir, loras, port=1, kv_cache_gib=kv_cache_gib, **kw),
                "env": vllm.serve_env(threads, kv_cache_gib),
            }
        )
        yield "http://fake-vllm"

    monkeypatch.setattr(vllm, "server", server)


def test_launch_settings_and_kv_bytes_are_recorded(monkeypatch, tmp_path):
    from ccft.bench import llamacpp as lc

    _fake_vllm_server(monkeypatch, tmp_path)
    adapters = {n: {"ccft": tmp_path / "c" / n, "full-ft": tmp_path / "f" / n} for n in AGENTS}
    adapters["__gguf__"] = {**{n: tmp_path / f"{n}.gguf" for n in AGENTS}, "base": tmp_path / "base.gguf"}
    args = {"kv_budget_mb": 2048.0, "sessions": [1, 2, 4]}
    v = peers.System(
        "vllm",
        _args(**args),
        list(AGENTS),
        adapters,
        kv_bytes_per_token=46080,
        max_prompt=1184,
        knobs={"max_num_batched_tokens": 2048},
        log=lambda m: None,
    )
    with v.serve() as url:
        assert url == "http://fake-vllm"
    cmd = v.info["command"]
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "2048" and "--max-num-seqs" not in cmd
    assert v.info["kv_bytes"] == 2 * 2**30 == v.info["kv_budget_bytes"]
    assert v.info["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2" and v.info["versions"]["torch"] == "2.13.0+cpu"
    assert v.info["knobs"]["max_num_batched_tokens"] == 2048 and v.info["knobs"]["max_num_seqs"] is None
    assert v.info["knobs"]["max_model_len"] == 1184 + 4 + 16

    build = lc.LlamaCpp(tmp_path / "lc", "0.3.36", {"ggml_version": "0.25.3"}, tmp_path / "lc" / "build")
    monkeypatch.setattr(lc, "ensure_built", lambda log: build)
    monkeypatch.setattr(lc, "server_process", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(lc, "free_port", lambda: 7)
    ll = peers.System(
        "llamacpp",
        _args(**args),
        list(AGENTS),
        adapters,
        kv_bytes_per_token=46080,
        max_prompt=1184,
        knobs={"flash_attn": "on", "cache_reuse": 256},
        log=lambda m: None,
    )
    with ll.serve() as url:
        assert url == "http://127.0.0.1:7"
    cmd = ll.info["command"]
    assert cmd[cmd.index("-c") + 1] == str(ll.info["ctx_tokens"]) and cmd[cmd.index("-np") + 1] == "12"
    assert cmd[cmd.index("-fa") + 1] == "on" and cmd.count("-fa") == 1
    assert cmd[cmd.index("--cache-reuse") + 1] == "256" and "--kv-unified" not in cmd
    assert cmd.count("--lora") == 3 and "--lora-init-without-apply" in cmd and "--metrics" in cmd
    # 46603 tokens over 12 slots (3 agents x 4 sessions): 3883 -> 3840 a slot
    assert ll.info["ctx_tokens"] == 12 * 3840 and ll.info["kv_bytes"] == 12 * 3840 * 46080 <= 2 * 2**30
    assert ll.info["knobs"] == {
        "flash_attn": "on",
        "cache_reuse": 256,
        "parallel": 12,
        "kv_unified": False,
        "threads": 2,
    }
    assert ll.info["llamacpp"]["ggml_version"] == "0.25.3" and ll.info["adapters_loaded"] == 3
    with pytest.raises(peers.ConfigError, match="no knob"):
        peers.knobs_of("vllm", {"flash_attn": "on"})


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
    assert _system("ccft-hint").hit_ratio(poll, 1000) == pytest.approx(0.4)


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


def test_rounds_summary_median_and_spread():
    run = {"points": []}
    fig = {"throughput_tok_s": 10.0, "tpot_p95_s": 0.2, "latency_p95_s": 3.0, "prefix_hit_ratio": None}
    peers.record_round(run, 2, "vllm", 0, fig)
    peers.record_round(run, 2, "vllm", 1, {**fig, "throughput_tok_s": 14.0, "tpot_p95_s": 0.1})
    m = peers.record_round(run, 2, "vllm", 2, {**fig, "throughput_tok_s": 11.0, "tpot_p95_s": 0.3})
    assert m["throughput_tok_s"] == 11.0 and m["tpot_p95_s"] == 0.2 and m["rounds_measured"] == 3
    assert m["spread"]["throughput_tok_s"] == {"min": 10.0, "max": 14.0}
    assert m["spread"]["tpot_p95_s"] == {"min": 0.1, "max": 0.3}
    assert m["prefix_hit_ratio"] is None and [r["round"] for r in m["rounds"]] == [0, 1, 2]
    assert peers.has_round(run, 2, "vllm", 1) and not peers.has_round(run, 2, "vllm", 3)
    assert not peers.has_round(run, 1, "vllm", 0) and not peers.has_round(run, 2, "ccft", 0)
    # a round measured again replaces its figures
    m = peers.record_round(run, 2, "vllm", 1, {**fig, "throughput_tok_s": 12.0})
    assert m["spread"]["throughput_tok_s"] == {"min": 10.0, "max": 12.0} and len(m["rounds"]) == 3


def _pt(n, **tps):
    return {
        "sessions": n,
        "systems": {
            s.replace("_", "-"): {
                "throughput_tok_s": t,
                "latency_p95_s": 10.0 / t,
                "latency_p50_s": 1.0,
                "ttft_p95_s": 0.5,
                "tpot_p95_s": 1.0 / t,
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


def test_table_has_a_ratio_at_every_point_and_ccft_hint_apart():
    run = {
        "points": [
            _pt(1, ccft=10, ccft_hint=12, vllm=4, llamacpp=5),
            _pt(2, ccft=20, ccft_hint=22, vllm=8, llamacpp=5),
            _pt(4, ccft=40, ccft_hint=41, vllm=8, llamacpp=4),
        ],
        "outputs": {s: {"rows": 8, "rows_equal": 8} for s in peers.SYSTEMS},
    }
    peers.derive(run)
    assert [q["sessions"] for q in run["point_ratios"]["vllm"]] == [1, 2, 4]
    assert [q["throughput_ratio"] for q in run["point_ratios"]["llamacpp"]] == [2.0, 4.0, 10.0]
    assert run["point_ratios"]["vllm"][0]["tpot_p95_ratio"] == pytest.approx((1 / 10) / (1 / 4))
    assert [q["throughput_ratio"] for q in run["point_ratios"]["ccft-hint"]] == pytest.approx(
        [10 / 12, 20 / 22, 40 / 41]
    )
    assert set(run["ratios"]) == {"vllm", "llamacpp"}  # ccft-hint is no headline
    text = peers.table({"runs": {"agents4": run}})
    # ccft's own tok/s and TPOT p95 beside the peer's, and the ratios, at every point
    assert "| 1 | vllm | 10.0 | 4.0 | 2.50 | 100 | 250 | 0.40 | 0.40 |" in text
    assert "| 2 | vllm | 20.0 | 8.0 | 2.50 | 50 | 125 | 0.40 | 0.40 |" in text
    assert "| 4 | vllm | 40.0 | 8.0 | 5.00 | 25 | 125 | 0.20 | 0.20 |" in text
    for n, t in ((1, 5.0), (2, 5.0), (4, 4.0)):
        assert f"| {n} | llamacpp | {10 * n:.1f} | {t:.1f} | {10 * n / t:.2f} |" in text
    hint = text.split("ccft beside ccft-hint")[1]
    assert (
        "| 1 | ccft-hint | 10.0 | 12.0 | 0.83 |" in hint and "| 4 | ccft-hint | 40.0 | 41.0 | 0.98 |" in hint
    )
    assert "| ccft-hint |" not in text.split("saturation sessions")[1].split("(ccft itself)")[0]


def test_outputs_check_prefix_rule(trace):
    s = _system("ccft")
    reqs = s.requests(trace)
    refs = {r.request_id: [1, 2, 3] for r in reqs}
    answers = {r.request_id: [1, 2, 3, 9] for r in reqs}  # offline stopped at EOS: a prefix is equal
    answers[reqs[1].request_id] = [1, 5, 3, 9]
    answers[reqs[2].request_id] = [1, 2]  # the server stopped early: unequal, no error
    s.generated_ids = lambda url, r: answers[r.request_id]
    out = peers.outputs_check(s, "http://unused", trace, refs)
    assert out["rows"] == len(reqs) and out["rows_equal"] == len(reqs) - 2
    assert out["mismatches"] == [
        {
            "request": reqs[1].request_id,
            "agent": reqs[1].model,
            "session": reqs[1].session,
            "first_difference": 1,
            "got": 5,
            "expected": 2,
        },
        {
            "request": reqs[2].request_id,
            "agent": reqs[2].model,
            "session": reqs[2].session,
            "first_difference": 2,
            "got": None,
            "expected": 3,
        },
    ]
    with pytest.raises(peers.OutputsMismatch) as e:
        peers.refuse_unequal("ccft", out)
    msg = str(e.value)
    for part in (
        "ccft:",
        f"agent {reqs[1].model}",
        f"session {reqs[1].session}",
        "position 1",
        "gave 5",
        "reference 2",
        "refused",
    ):
        assert part in msg
    peers.refuse_unequal("ccft", {**out, "rows_equal": out["rows"], "rows_equal_share": 1.0})
    peers.refuse_unequal("ccft", None)  # not checked yet


def test_unknown_or_missing_ccft_system_is_refused():
    args = types.SimpleNamespace(systems="vllm", from_json=None)
    with pytest.raises(peers.ConfigError, match="ccft included"):
        peers.run(args, log=lambda m: None)
    with pytest.raises(peers.ConfigError, match="choose from"):
        peers.parse_systems("ccft,sglang")
    assert peers.parse_systems("ccft, vllm,ccft") == ["ccft", "vllm"]


# ------------------------------------------------------------------ run() with fake servers

PROVENANCE = {"git_commit": "a" * 40, "git_dirty": False, "git_diff_sha256": None, "ccft": "0"}


class Fakes:
    """Fake servers for ``peers.run``: what was started and measured, in order; outputs a system gets
    wrong; throughput per (system, round) = 10 + 2·round (+ 5 for vLLM's 2048-token variant)."""

    def __init__(self, monkeypatch, tokenizer, seed=0, wrong=()):
        self.calls, self.wrong, self.seed = [], set(wrong), seed
        monkeypatch.setattr(peers.provenance, "collect", lambda settings=None, root=None: dict(PROVENANCE))
        monkeypatch.setattr(peers, "load_tokenizer", lambda model: tokenizer)
        monkeypatch.setattr(peers, "model_kv_bytes_per_token", lambda model, element_bytes=4: 46080)
        monkeypatch.setattr(peers, "make_adapters", self.make_adapters)
        monkeypatch.setattr(peers, "gguf_exports", lambda adapters, agents, folder, log: {"base": "b.gguf"})
        monkeypatch.setattr(peers, "offline_references", self.references)
        monkeypatch.setattr(peers, "run_point", self.run_point)
        monkeypatch.setattr(peers, "plots", lambda result, folder: [])
        fakes = self

        @contextlib.contextmanager
        def serve(system):
            fakes.calls.append(("serve", system.round_index, system.name))
            system.info = {"kv_bytes": 2**30, "knobs": dict(system.knobs), "command": [system.name]}
            yield f"http://fake/{system.name}"

        def generated_ids(system, url, req):
            if system.knobs.get("flash_attn") == "on":
                return [7, 0, 0, 0]  # fp16 attention: other outputs
            if system.name in fakes.wrong and req.model == "math":
                return [7, 8, 99, 10]
            return [7, 8, 9, 10]

        monkeypatch.setattr(peers.System, "serve", serve)
        monkeypatch.setattr(peers.System, "generated_ids", generated_ids)

    def make_adapters(self, model, agents, folder, **kw):
        self.calls.append(("adapters", len(agents)))
        return {n: {"ccft": folder / "c" / n, "full-ft": folder / "f" / n} for n in agents}

    def references(self, model, adapters, agents, trace):
        ids = {r.request_id: [7, 8, 9, 10] for r in trace.requests}
        return {"prefillshare": ids, "full-ft": ids}

    def run_point(self, system, url, trace, max_new_tokens):
        what = "warmup" if trace.meta["seed"] == self.seed + 2 else trace.meta["sessions"]
        self.calls.append(("point", system.round_index, system.name, what))
        tps = 10.0 + 2 * (system.round_index or 0) + 5 * (system.knobs.get("max_num_batched_tokens") == 2048)
        return {
            "throughput_tok_s": tps,
            "latency_p50_s": 1.0,
            "latency_p95_s": 2.0,
            "ttft_p95_s": 0.5,
            "tpot_p95_s": 1.0 / tps,
            "prefix_hit_ratio": 0.5,
        }

    def points(self):
        return [c[1:] for c in self.calls if c[0] == "point"]


def _cli(tmp_path, *argv):
    p = argparse.ArgumentParser()
    peers.add_arguments(p)
    return p.parse_args(
        [
            "--out",
            str(tmp_path / "peers.json"),
            "--work",
            str(tmp_path / "work"),
            "--turns",
            "1",
            "--shared-tokens",
            "32",
            "--unique-tokens",
            "4",
            "--growth-tokens",
            "8",
            "--max-new-tokens",
            "4",
            *argv,
        ]
    )


def test_rounds_interleave_systems_and_keep_the_spread(monkeypatch, tmp_path, tokenizer):
    fakes = Fakes(monkeypatch, tokenizer)
    args = _cli(tmp_path, "--systems", "ccft,vllm,llamacpp", "--agents", "2", "--sessions", "2", "1")
    result = peers.run(args, log=lambda m: None)
    order = [(r, s, w) for r, s, w in fakes.points()]
    expected = [(r, s, w) for r in (0, 1) for s in ("ccft", "vllm", "llamacpp") for w in ("warmup", 1, 2)]
    assert order == expected  # each round: every system in turn, over every point; then the next round
    assert [c for c in fakes.calls if c[0] == "serve"] == [
        ("serve", r, s) for r in (0, 1) for s in ("ccft", "vllm", "llamacpp")
    ]
    run = result["runs"]["agents2"]
    m = next(p for p in run["points"] if p["sessions"] == 2)["systems"]["vllm"]
    assert m["throughput_tok_s"] == 11.0 and m["spread"]["throughput_tok_s"] == {"min": 10.0, "max": 12.0}
    assert [x["round"] for x in m["rounds"]] == [0, 1] and m["rounds_measured"] == 2
    assert set(run["outputs"]) == {"ccft", "vllm", "llamacpp"}
    assert all(o["rows_equal_share"] == 1.0 for o in run["outputs"].values())
    assert run["systems"]["vllm"]["kv_bytes"] == 2**30 and result["provenance"] == PROVENANCE
    assert run["point_ratios"]["vllm"][0]["throughput_ratio"] == 1.0
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["provenance"] == PROVENANCE and saved["runs"]["agents2"]["points"] == run["points"]

    # resumed with the same commit and one more round: only round 2 is measured
    fakes.calls.clear()
    peers.run(_cli(tmp_path, "--systems", "ccft,vllm,llamacpp", "--agents", "2", "--sessions", "1", "2",
                   "--rounds", "3"), log=lambda m: None)  # fmt: skip
    assert fakes.points() == [(2, s, w) for s in ("ccft", "vllm", "llamacpp") for w in ("warmup", 1, 2)]


def test_a_mismatch_refuses_the_run_before_that_system_is_timed(monkeypatch, tmp_path, tokenizer):
    fakes = Fakes(monkeypatch, tokenizer, wrong={"vllm"})
    args = _cli(tmp_path, "--systems", "ccft,vllm", "--agents", "2", "--sessions", "1", "--rounds", "1")
    with pytest.raises(peers.OutputsMismatch) as e:
        peers.run(args, log=lambda m: None)
    msg = str(e.value)
    assert msg.startswith("vllm: 1/2 greedy outputs equal")
    assert "agent math, session 0" in msg and "position 2, vllm gave 99, the offline reference 9" in msg
    assert [p[1] for p in fakes.points()] == ["ccft", "ccft"]  # vLLM was never timed
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["runs"]["agents2"]["outputs"]["vllm"]["rows_equal_share"] == 0.5
    # a rerun on that file is refused at once, nothing started
    fakes.calls.clear()
    with pytest.raises(peers.OutputsMismatch, match="vllm"):
        peers.run(args, log=lambda m: None)
    assert fakes.calls == []


def test_resume_from_another_commit_is_refused_before_measuring(monkeypatch, tmp_path, tokenizer):
    out = tmp_path / "peers.json"
    out.write_text(json.dumps({"benchmark": "serve-peers", "runs": {}, "provenance": {**PROVENANCE}}))
    fakes = Fakes(monkeypatch, tokenizer)
    monkeypatch.setattr(
        peers.provenance, "collect", lambda settings=None, root=None: {**PROVENANCE, "git_commit": "b" * 40}
    )
    with pytest.raises(provenance.ProvenanceMismatch, match="another commit"):
        peers.run(_cli(tmp_path, "--systems", "ccft", "--agents", "2"), log=lambda m: None)
    assert fakes.calls == []
    out.write_text(json.dumps({"benchmark": "serve-peers", "runs": {}}))  # written before provenance
    with pytest.raises(provenance.ProvenanceMismatch, match="records no provenance"):
        peers.run(_cli(tmp_path, "--systems", "ccft", "--agents", "2"), log=lambda m: None)
    assert fakes.calls == []


def test_resume_with_the_real_provenance_of_another_commit(tmp_path):
    """With the real ``provenance.collect``: a file of another commit is refused."""
    out = tmp_path / "peers.json"
    out.write_text(json.dumps({"runs": {}, "provenance": {**PROVENANCE, "git_commit": "0" * 40}}))
    args = _cli(tmp_path, "--systems", "ccft", "--agents", "2")
    with pytest.raises(provenance.ProvenanceMismatch, match=str(out)):
        peers.run(args, log=lambda m: None)


def test_sweep_keeps_the_fastest_variant_with_equal_outputs(monkeypatch, tmp_path, tokenizer):
    fakes = Fakes(monkeypatch, tokenizer)
    args = _cli(
        tmp_path, "--systems", "ccft,vllm,llamacpp", "--agents", "2", "--sessions", "1", "2", "--sweep",
        "--rounds", "1",
    )  # fmt: skip
    result = peers.run(args, log=lambda m: None)
    sweep = result["runs"]["agents2"]["sweep"]
    assert [v["variant"] for v in sweep["vllm"]["variants"]] == peers.sweep_variants("vllm", 2, 2)
    assert sweep["vllm"]["kept"] == {"max_num_batched_tokens": 2048, "max_num_seqs": None}
    assert all(v["figures"]["throughput_tok_s"] > 0 for v in sweep["vllm"]["variants"])
    fa = next(v for v in sweep["llamacpp"]["variants"] if v["variant"] == {"flash_attn": "on"})
    assert fa["outputs"]["rows_equal_share"] == 0.0 and "figures" not in fa  # measured, not kept
    assert sweep["llamacpp"]["kept"] == peers.LLAMACPP_KNOBS  # ties: the defaults come first
    # the sweep measures at the largest point only, before round 0; the run then uses the kept knobs
    sweep_points = [p for p in fakes.points() if p[0] is None]
    assert {p[2] for p in sweep_points} == {"warmup", 2}
    assert result["runs"]["agents2"]["systems"]["vllm"]["knobs"]["max_num_batched_tokens"] == 2048
    assert "--sweep vllm at 2 sessions" in peers.table(result)
    assert "KV MiB given" in peers.table(result)


def test_cli_help_and_defaults():
    p = argparse.ArgumentParser()
    peers.add_arguments(p)
    a = p.parse_args([])
    assert a.rounds == 2 and a.sweep is False and a.systems.split(",") == list(peers.SYSTEMS)
    text = p.format_help()
    for flag in ("--rounds", "--sweep", "--kv-budget-mb", "--agents"):
        assert flag in text
