"""ccft.bench.decode: the roofline on measured bandwidth and peak GEMM, the --llamacpp flag checks, the
llama.cpp rows and ratios (llama.cpp stubbed with known numbers), and the table with and without them."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from ccft.bench import decode
from ccft.bench import llamacpp as lc
from ccft.core.errors import ConfigError


def _args(**kw):
    p = argparse.ArgumentParser()
    decode.add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"random_weights": True}, "drop --random-weights"),
        ({"device": "cuda"}, "use --device cpu"),
        ({"dtype": "bfloat16"}, "use --dtype float32"),
        ({"model": "org/hub-id"}, "neither an embedded model"),
    ],
)
def test_llamacpp_flag_checks(kw, match):
    args = _args(**{"llamacpp": True, "device": "cpu", **kw})
    with pytest.raises(ConfigError, match=match):
        decode.check_llamacpp_args(args)
    decode.check_llamacpp_args(_args(llamacpp=True, device="cpu"))  # the default run is fine


def test_roofline_is_the_slower_of_bandwidth_and_peak(tiny_base):
    from ccft.inference import SharedPrefillEngine

    engine = SharedPrefillEngine(tiny_base, max_batch=2)
    model, cfg = tiny_base.model, tiny_base.model.config
    prompts, new = [[5] * 10, [6] * 20], 4
    # independent counts: fp32 parameters (untied embedding: only the 2 looked-up rows are read),
    # every Linear weight as matmul parameters, KV of both rows at the mean context 15 + 4/2
    emb = model.get_input_embeddings().weight
    weight_bytes = 4 * (sum(p.numel() for p in model.parameters()) - emb.numel() + 2 * cfg.hidden_size)
    kv_dim = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    kv_bytes = 2 * cfg.num_hidden_layers * 2 * kv_dim * 4 * 17
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    flops = 2 * 2 * linear + 2 * cfg.num_hidden_layers * cfg.hidden_size * 17 * 4
    for bw, peak in ((1e9, 1e12), (1e12, 1e6)):
        r = decode.roofline(tiny_base, engine, 2, prompts, new, bw, peak)
        assert r["bytes_per_step"] == pytest.approx(weight_bytes + kv_bytes)
        assert r["flops_per_step"] == pytest.approx(flops)
        t_mem, t_mm = (weight_bytes + kv_bytes) / bw, flops / peak
        assert r["bound"] == ("memory" if t_mem >= t_mm else "matmul")
        assert r["roofline_tok_s"] == pytest.approx(2 / max(t_mem, t_mm))
        assert r["step_matmul_s"]["best_s"] > 0  # the per-shape figure stays as a diagnostic


def _result():
    row = lambda eng, hf: {  # noqa: E731
        "hf": {"decode_tok_s": hf, "ttft_s": 0.1},
        "engine": {"decode_tok_s": eng, "ttft_s": 0.05},
        "speedup": eng / hf,
        "roofline": {"roofline_tok_s": 100.0, "bound": "memory"},
        "roofline_fraction": eng / 100,
        "hf_roofline_fraction": hf / 100,
        "bandwidth_fraction": 0.5,
    }
    return {
        "model": "m",
        "dtype": "float32",
        "device": "cpu",
        "threads": 2,
        "decode_mode": "static",
        "new_tokens": 8,
        "bandwidth_GBps": 30.0,
        "peak_matmul_GFLOPs_per_s": 100.0,
        "load_average": {"before": 1.0, "after": 1.0},
        "batches": {"1": row(30.0, 15.0), "4": row(200.0, 100.0)},
    }


def test_llamacpp_rows_and_ratios(monkeypatch):
    calls = []

    def llama_bench(build, gguf, p_len, new, threads, repeats, log):
        calls.append(("llama-bench", p_len, new, threads, repeats))
        return {"decode_tok_s": 70.0, "prefill_tok_s": 700.0, "commands": ["lb"]}

    def batched(build, gguf, p_len, new, batch, threads, repeats, log):
        calls.append(("llama-batched-bench", p_len, new, batch, threads, repeats))
        return {
            "decode_tok_s": {1: 60.0, 4: 160.0}[batch],
            "prefill_tok_s": {1: 600.0, 4: 900.0}[batch],
            "commands": [f"b{batch}"],
        }

    monkeypatch.setattr(lc, "bench_llama_bench", llama_bench)
    monkeypatch.setattr(lc, "bench_batched", batched)
    monkeypatch.setattr(
        lc,
        "greedy_tokens",
        lambda build, gguf, prompts, n, threads, log: [[1, 2, 3], [4, 5, 0], [7, 8, 9], [1, 1, 1]],
    )
    build = lc.LlamaCpp(root=lc.llamacpp_dir("9.9"), version="9.9", build_info={"ggml_version": "0.25.3"})
    result = _result()
    prompts = {1: [[1] * 7], 4: [[1] * 7, [1] * 8, [1] * 8, [1] * 9]}
    engine_tokens = {1: [[1, 2, 3]], 4: [[1, 2, 3], [4, 5, 6], [7, 8, 9], [2, 1, 1]]}
    block = decode.run_llamacpp(
        build,
        "w.gguf",
        _args(threads=2, repeats=3, new_tokens=3, llamacpp_compare=3),
        prompts,
        engine_tokens,
        result,
    )
    assert calls == [
        ("llama-batched-bench", 7, 3, 1, 2, 3),
        ("llama-bench", 7, 3, 2, 3),
        ("llama-batched-bench", 8, 3, 4, 2, 3),
    ]
    assert result["llamacpp_ratio_batch1"] == 30.0 / 60.0 and result["llamacpp_ratio_batch4"] == 200.0 / 160.0
    assert result["batches"]["4"]["llamacpp"] == {
        "decode_tok_s": 160.0,
        "prefill_tok_s": 900.0,
        "ratio": 1.25,
    }
    assert result["batches"]["1"]["llamacpp"]["llama_bench_decode_tok_s"] == 70.0
    g = block["greedy"]["vs_engine"]
    assert (
        block["greedy"]["batch"] == 4
        and g["rows_equal"] == 0.5
        and g["leading_share"] == (3 + 2 + 3 + 0) / 12
    )
    assert block["version"] == "9.9" and block["threads"] == 2 and block["batches"]["1"]["prompt_tokens"] == 7
    result["llamacpp"] = block
    text = decode.table(result)
    assert "| llama.cpp tok/s | engine / llama.cpp | llama.cpp prefill tok/s |" in text
    assert "| 4 | 100.0 | 200.0 | 160.0 | 1.25x | 900.0 | 2.00x |" in text
    assert "67% leading tokens equal, 50% rows equal" in text and "(f16 KV, its default): 70.0 tok/s" in text


def test_table_without_llamacpp_has_no_llamacpp_columns():
    text = decode.table(_result())
    assert (
        "llama.cpp" not in text
        and "| 1 | 15.0 | 30.0 | 2.00x | 100 | 50 | 100.0 (memory) | 30% | 15% | 50% |" in text
    )


def test_llamacpp_without_cmake_fails_before_loading_anything(monkeypatch, tmp_path):
    """``ccft bench decode --llamacpp`` on a PATH without cmake (and no build in the cache): the error names
    cmake and the install command; no model is loaded."""
    monkeypatch.setenv("CCFT_CACHE", str(tmp_path / "cache"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("cc", "c++", "ninja"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(
        decode, "load", lambda *a, **k: pytest.fail("loaded a model before checking the toolchain")
    )
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(
        lc.LlamaCppError, match=r"needs cmake, not found on PATH; install cmake .*apt-get install cmake"
    ):
        decode.run(_args(llamacpp=True, device="cpu", model=str(tmp_path / "model")))
    assert not (tmp_path / "cache" / "llama.cpp").exists()  # nothing downloaded or created


def test_profile_step_attributes_the_step_to_op_categories(tiny_base):
    """--profile: a decode step's time is split over op categories; the linears are found, and the
    categories plus host time add up to the profiled step."""
    from ccft.inference import SharedPrefillEngine

    engine = SharedPrefillEngine(tiny_base, max_batch=4, max_tail_tokens=64)
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7], [9, 8, 7, 6], [4, 4, 4, 4, 4, 4]]
    prof = decode.profile_step(engine, prompts, steps=4)
    assert prof["batch"] == 4 and prof["steps"] == 4
    ms = prof["ms_per_step"]
    linear = ms.get("linear (oneDNN packed)", 0.0) + ms.get("linear (aten)", 0.0)
    assert linear > 0.0
    assert sum(ms.values()) == pytest.approx(prof["profiled_step_ms"], rel=1e-6)
    assert prof["top_ops"] and all(o["ms_per_step"] >= 0 for o in prof["top_ops"])
    assert engine.active == 0  # the profiled rows were ended
    # an op name is put in its category by prefix; unknown ops fall to "other"
    assert decode._profile_group("aten::bmm") == "attention matmul"
    assert decode._profile_group("aten::rsqrt") == "elementwise / norms / RoPE / other ops"
    assert decode._profile_group("mkldnn::_linear_pointwise") == "linear (oneDNN packed)"


def test_blocks_beside_fp32_engine(tmp_path, tokenizer, monkeypatch):
    """``--blocks`` on a tiny block-quantised model: the block engine's row, its ratio to the fp32 engine,
    equal greedy rows, fewer weight bytes; with llama.cpp (stubbed) the Q4_1 ratio is the block engine's."""
    from ccft.inference.blocks import load_kernel
    from conftest import make_block_folder

    if load_kernel() is None:
        pytest.skip("no C++ compiler builds the block kernel here")
    folder = make_block_folder(tmp_path, tokenizer)
    result = decode.run(
        _args(model=str(folder), device="cpu", blocks=True, batch_sizes=[1, 3], new_tokens=4, repeats=1)
    )
    assert result["block_weights"]["gguf"] == "model.gguf"
    for b in ("1", "3"):
        row = result["batches"][b]["engine_blocks"]
        assert row["greedy_rows_equal_fp32"] == 1.0 and result[f"blocks_greedy_rows_equal_batch{b}"] == 1.0
        assert (
            result[f"blocks_speedup_batch{b}"]
            == row["decode_tok_s"] / result["batches"][b]["engine"]["decode_tok_s"]
        )
        assert row["bytes_per_step"] < result["batches"][b]["roofline"]["bytes_per_step"]
        bw = result["bandwidth_GBps"] * 1e9
        frac = row["bytes_per_step"] * row["decode_tok_s"] / int(b) / bw
        assert result[f"blocks_bandwidth_fraction_batch{b}"] == row["bandwidth_fraction"]
        assert row["bandwidth_fraction"] == pytest.approx(frac)
    mem = result["engine_memory"]
    # Q4_1 projections (20 bytes per 32 weights) and a Q8_0 LM head (34 per 32) instead of fp32 (128 per 32)
    assert mem["blocks_linear_bytes_per_step"] * 3 < mem["fp32_linear_bytes_per_step"]
    assert 0 < mem["blocks_engine_extra_bytes"] < mem["fp32_engine_extra_bytes"]
    text = decode.table(result)
    assert "| engine blocks tok/s | blocks / fp32 | blocks rows = fp32 | blocks / bandwidth |" in text
    assert "100% |" in text

    monkeypatch.setattr(
        lc, "bench_batched", lambda *a, **k: {"decode_tok_s": 10.0, "prefill_tok_s": 100.0, "commands": []}
    )
    monkeypatch.setattr(lc, "bench_llama_bench", lambda *a, **k: {"decode_tok_s": 12.0, "commands": []})
    monkeypatch.setattr(
        lc, "greedy_tokens", lambda build, gguf, prompts, n, threads, log: [[0]] * len(prompts)
    )
    build = lc.LlamaCpp(root=lc.llamacpp_dir("9.9"), version="9.9", build_info={})
    prompts = {1: [[1] * 7], 3: [[1] * 7] * 3}
    tokens = {b: [[0]] * b for b in (1, 3)}
    args = _args(threads=2, repeats=1, new_tokens=4, llamacpp_compare=1)
    decode.run_llamacpp(
        build, "q.gguf", args, prompts, tokens, result, engine_key="engine_blocks", row_key="llamacpp_q4_1"
    )
    blk = result["batches"]["3"]["engine_blocks"]["decode_tok_s"]
    assert result["llamacpp_q4_1_ratio_batch3"] == blk / 10.0 and "llamacpp_ratio_batch3" not in result


