"""`ccft bench train`: the corrected FLOP model, the reachable speedup and the memory keys (tiny smoke
run)."""

from __future__ import annotations

import json

import pytest
import torch

from ccft.bench.train import reachable_speedup, step_flops


def test_step_flops_counts_the_lm_head_on_the_response_for_both_methods():
    body, head, p, r = 10, 5, 3, 2
    # full weights: prompt 6 (Full-FT) vs 2 (no-grad prefill); tail 6; LM head 4 (frozen) / 6 (trained) per
    # response token
    assert step_flops("full", "self-prefill", p, r, body, head, False) == 6 * 10 * 5 + 4 * 5 * 2
    assert step_flops("full", "two-pass", p, r, body, head, False) == 2 * 10 * 3 + 6 * 10 * 2 + 4 * 5 * 2
    assert step_flops("full", "two-pass", p, r, body, head, True) == 2 * 10 * 3 + 6 * 10 * 2 + 6 * 5 * 2
    # LoRA: activation-only backward (4); one-pass costs what Full-FT costs
    assert step_flops("lora", "two-pass", p, r, body, head, False) == 2 * 10 * 3 + 4 * 10 * 2 + 4 * 5 * 2
    assert (
        step_flops("lora", "one-pass", p, r, body, head, False)
        == step_flops("lora", "self-prefill", p, r, body, head, False)
        == 4 * 10 * 5 + 40
    )
    # no LM head and no optimizer: the plain formula's ratio
    assert step_flops("full", "self-prefill", 48, 48, 1, 0, False) / step_flops(
        "full", "two-pass", 48, 48, 1, 0, False
    ) == pytest.approx(1.5)


def test_reachable_speedup_keeps_the_optimizer_update_common():
    # Full-FT 10 s of which 2 s optimizer; CCFT does half the matrix work and the same 2 s update:
    # 10 / (4 + 2)
    assert reachable_speedup(10.0, 2.0, 2.0, 0.5) == pytest.approx(10 / 6)
    assert reachable_speedup(10.0, 0.0, 0.0, 0.5) == pytest.approx(2.0)  # no optimizer cost: the FLOP ratio


