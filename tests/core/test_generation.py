"""Reference generation: HF greedy equality, batch-size independence (K7), stop/EOS/length, mode checks,
and save_decoder / load_decoder round trips."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import ccft
from ccft.core.tokens import right_pad, tokenize_prompt, tokenize_response
from conftest import make_tiny_folder

N_NEW = 8
MIN_MARGIN = 1e-3  # top-1 minus top-2 logit on every greedy step: 100x the fp32 tolerance


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer):
    """A tiny model with clear logit margins (lm_head scaled by 30)."""
    return make_tiny_folder(tmp_path_factory.mktemp("sharp"), tokenizer, seed=0, scale=30.0)


@pytest.fixture(scope="module")
def sharp(sharp_dir):
    """Shared across this module's tests that attach no LoRA adapter (full decoders are copies)."""
    return ccft.load_base(str(sharp_dir))


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    """Nine real prompts of different lengths (batch 8 = one full chunk + one row)."""
    return [tokenize_prompt(tokenizer, r["prompt"], chat_template=False) for r in gsm8k_rows[:9]]


def _min_margin(model, prompt, new_ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + new_ids])).logits[
            0, len(prompt) - 1 : len(prompt) - 1 + len(new_ids)
        ]
    top = logits.topk(2, dim=-1).values
    assert logits.argmax(-1).tolist() == new_ids
    return (top[:, 0] - top[:, 1]).min().item()


def _hf_greedy(model, prompt, eos, pad, n=N_NEW):
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    return out[0, len(prompt) :].tolist()


def test_base_mode_equals_hf_generate(sharp, prompts):
    tok = sharp.tokenizer
    for p in prompts[:5]:
        hf = _hf_greedy(sharp.model, p, tok.eos_token_id, tok.pad_token_id)
        (ours,) = ccft.generate([p], mode="base", base=sharp, max_new_tokens=N_NEW, batch_size=1)
        assert tok.eos_token_id not in hf, "the sharp model is expected to run to max_new_tokens here"
        assert ours.token_ids == hf
        assert ours.finish_reason == "length" and ours.truncated
        assert ours.text == tok.decode(hf, skip_special_tokens=True)
        assert _min_margin(sharp.model, p, hf) > MIN_MARGIN


def test_batch_size_does_not_change_greedy_output(sharp, prompts):
    """K7: batch size 1 and 8 (left padding, chunking, length sorting) give identical greedy results."""
    tok = sharp.tokenizer
    decoder = ccft.make_decoder(sharp, "full", method="ccft")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in decoder.model.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    cache = ccft.compute_base_cache(sharp, prompts)
    snapshot = cache.clone()
    for mode, kw in (
        ("base", {"base": sharp}),
        ("prefillshare", {"decoder": decoder, "cache": cache}),
        ("prefillshare", {"decoder": decoder}),
    ):
        one = ccft.generate(prompts, mode=mode, max_new_tokens=N_NEW, batch_size=1, **kw)
        eight = ccft.generate(prompts, mode=mode, max_new_tokens=N_NEW, batch_size=8, **kw)
        assert [(x.token_ids, x.text, x.finish_reason) for x in one] == [
            (x.token_ids, x.text, x.finish_reason) for x in eight
        ], mode
        assert all(len(x.token_ids) == N_NEW for x in one)
        if (
            mode == "prefillshare"
        ):  # each row follows the teacher-forced argmax on C_base, with a clear margin
            tails = [p[-1:] + x.token_ids for p, x in zip(prompts, one, strict=True)]
            ids, mask = right_pad(tails, tok.pad_token_id)
            with torch.no_grad():
                logits = ccft.decoder_forward(decoder, snapshot, ids, mask)[:, :N_NEW]
            top = logits.topk(2, dim=-1).values
            assert logits.argmax(-1).tolist() == [x.token_ids for x in one]
            assert (top[..., 0] - top[..., 1]).min().item() > MIN_MARGIN
    assert cache.equal(snapshot)


