"""``ccft export --to merged``: a plain transformers folder that still loads as a ccft decoder.

A full-weight Full-FT decoder: ``AutoModelForCausalLM.from_pretrained(OUT)`` over prompt + response gives
ccft's full-ft logits (own prefill). A CCFT LoRA decoder merged (``merge_and_unload`` on a private base):
``ccft.load_decoder(OUT)`` is a full-weight decoder whose prefillshare logits equal the LoRA decoder's
(to fp32 rounding of the folded weights: 1e-5 relative to the logits' scale).
"""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard

import ccft
from ccft.core.tokens import tokenize_prompt, tokenize_response
from ccft.train.export import export_decoder
from conftest import make_full, make_lora, make_tiny_folder

TOL = 1e-5


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer):
    return make_tiny_folder(tmp_path_factory.mktemp("sharp_merged"), tokenizer, seed=0, scale=30.0)


@pytest.fixture(scope="module")
def row(tokenizer, gsm8k_rows):
    return (
        tokenize_prompt(tokenizer, gsm8k_rows[2]["prompt"], chat_template=True),
        tokenize_response(tokenizer, gsm8k_rows[2]["response"]),
    )


def test_full_ft_decoder_merged_is_a_plain_model_with_full_ft_logits(sharp_dir, tmp_path, row):
    from transformers import AutoModelForCausalLM

    base = ccft.load_base(str(sharp_dir))
    dec = make_full(base, seed=2, handoff=1, method="full-ft")
    ccft.save_decoder(dec, tmp_path / "dec", recipe={"chat_template": "true"})
    res = export_decoder(tmp_path / "dec", "merged", tmp_path / "merged")
    assert res.target == "merged" and res.out == tmp_path / "merged"
    prompt, response = row
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = plain(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) :]
        ours = ccft.full_forward(
            dec,
            torch.tensor([prompt]),
            torch.ones(1, len(prompt), dtype=torch.long),
            torch.tensor([response]),
        )[0]
        untouched = base.model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) :]
    assert (ours - theirs).abs().max().item() <= TOL
    assert (ours - untouched).abs().max().item() > 1e-2  # the decoder differs from its base
    meta = json.loads((tmp_path / "merged" / "ccft.json").read_text())
    assert meta["method"] == "full-ft" and meta["decoder_kind"] == "full" and meta["handoff_tokens"] == 1
    assert meta["base_fingerprint"] == base.fingerprint and meta["exported_from"]["target"] == "merged"
    again = ccft.load_decoder(tmp_path / "merged", base=base)
    assert again.kind == "full" and again.method == "full-ft"
    card = ModelCard.load(tmp_path / "merged" / "README.md")
    assert card.data.library_name == "transformers" and "method-full-ft" in card.data.tags


def test_lora_ccft_decoder_merged_keeps_prefillshare_logits(sharp_dir, tmp_path, row):
    base = ccft.load_base(str(sharp_dir))
    dec = make_lora(base, "default", seed=4, r=4, handoff=4)
    ccft.save_decoder(dec, tmp_path / "dec", recipe={"chat_template": "true"})
    export_decoder(tmp_path / "dec", "merged", tmp_path / "merged")
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    prompt, response = row
    cache = ccft.compute_base_cache(base, [prompt], handoff_tokens=4)
    tail = torch.tensor([prompt[-4:] + response])
    fresh = ccft.load_base(str(sharp_dir))
    merged = ccft.load_decoder(tmp_path / "merged", base=fresh)
    assert merged.kind == "full" and merged.method == "ccft" and merged.handoff_tokens == 4
    with torch.no_grad():
        ours = ccft.decoder_forward(dec, cache, tail)[0]
        theirs = ccft.decoder_forward(
            merged, ccft.compute_base_cache(fresh, [prompt], handoff_tokens=4), tail
        )[0]
        with dec.model.disable_adapter():
            plain = ccft.decoder_forward(dec.model, cache, tail, fingerprint=base.fingerprint)[0]
    # W + s·BA folded into one matrix rounds differently from W x + s·B(A x) in fp32: equal to within
    # 1e-5 of the logits' scale (here ~4e-5 absolute on logits up to ~30), with the same argmax everywhere.
    assert (ours - theirs).abs().max().item() <= TOL * ours.abs().max().item()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - plain).abs().max().item() > 1e-2  # the adapter matters
    # The caller's base was not merged into: the LoRA decoder on it still computes the same logits.
    with torch.no_grad():
        assert torch.equal(ccft.decoder_forward(dec, cache, tail)[0], ours)
    card = ModelCard.load(tmp_path / "merged" / "README.md")
    assert card.data.library_name == "transformers" and "method-ccft" in card.data.tags