def _run_blocks_with_stub_llamacpp(monkeypatch, folder, batched, f32_gguf):
    """``ccft bench decode --blocks --llamacpp`` on ``folder`` (batch 2, 3 tokens, 1 repeat) with llama.cpp
    stubbed: ``batched`` stands for llama-batched-bench, ``f32_gguf(build)`` is the converted F32 file."""
    build = lc.LlamaCpp(root=lc.llamacpp_dir("9.9"), version="9.9", build_info={})
    monkeypatch.setattr(lc, "ensure_built", lambda log: build)
    monkeypatch.setattr(lc, "convert_to_gguf", lambda build, path, fingerprint, log: f32_gguf(build))
    monkeypatch.setattr(lc, "bench_batched", batched)
    monkeypatch.setattr(lc, "bench_llama_bench", lambda *a, **k: {"decode_tok_s": 12.0, "commands": []})
    monkeypatch.setattr(
        lc, "greedy_tokens", lambda build, gguf, prompts, n, threads, log: [[0]] * len(prompts)
    )
    args = _args(model=str(folder), device="cpu", blocks=True, llamacpp=True, batch_sizes=[2])
    return decode.run(_args(**{**vars(args), "new_tokens": 3, "repeats": 1}))


def test_llamacpp_failing_on_the_block_gguf_keeps_the_run(tmp_path, tokenizer, monkeypatch):
    """llama.cpp crashing on the blocks' GGUF (as the pinned build did on the embedded Q4_1 file on the Intel
    Xeon, before the AMX flags) leaves that comparison out with its error; the fp32 comparison and the block
    engine's rows stay."""
    from ccft.inference.blocks import load_kernel
    from conftest import make_block_folder

    if load_kernel() is None:
        pytest.skip("no C++ compiler builds the block kernel here")
    folder = make_block_folder(tmp_path, tokenizer)

    def batched(build, gguf, p_len, new, batch, threads, repeats, log):
        if str(gguf).endswith("model.gguf"):
            raise lc.LlamaCppError("command failed (exit -11): llama-batched-bench -m model.gguf")
        return {"decode_tok_s": 10.0, "prefill_tok_s": 100.0, "commands": []}

    result = _run_blocks_with_stub_llamacpp(
        monkeypatch, folder, batched, lambda build: tmp_path / "x.f32.gguf"
    )
    assert result["llamacpp_ratio_batch2"] == result["batches"]["2"]["engine"]["decode_tok_s"] / 10.0
    assert "llamacpp_q4_1" not in result and "llamacpp_q4_1" not in result["batches"]["2"]
    assert not [k for k in result if k.startswith("llamacpp_q4_1_ratio")]
    assert result["llamacpp_q4_1_error"]["gguf"] == "model.gguf"
    assert "exit -11" in result["llamacpp_q4_1_error"]["error"]
    assert "llama.cpp on model.gguf: command failed (exit -11)" in decode.table(result)


