"""``ccft bench serve`` at sharing depth m and on the compact C_base (issue 35): every request of the checked
session equals offline ``ccft.generate`` at the same depth and format, the measured peak KV by part (C_base,
each agent's own K/V, tails) is the known byte count of the ledger's contexts, and Eq. 9 generalised to depth
m and the format (``eq9_depth``) has its hand-computed value."""

from __future__ import annotations

import argparse

import pytest
import torch

from ccft.bench import serve as serve_bench
from ccft.core.compact import kv_nbytes
from ccft.core.errors import ConfigError
from ccft.serving import workloads
from conftest import DEEP_LAYERS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

L = DEEP_LAYERS
SHARED, GROWTH, NEW, TURNS = 48, 16, 3, 2
TOP = 2  # sessions at the top of the sweep (the calibration runs)


def bench_args(deep_dir, *extra: str, unique: int = 8):
    p = argparse.ArgumentParser()
    serve_bench.add_arguments(p)
    return p.parse_args(
        [
            "--model",
            str(deep_dir),
            "--sessions",
            "1",
            str(TOP),
            "--turns",
            str(TURNS),
            "--shared-tokens",
            str(SHARED),
            "--unique-tokens",
            str(unique),
            "--growth-tokens",
            str(GROWTH),
            "--max-new-tokens",
            str(NEW),
            "--threads",
            "1",
            "--check-outputs",
            *extra,
        ]
    )


def geometry(deep_dir):
    from transformers import AutoConfig

    from ccft.train.cache_store import kv_shape

    layers, kv_heads, head_dim = kv_shape(AutoConfig.from_pretrained(deep_dir))
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}