def test_bench_train_reports_reachable_fraction_and_peak_memory(tmp_path, tiny_dir, capsys):
    from ccft.cli.main import main

    out = tmp_path / "train.json"
    before = torch.get_num_threads()
    try:
        assert (
            main(
                [
                    "bench",
                    "train",
                    "--model",
                    str(tiny_dir),
                    "--kinds",
                    "full",
                    "lora",
                    "--ratios",
                    "4:1",
                    "--row-tokens",
                    "20",
                    "--batch-size",
                    "2",
                    "--steps",
                    "1",
                    "--warmup",
                    "0",
                    "--threads",
                    "1",
                    "--no-trl",
                    "--in-process",
                    "--loss-chunk-tokens",
                    "3",
                    "--repeats",
                    "2",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(before)
    result = json.loads(out.read_text())
    assert result["loss_chunk_tokens"] == 3 and result["freeze_embeddings"] is True and result["repeats"] == 2
    assert f"({torch.backends.cpu.get_cpu_capability()})" in result["machine"]["hardware"]  # e.g. "(AVX2)"
    assert all(r["repeats"] == 2 for c in result["cases"] for r in c["runs"].values())
    cases = {c["decoder"]: c for c in result["cases"]}
    for kind, case in cases.items():
        full, default = case["runs"]["ccft-full-ft"], case["default_path"]
        ccft = case["runs"][f"ccft-{default}"]
        assert full["loss_path"] == ccft["loss_path"] == "chunked"
        assert full["head_trains"] is (kind == "full")  # the tiny model is untied: its LM head trains
        assert 0 < full["params_head"] < full["params_body"] + full["params_head"]
        p, r = case["prompt_tokens"], case["response_tokens"]
        split = (full["params_body"], full["params_head"], full["head_trains"])
        ratio = step_flops(kind, default, p, r, *split) / step_flops(kind, "self-prefill", p, r, *split)
        want = full["cpu_s"] / ((full["cpu_s"] - full["opt_cpu_s"]) * ratio + ccft["opt_cpu_s"])
        assert case["reachable_speedup"][default] == pytest.approx(want, rel=1e-12)
        assert case["fraction_of_reachable"] == pytest.approx(case["ccft_speedup"][default] / want, rel=1e-12)
        assert 0 < ccft["opt_cpu_s"] < ccft["cpu_s"] and ccft["peak_rss_mb_rusage"] > 0
        assert result["peak_rss_mb"][f"{kind} 4:1"]["ccft-full-ft"] == full["peak_rss_mb_rusage"]
    assert result["fraction_of_reachable"] == min(c["fraction_of_reachable"] for c in cases.values())
    assert result["fullft_vs_trl"] is None and result["fullft_peak_vs_trl"] is None  # --no-trl
    assert "fraction of reachable" in capsys.readouterr().out


def test_repeated_runs_are_reported_as_medians_with_every_value_kept():
    from ccft.bench.train import median_runs

    runs = [
        {"method": "trl-sft", "step_s": 1.0, "peak_rss_mb_rusage": 2600.0, "steps": 4, "head_trains": False},
        {"method": "trl-sft", "step_s": 3.0, "peak_rss_mb_rusage": 3300.0, "steps": 4, "head_trains": False},
        {"method": "trl-sft", "step_s": 2.0, "peak_rss_mb_rusage": 2700.0, "steps": 4, "head_trains": False},
    ]
    m = median_runs(runs)
    assert (m["step_s"], m["peak_rss_mb_rusage"], m["steps"], m["method"]) == (2.0, 2700.0, 4, "trl-sft")
    assert m["repeats"] == 3 and m["all"] == {
        "step_s": [1.0, 3.0, 2.0],
        "peak_rss_mb_rusage": [2600.0, 3300.0, 2700.0],
    }
    assert m["head_trains"] is False  # booleans are not averaged
    assert median_runs(runs[:1]) == runs[0] and "repeats" not in median_runs(runs[:1])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bench_train_runs_ccft_and_trl_with_the_same_activation_checkpointing(
    tmp_path, tiny_dir, checkpointing
):
    # TRL's SFTConfig turns activation checkpointing and bf16 autocast on by default, ccft's TrainConfig
    # leaves both off: the bench states them for both, or ccft's fp32 peak memory and speed would be compared
    # with a bf16 trainer that recomputes its activations
    from ccft.cli.main import main

    out = tmp_path / "train.json"
    before = torch.get_num_threads()
    try:
        assert (
            main(
                [
                    "bench",
                    "train",
                    "--model",
                    str(tiny_dir),
                    "--kinds",
                    "lora",
                    "--ratios",
                    "1:1",
                    "--row-tokens",
                    "12",
                    "--batch-size",
                    "2",
                    "--steps",
                    "1",
                    "--warmup",
                    "0",
                    "--threads",
                    "1",
                    "--in-process",
                    "--out",
                    str(out),
                ]
                + (["--activation-checkpointing"] if checkpointing else [])
            )
            == 0
        )
    finally:
        torch.set_num_threads(before)
    result = json.loads(out.read_text())
    assert result["activation_checkpointing"] is checkpointing
    runs = result["cases"][0]["runs"]
    assert "trl-sft" in runs and len(runs) >= 3
    assert {m: r["activation_checkpointing"] for m, r in runs.items()} == {m: checkpointing for m in runs}
    assert {r["mixed_precision"] for r in runs.values()} == {
        "no"
    }  # TRL's SFTConfig defaults to bf16 autocast
    # anonymous memory is part of the resident set and grows while training
    for r in runs.values():
        assert 0 < r["setup_anon_mb"] <= r["peak_anon_mb"] <= r["peak_rss_mb"]
    case = result["cases"][0]
    full, trl = runs["ccft-full-ft"], runs["trl-sft"]
    assert case["fullft_anon_peak_vs_trl"] == pytest.approx(
        full["peak_anon_mb"] / trl["peak_anon_mb"], rel=1e-12
    )
    assert result["fullft_anon_peak_vs_trl"] == case["fullft_anon_peak_vs_trl"]


def test_anonymous_memory_leaves_out_file_pages_that_were_only_read(tmp_path):
    # a frozen base's weights are memory-mapped from safetensors and only read: resident, but not anonymous
    # memory
    import mmap

    from ccft.bench.train import RSSPeak

    path = tmp_path / "weights.bin"
    size = 64 * 2**20
    path.write_bytes(b"\x01" * size)
    meter = RSSPeak()
    rss0, anon0 = meter.rss(), meter.rss_anon()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert sum(mm[i] for i in range(0, size, 4096)) == size // 4096  # every page read
        rss1, anon1 = meter.rss(), meter.rss_anon()
    assert rss1 - rss0 >= 48 * 2**20
    assert anon1 - anon0 < 16 * 2**20
    with mmap.mmap(
        -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    ) as anon:  # written: anonymous (fresh pages)
        for i in range(0, size, 4096):
            anon[i] = 2
        assert meter.rss_anon() - anon1 >= 48 * 2**20