def test_llamacpp_on_the_block_gguf_names_it_without_its_folder(tmp_path, tokenizer, monkeypatch):
    """The blocks' GGUF lies outside the cache (the embedded model's file, in the installed package): the
    committed result names it, and the commands run on it, without the machine's folder."""
    from ccft.inference.blocks import load_kernel
    from conftest import make_block_folder

    if load_kernel() is None:
        pytest.skip("no C++ compiler builds the block kernel here")
    folder = make_block_folder(tmp_path, tokenizer)

    def batched(build, gguf, p_len, new, batch, threads, repeats, log):
        return {"decode_tok_s": 10.0, "prefill_tok_s": 100.0, "commands": [f"llama-batched-bench -m {gguf}"]}

    result = _run_blocks_with_stub_llamacpp(
        monkeypatch, folder, batched, lambda build: build.root / "x.f32.gguf"
    )
    q41 = result["llamacpp_q4_1"]
    assert q41["gguf"] == "model.gguf" and q41["batches"]["2"]["commands"] == [
        "llama-batched-bench -m model.gguf"
    ]
    assert result["llamacpp"]["gguf"] == "$CCFT_CACHE/llama.cpp/9.9/x.f32.gguf"
    assert str(tmp_path) not in json.dumps(q41)
    assert (
        result["llamacpp_q4_1_ratio_batch2"] == result["batches"]["2"]["engine_blocks"]["decode_tok_s"] / 10.0
    )


def test_also_decode_runs_a_second_engine_in_the_same_runs(tiny_dir):
    """``--also-decode static --also-pack-weights off``: a second engine (the same static step, weights not
    packed) measured in the same runs; its greedy rows equal the first's and the table names which is
    packed."""
    result = decode.run(
        _args(
            model=str(tiny_dir),
            device="cpu",
            decode="static",
            also_decode="static",
            also_pack_weights="off",
            batch_sizes=[1, 3],
            new_tokens=4,
            repeats=1,
        )
    )
    assert result["pack_weights"] is True and result["also_pack_weights"] is False
    for b in ("1", "3"):
        row = result["batches"][b]["engine_also"]
        assert row["greedy_rows_equal_engine"] == 1.0 and row["decode_tok_s"] > 0
    assert "| engine static unpacked tok/s | static unpacked / static packed |" in decode.table(result)