def test_depth_two_native(deep_dir):
    result = serve_bench.run(bench_args(deep_dir, "--share-from-layer", "2"))
    eq = result["outputs_vs_offline"]
    assert eq["equal"] == eq["requests"] == TURNS * 4  # offline ccft.generate at depth 2
    assert result["share_from_layer"] == 2 and result["cache_format"] == "native"
    geo = geometry(deep_dir)
    bpt = result["kv_bytes_per_token"]
    assert bpt == kv_nbytes("native", tokens=1, **geo)
    # the last turn's context: SHARED + GROWTH tokens, of which k = 1 is the handoff (the ledger's context is
    # n - k); each of the TOP sessions holds it once, and every agent its own K/V of it in 2 of the 4 layers
    ctx = SHARED + GROWTH - 1
    kv = result["kv"]["shared"]
    assert kv["cbase_bytes"] == TOP * ctx * bpt
    assert kv["own_bytes"] == {a: TOP * ctx * bpt * 2 // L for a in serve_bench.AGENTS}
    assert kv["tail_bytes"] == TOP * 4 * (8 + 1 + NEW) * bpt  # unique + handoff + generated, per agent
    assert kv["live_bytes"] == kv["cbase_bytes"] + sum(kv["own_bytes"].values()) + kv["tail_bytes"]
    ref = result["kv"]["shared_ref"]  # the same adapters at m = 0: no own K/V, the same C_base
    assert ref["cbase_bytes"] == kv["cbase_bytes"] and set(ref["own_bytes"].values()) == {0}
    assert result["kv"]["cbase_ref_vs_variant"]["measured"] == 1.0
    # the partial prefills' cost is measured in the same run against the m = 0 reference
    for point in result["points"]:
        cost = point["variant_cost"]
        assert cost["prefill_s"] > 0 and cost["prefill_s_ref"] > 0
        assert cost["throughput_vs_ref"] == (
            point["shared"]["throughput_tok_s"] / point["shared_ref"]["throughput_tok_s"]
        )
    assert "shared-ref" in serve_bench.table(result)


@pytest.mark.parametrize("unique", [0, 40])
def test_int8_cbase(deep_dir, unique):
    """unique 0: all agents send the same prompt and share one int8 context (C_base bytes ÷ 3.7 here);
    unique 40: each agent's own instruction makes its prompt, and so its int8 context, its own."""
    result = serve_bench.run(bench_args(deep_dir, "--cache-format", "int8", unique=unique))
    eq = result["outputs_vs_offline"]
    assert eq["equal"] == eq["requests"] == TURNS * 4  # offline ccft.generate(cache_format="int8")
    geo = geometry(deep_dir)
    e9d = result["eq9_depth"]
    contexts = e9d["int8_contexts"]
    assert contexts == (1 if unique == 0 else 4)
    whole = SHARED + GROWTH + unique - 1  # an int8 reader's context is its whole prompt less the handoff
    kv = result["kv"]["shared"]
    assert kv["cbase_bytes"] == TOP * contexts * kv_nbytes("int8", tokens=whole, **geo)
    assert kv["tail_bytes"] == TOP * 4 * (1 + NEW) * result["kv_bytes_per_token"]
    ref = result["kv"]["shared_ref"]
    assert ref["cbase_bytes"] == TOP * (SHARED + GROWTH - 1) * result["kv_bytes_per_token"]
    c = result["kv"]["cbase_ref_vs_variant"]
    assert c["measured"] == ref["cbase_bytes"] / kv["cbase_bytes"]
    # the prediction counts P and P + U tokens where the ledger counts them less the handoff token
    assert c["measured"] == pytest.approx(c["predicted"], rel=2 / SHARED)
    if unique == 0:  # one context: C_base drops by kv_nbytes' factor (fp32 / (int8 codes + bf16 scales))
        assert c["measured"] == kv_nbytes("native", tokens=whole, **geo) / kv_nbytes(
            "int8", tokens=whole, **geo
        )
        assert c["measured"] > 3.5
    else:  # four contexts of the whole prompt: more bytes than the one native context
        assert c["measured"] < 1


def test_eq9_depth_known_answer(tokenizer):
    """P = 80, U = 8, G = 3, N = 4, L = 4: shared at m = 2 holds 80·4 + 4·80·2 + 4·11·4 = 1136 layer-tokens,
    no-share 4·91·4 = 1456; int8 scales the C_base term by kv_nbytes' ratio."""
    trace = workloads.generate(
        "react",
        sessions=1,
        turns=2,
        agents=list(serve_bench.AGENTS),
        shared_tokens=64,
        unique_tokens=8,
        growth_tokens=16,
        max_new_tokens=3,
        rate=None,
        seed=0,
        tokenizer=tokenizer,
    )
    geo = {"kv_heads": 2, "head_dim": 16}
    plt = kv_nbytes("native", layers=1, tokens=1, **geo)  # bytes per layer-token, fp32
    common = dict(n_agents=4, gen_tokens=3, layers=4, dtype=torch.float32, **geo)
    e = serve_bench.eq9_depth(trace, depth=2, **common)
    assert e["shared_bytes"] == 1136 * plt and e["no_share_bytes"] == 1456 * plt
    assert e["cbase_bytes"] == 80 * 4 * plt and e["own_bytes_per_agent"] == 80 * 2 * plt
    assert e["bytes_if_cbase_only_above_m"] == (1136 - 80 * 2) * plt
    assert e["ratio_with_generation"] == 1456 / 1136
    m0 = serve_bench.eq9_depth(trace, **common)  # m = 0 native: the paper's Eq. 9 with the generation
    assert m0["ratio_with_generation"] == serve_bench.eq9(trace, 4, 3)["ratio_with_generation"]
    i8 = serve_bench.eq9_depth(trace, cache_format="int8", **common)
    # with 8 unique tokens the agent prompts are all equal (the role text does not fit): one context
    assert i8["int8_contexts"] == 1
    assert i8["cbase_bytes"] == kv_nbytes("int8", layers=4, tokens=88, **geo)
    assert i8["shared_bytes"] == i8["cbase_bytes"] + 4 * 3 * 4 * plt


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--share-from-layer", "5"], "--share-from-layer=5: it must be in 0..4"),
        (["--share-from-layer", "-1"], "--share-from-layer -1"),
        (["--cache-format", "int8", "--decoder", "math=runs/math"], "drop --decoder"),
    ],
)
def test_bad_options_are_config_errors_before_the_model_loads(deep_dir, monkeypatch, extra, match):
    import ccft

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ccft, "load_base", no_load)
    with pytest.raises(ConfigError, match=match):
        serve_bench.run(bench_args(deep_dir, *extra))
