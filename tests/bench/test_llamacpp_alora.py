"""``ccft export --to gguf-alora``: a CCFT decoder inside llama-server.

Fast: llama-server's aLoRA boundary restated (``llamacpp_adapter_start``) starts the adapter at ccft's
handoff with the GGUF's invocation tokens and one token earlier with PEFT's (the shift the export
corrects), and every refusal comes before anything is built. Slow (a real llama.cpp build, the tiny
test Llama): the exported adapter served by llama-server gives ccft's prefillshare log-probabilities
(top 10 per generated token, fp32 tolerance) and greedy tokens, a naive conversion of the PEFT export
(invocation = the k handoff ids) does not, and a base → aLoRA and aLoRA → aLoRA request on one prompt
computes only the k handoff tokens again.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ccft
from ccft.bench import llamacpp as lc
from ccft.bench.llamacpp_alora import (
    export_gguf_alora,
    gguf_invocation_tokens,
    llamacpp_adapter_start,
    lora_field,
)
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_prompt
from conftest import make_lora, make_tiny_folder

PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Write a function that reverses a list.",
    "What is 17 + 25?",
)


def test_gguf_invocation_drops_the_first_handoff_token():
    assert gguf_invocation_tokens([1, 9198, 520, 198]) == [9198, 520, 198]
    with pytest.raises(ConfigError, match=r"handoff_tokens >= 2"):
        gguf_invocation_tokens([198])


def test_llamacpp_start_is_ccfts_handoff_with_the_gguf_invocation(tokenizer):
    """Chat prompts end with the k=4 generation prompt; llama-server's rule on the GGUF's invocation tokens
    starts the adapter at n - k (ccft's handoff); on PEFT's k ids it would start at n - k - 1."""
    for text in PROMPTS:
        prompt = tokenize_prompt(tokenizer, text, chat_template=True)
        handoff = prompt[-4:]
        assert tokenizer.decode(handoff) == "<|im_start|>assistant\n"
        assert llamacpp_adapter_start(prompt, gguf_invocation_tokens(handoff)) == len(prompt) - 4
        assert llamacpp_adapter_start(prompt, handoff) == len(prompt) - 5  # the one-token shift


def test_llamacpp_start_takes_the_last_occurrence_and_none_when_absent():
    assert llamacpp_adapter_start([5, 7, 8, 1, 7, 8, 2], [7, 8]) == 3  # last occurrence at 4, one before it
    assert llamacpp_adapter_start([7, 8, 1], [7, 8]) == 0
    assert llamacpp_adapter_start([1, 2, 3], [7, 8]) is None
    assert llamacpp_adapter_start([1, 2, 3], []) is None


def test_lora_field_turns_on_one_adapter():
    assert lora_field(1, 3) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]
    assert lora_field(None, 2) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]


def _save(tiny_dir, folder, *, handoff, method="ccft", seed=3):
    base = ccft.load_base(str(tiny_dir))
    dec = make_lora(base, "default", seed, r=4, handoff=handoff, method=method)
    dec.model.eval()
    ccft.save_decoder(dec, folder, recipe={"chat_template": "true"})
    return dec


def _never(*a, **k):
    raise AssertionError(f"nothing may be downloaded or built before the refusal: {a}")


@pytest.mark.parametrize(
    "handoff,method,match", [(1, "ccft", r"handoff_tokens >= 2"), (4, "full-ft", r"method='full-ft'")]
)
def test_refusals_come_before_any_build(tiny_dir, tmp_path, monkeypatch, handoff, method, match):
    monkeypatch.setenv("CCFT_CACHE", str(tmp_path / "cache"))
    _save(tiny_dir, tmp_path / "dec", handoff=handoff, method=method)
    with pytest.raises(ConfigError, match=match):
        export_gguf_alora(tmp_path / "dec", tmp_path / "out", runner=_never, log=lambda m: None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_non_empty_output_folder_is_refused_first(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CCFT_CACHE", str(tmp_path / "cache"))
    _save(tiny_dir, tmp_path / "dec", handoff=4)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        export_gguf_alora(tmp_path / "dec", tmp_path / "out", runner=_never, log=lambda m: None)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_cli_names_the_fix_for_a_one_token_handoff(tiny_dir, tmp_path, monkeypatch, capsys):
    from ccft.cli.main import main

    monkeypatch.setenv("CCFT_CACHE", str(tmp_path / "cache"))
    _save(tiny_dir, tmp_path / "dec", handoff=1)
    rc = main(["export", str(tmp_path / "dec"), "--to", "gguf-alora", str(tmp_path / "out")])
    assert rc == 2
    assert "handoff_tokens >= 2" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------ a real build (slow)


def ccft_logprobs(dec, prompt, response, k=None):
    """ccft prefillshare log-probabilities (handoff ``k``, default the decoder's) of the token after
    prompt + response[:i], for each i: (len(response), V)."""
    k = k or dec.handoff_tokens
    cache = ccft.compute_base_cache(dec.base, [prompt], handoff_tokens=k)
    with torch.no_grad():
        logits = ccft.decoder_forward(dec, cache, torch.tensor([prompt[-k:] + response[:-1]]))[0]
    return torch.log_softmax(logits[k - 1 :].double(), dim=-1)


def logprob_gap(want, top) -> float:
    """Largest |ccft - llama.cpp| over every (step, token) llama.cpp reported."""
    return max(abs(float(want[i, t]) - lp) for i, step in enumerate(top) for t, lp in step.items())


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer):
    """The tiny Llama with clear logit margins (no near-ties for greedy)."""
    return make_tiny_folder(tmp_path_factory.mktemp("sharp_gguf"), tokenizer, seed=0, scale=30.0)


@pytest.mark.slow
def test_gguf_alora_in_llama_server_equals_prefillshare(sharp_dir, tmp_path, tokenizer):
    from ccft.bench.llamacpp_alora import alora_server_args, complete

    build = lc.ensure_built()
    decs = [_save(sharp_dir, tmp_path / f"dec{i}", handoff=4, seed=3 + i) for i in range(2)]
    exports = [export_gguf_alora(tmp_path / f"dec{i}", tmp_path / f"gguf{i}") for i in range(2)]
    meta = json.loads((exports[0].out / "ccft_export.json").read_text())
    assert meta["gguf_alora_invocation_tokens"] == meta["peft_alora_invocation_tokens"][1:]
    # the naive conversion a user would do: llama.cpp's converter on the PEFT export (invocation = k ids)
    naive = tmp_path / "naive.gguf"
    subprocess.run(
        [
            sys.executable,
            str(build.source / "convert_lora_to_gguf.py"),
            "--base",
            str(sharp_dir),
            "--outtype",
            "f32",
            "--outfile",
            str(naive),
            str(exports[0].peft_dir),
        ],
        check=True,
        capture_output=True,
    )
    prompts = [tokenize_prompt(tokenizer, t, chat_template=True) for t in PROMPTS]
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(sharp_dir), dtype=torch.float32).eval()
    n_new, tol = 12, 1e-3  # log-probabilities; llama.cpp's base alone is ~1e-4 from HF's here (-fa off)
    adapters = [e.adapter_gguf for e in exports] + [naive]
    ctx = max(map(len, prompts)) + n_new + 8
    with lc.server(
        build, exports[0].base_gguf, ctx, 2, extra_args=alora_server_args(adapters)
    ) as url:  # -fa off
        for prompt in prompts:
            base = complete(url, prompt, n_new, n_adapters=3, n_probs=10, cache_prompt=False)
            with torch.no_grad():
                hf = plain(torch.tensor([prompt + base["tokens"][:-1]])).logits[0, len(prompt) - 1 :]
            assert logprob_gap(torch.log_softmax(hf.double(), -1), base["top_logprobs"]) < tol
            for i, dec in enumerate(decs):
                got = complete(url, prompt, n_new, adapter_id=i, n_adapters=3, n_probs=10, cache_prompt=False)
                want = ccft_logprobs(dec, prompt, got["tokens"])
                assert got["tokens"] == want.argmax(-1).tolist()  # greedy = ccft's, step by step
                assert logprob_gap(want, got["top_logprobs"]) < tol
                assert got["tokens"] != base["tokens"]  # the adapter is on
            shifted = complete(url, prompt, n_new, adapter_id=2, n_adapters=3, n_probs=10, cache_prompt=False)
            assert (
                logprob_gap(ccft_logprobs(decs[0], prompt, shifted["tokens"]), shifted["top_logprobs"])
                > 100 * tol
            )
            # ... it is ccft's decoder with a handoff one token longer: llama-server's rule, measured
            assert (
                logprob_gap(ccft_logprobs(decs[0], prompt, shifted["tokens"], k=5), shifted["top_logprobs"])
                < tol
            )
            # one prompt cache: base -> aLoRA -> other aLoRA recompute only the k handoff tokens
            complete(url, prompt, n_new, n_adapters=3)
            assert complete(url, prompt, n_new, adapter_id=0, n_adapters=3)["prompt_n"] == 4
            assert complete(url, prompt, n_new, adapter_id=1, n_adapters=3)["prompt_n"] == 4


@pytest.mark.slow
def test_trained_decoder_on_the_embedded_model_in_llama_server(tmp_path, tokenizer, gsm8k_rows):
    """``ccft train`` (the math recipe, handoff_tokens=4, 3 steps) on the embedded SmolLM2-135M, exported with
    ``--to gguf-alora``: llama-server's greedy tokens are ccft prefillshare's on 4 chat prompts x 16 tokens
    and its log-probabilities are within 1e-3 along them; a base then an aLoRA request recomputes k = 4
    tokens. (benchmarks/gguf_alora_equality.py measures 16 prompts x 32 tokens and records the figures.)"""
    from pathlib import Path

    from ccft.bench.llamacpp_alora import alora_server_args, cache_reuse, compare_with_prefillshare
    from ccft.train.config import load_recipe
    from ccft.train.run import run_training

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "math-gsm8k.yaml"
    cfg, _, raw = load_recipe(
        recipe,
        [
            "handoff_tokens=4",
            "train_rows=8",
            "max_steps=3",
            "per_device_train_batch_size=4",
            "gradient_accumulation_steps=1",
            "learning_rate=2e-3",
            "warmup_steps=0",
            "eval_strategy=no",
            "save_strategy=no",
            "logging_steps=1",
            "use_cpu=true",
            "disable_tqdm=true",
            f"output_dir={tmp_path / 'dec'}",
        ],
    )
    run_training(cfg, recipe=raw)
    ex = export_gguf_alora(tmp_path / "dec", tmp_path / "gguf")
    base = ccft.load_base("smollm2-135m-instruct")
    dec = ccft.load_decoder(tmp_path / "dec", base=base)
    prompts = [tokenize_prompt(tokenizer, r["prompt"], chat_template=True) for r in gsm8k_rows[100:104]]
    build = lc.ensure_built()
    ctx = max(map(len, prompts)) + 32
    with lc.server(build, ex.base_gguf, ctx, 2, extra_args=alora_server_args([ex.adapter_gguf])) as url:
        got = compare_with_prefillshare(dec, url, 0, 1, prompts, 16)
        reuse = cache_reuse(url, prompts[0], 1)
    assert got["rows_equal"] == 4, got
    assert got["max_logprob_gap"] < 1e-3, got
    assert reuse == {"prompt_tokens": len(prompts[0]), "base_first": len(prompts[0]), "alora_after_base": 4}