def test_stop_strings_cut_text_per_row(sharp, prompts):
    tok = sharp.tokenizer
    rows = prompts[:3]
    free = ccft.generate(rows, mode="base", base=sharp, max_new_tokens=N_NEW)
    text0 = free[0].text
    # a stop string that first appears in row 0's text after a few tokens, and in no other row
    start = len(tok.decode(free[0].token_ids[:3], skip_special_tokens=True))
    stop = text0[start : start + 3]
    assert len(stop) == 3 and stop.strip() and all(stop not in f.text for f in free[1:])
    cut = text0.find(stop)
    for stops in (stop, [stop], ["never-appears-xyz", stop]):
        got = ccft.generate(rows, mode="base", base=sharp, max_new_tokens=N_NEW, stop=stops)
        assert got[0].finish_reason == "stop" and not got[0].truncated
        assert got[0].text == text0[:cut] and stop not in got[0].text
        n = len(got[0].token_ids)
        assert got[0].token_ids == free[0].token_ids[:n] and n < N_NEW
        assert stop in tok.decode(got[0].token_ids, skip_special_tokens=True)  # the last token completed it
        assert stop not in tok.decode(got[0].token_ids[:-1], skip_special_tokens=True)
        for f, g in zip(free[1:], got[1:], strict=True):  # other rows run on, unaffected
            assert (g.token_ids, g.text, g.finish_reason) == (f.token_ids, f.text, "length")
    nothing = ccft.generate(
        rows, mode="base", base=sharp, max_new_tokens=N_NEW, stop=["never-appears-xyz", ""]
    )
    assert [(g.token_ids, g.finish_reason) for g in nothing] == [(f.token_ids, "length") for f in free]


def test_max_new_tokens_sets_length(sharp, prompts):
    for n in (1, 3):
        got = ccft.generate(prompts[:2], mode="base", base=sharp, max_new_tokens=n)
        assert all(g.finish_reason == "length" and g.truncated and len(g.token_ids) == n for g in got)


def test_eos_stops_a_row(sharp_dir, sharp, prompts, tmp_path):
    """A model that emits the real EOS id: our generate == HF generate, finish_reason 'eos', EOS not in the
    ids."""
    tok = sharp.tokenizer
    prompts = prompts[:5]
    free = ccft.generate(prompts, mode="base", base=sharp, max_new_tokens=N_NEW, batch_size=3)
    target = free[0].token_ids[3]  # make EOS win wherever this token would have been chosen
    model = AutoModelForCausalLM.from_pretrained(sharp_dir)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 1.5 * model.lm_head.weight[target]
    model.save_pretrained(tmp_path / "eos")
    tok.save_pretrained(tmp_path / "eos")
    base = ccft.load_base(str(tmp_path / "eos"))
    got = ccft.generate(prompts, mode="base", base=base, max_new_tokens=N_NEW, batch_size=3)
    reasons = []
    for p, g in zip(prompts, got, strict=True):
        hf = _hf_greedy(base.model, p, tok.eos_token_id, tok.pad_token_id)
        if hf and hf[-1] == tok.eos_token_id:
            assert g.finish_reason == "eos" and not g.truncated
            assert g.token_ids == hf[:-1]
        else:
            assert g.finish_reason == "length" and g.token_ids == hf
        assert tok.eos_token_id not in g.token_ids
        reasons.append(g.finish_reason)
    assert reasons[0] == "eos" and got[0].token_ids == free[0].token_ids[:3]
    assert "length" in reasons, "rows that did not stop must keep decoding after another row hit EOS"


def test_mode_method_mismatch_raises_config_error(sharp, prompts):
    full_ft = ccft.make_decoder(sharp, "full", method="full-ft")
    ccft_dec = ccft.make_decoder(sharp, "full", method="ccft")
    with pytest.raises(
        ccft.ConfigError, match=r"mode='prefillshare' needs a decoder trained with method='ccft'"
    ):
        ccft.generate(prompts[:1], mode="prefillshare", decoder=full_ft, max_new_tokens=1)
    with pytest.raises(ccft.ConfigError, match=r"mode='naive' needs a decoder trained with method='full-ft'"):
        ccft.generate(prompts[:1], mode="naive", decoder=ccft_dec, max_new_tokens=1)
    with pytest.raises(
        ccft.ConfigError, match=r"mode='full-ft' needs a decoder trained with method='full-ft'"
    ):
        ccft.generate(prompts[:1], mode="full-ft", decoder=ccft_dec, max_new_tokens=1)
    with pytest.raises(
        ccft.ConfigError, match=r"mode='bogus'; use one of base, full-ft, naive, prefillshare"
    ):
        ccft.generate(prompts[:1], mode="bogus", base=sharp, max_new_tokens=1)
    with pytest.raises(ccft.ConfigError, match="needs a decoder"):
        ccft.generate(prompts[:1], mode="prefillshare", base=sharp, max_new_tokens=1)
    # the matching pairs run
    assert ccft.generate(prompts[:1], mode="naive", decoder=full_ft, max_new_tokens=1)[0].token_ids
    assert ccft.generate(prompts[:1], mode="full-ft", decoder=full_ft, max_new_tokens=1)[0].token_ids
    assert ccft.generate(prompts[:1], mode="prefillshare", decoder=ccft_dec, max_new_tokens=1)[0].token_ids


def _decoder_logits(decoder, base, k):
    tok = base.tokenizer
    prompts = [
        tokenize_prompt(tok, p) for p in ("What is 12 + 30?", "Spell the word 'cat' backwards, then stop.")
    ]
    responses = [tokenize_response(tok, r) for r in ("12 + 30 = 42\n#### 42", "tac")]
    cache = ccft.compute_base_cache(base, prompts, handoff_tokens=k)
    ids, mask = right_pad([p[-k:] + r for p, r in zip(prompts, responses, strict=True)], tok.pad_token_id)
    with torch.no_grad():
        return ccft.decoder_forward(decoder, cache, ids, mask), prompts


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_save_load_round_trip(tiny_dir, tmp_path, kind):
    base = ccft.load_base(str(tiny_dir))
    k = 2
    if kind == "lora":
        decoder = ccft.make_decoder(
            base, "lora", lora={"init_lora_weights": False, "r": 4}, method="ccft", handoff_tokens=k
        )
    else:
        decoder = ccft.make_decoder(base, "full", method="ccft", handoff_tokens=k)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in decoder.model.named_parameters():
                if name.endswith("proj.weight"):
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
    before, prompts = _decoder_logits(decoder, base, k)
    with torch.no_grad(), base.base_weights() as m:
        plain, _ = _decoder_logits(m, base, k)
    assert (before - plain).abs().max() > 1e-3, (
        "the decoder must differ from the base for a meaningful round trip"
    )
    gen_before = ccft.generate(prompts, mode="prefillshare", decoder=decoder, max_new_tokens=4)

    path = ccft.save_decoder(decoder, tmp_path / f"math_{kind}", recipe="test")
    meta = json.loads((path / "ccft.json").read_text())
    assert meta["method"] == "ccft" and meta["decoder_kind"] == kind
    assert meta["base_fingerprint"] == base.fingerprint == meta["base"]["fingerprint"]
    assert meta["handoff_tokens"] == k and meta["recipe"] == "test" and meta["dtype"] == "float32"
    assert (path / ("adapter_config.json" if kind == "lora" else "config.json")).is_file()
    assert (path / "tokenizer.json").is_file()

    # onto the same base object (second adapter on the shared host) and onto a freshly loaded base
    for target in (base, ccft.load_base(str(tiny_dir))):
        loaded = ccft.load_decoder(path, base=target)
        assert (loaded.kind, loaded.method, loaded.handoff_tokens) == (kind, "ccft", k)
        assert loaded.fingerprint == base.fingerprint
        after, _ = _decoder_logits(loaded, target, k)
        assert (after - before).abs().max().item() <= 1e-6
        gen_after = ccft.generate(prompts, mode="prefillshare", decoder=loaded, max_new_tokens=4)
        assert [g.token_ids for g in gen_after] == [g.token_ids for g in gen_before]
    again, _ = _decoder_logits(decoder, base, k)  # the original still decodes as itself
    assert torch.equal(again, before)


def test_load_decoder_rejects_non_decoder_folder(tiny_dir, tiny_base):
    with pytest.raises(ccft.ConfigError, match="ccft.json missing"):
        ccft.load_decoder(tiny_dir, base=tiny_base)
