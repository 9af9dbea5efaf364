"""``ccft export --to peft-alora``: stock PEFT (no ccft code at inference) reproduces ccft's prefillshare.

The exported adapter is loaded with ``PeftModel.from_pretrained(AutoModelForCausalLM..., OUT)`` and run
over ``prompt + response`` in one ordinary forward; its logits from the handoff tokens on must equal
ccft's two-pass reference (``C_base`` from the base, then ``decoder_forward``) within 3e-5 (fp32), and
greedy ``generate`` must give ccft's tokens. Also: the one-token-newline trap (PEFT activates at the
*last* occurrence of the invocation sequence), and every refusal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_prompt, tokenize_response
from ccft.train.export import export_decoder
from conftest import make_full, make_lora, make_tiny_folder

N_NEW = 12
TOL = 3e-5  # fp32 over 30 layers; kernels differ by CPU (1.1e-5 seen on an AVX2-only CPU)


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer):
    """A tiny model with clear logit margins, so greedy decoding has no near-ties."""
    return make_tiny_folder(tmp_path_factory.mktemp("sharp_export"), tokenizer, seed=0, scale=30.0)


def _lora_folder(sharp_dir, folder, *, handoff, seed=3, recipe=None, method="ccft", lora=None):
    """A saved LoRA decoder with random non-zero A and B; returns (decoder, folder)."""
    base = ccft.load_base(str(sharp_dir))
    if lora:
        torch.manual_seed(seed)
        dec = ccft.make_decoder(
            base,
            "lora",
            lora={"r": 4, "lora_alpha": 8, "init_lora_weights": False, **lora},
            method=method,
            handoff_tokens=handoff,
        )
    else:
        dec = make_lora(base, "default", seed, r=4, handoff=handoff, method=method)
    dec.model.eval()
    ccft.save_decoder(dec, folder, recipe=recipe if recipe is not None else {"chat_template": "true"})
    return dec, folder


def _stock_peft(sharp_dir, out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(sharp_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(out)).eval()


def _ccft_logits(dec, prompt, response):
    """ccft prefillshare logits over prompt[n-k:] + response: (k + len(response), vocab)."""
    k = dec.handoff_tokens
    cache = ccft.compute_base_cache(dec.base, [prompt], handoff_tokens=k)
    with torch.no_grad():
        return ccft.decoder_forward(dec, cache, torch.tensor([prompt[-k:] + response]))[0]


def _peft_logits(model, prompt, response, k, **kwargs):
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt + response]), **kwargs).logits[0, len(prompt) - k :]


def _chat(tokenizer, text):
    return tokenize_prompt(tokenizer, text, chat_template=True)


def test_alora_export_equals_prefillshare_logits_and_greedy_tokens(
    sharp_dir, tmp_path, tokenizer, gsm8k_rows
):
    """handoff_tokens=4 (the generation prompt '<|im_start|>assistant\\n'): exact for any response."""
    dec, folder = _lora_folder(sharp_dir, tmp_path / "dec", handoff=4)
    res = export_decoder(folder, "peft-alora", tmp_path / "alora")
    assert res.warnings == [] and res.invocation.has_control_token
    prompt = _chat(tokenizer, gsm8k_rows[0]["prompt"])
    assert res.invocation.ids == prompt[-4:] and res.invocation.text == "<|im_start|>assistant\n"
    cfg = json.loads((tmp_path / "alora" / "adapter_config.json").read_text())
    assert cfg["alora_invocation_tokens"] == prompt[-4:] and cfg["peft_type"] == "LORA"
    assert not (tmp_path / "alora" / "ccft.json").exists()  # a PEFT folder, not a ccft decoder

    model = _stock_peft(sharp_dir, tmp_path / "alora")
    response = tokenize_response(tokenizer, gsm8k_rows[0]["response"])  # holds newlines: no trap with k=4
    assert tokenizer.convert_tokens_to_ids("Ċ") in response
    ours = _ccft_logits(dec, prompt, response)
    theirs = _peft_logits(model, prompt, response, 4)
    assert ours.shape == theirs.shape == (4 + len(response), len(tokenizer))
    assert (ours - theirs).abs().max().item() <= TOL
    # The test can fail: the adapter changes the logits, and a plain LoRA (on for the whole prompt) differs.
    with torch.no_grad(), model.disable_adapter():
        plain_base = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 4 :]
    assert (ours - plain_base).abs().max().item() > 1e-2
    everywhere = _peft_logits(model, prompt, response, 4, alora_offsets=[len(prompt) + len(response)])
    assert (ours - everywhere).abs().max().item() > 1e-3

    # Greedy generation: stock peft.generate on the prompt alone = ccft prefillshare generate.
    for row in gsm8k_rows[:3]:
        p = _chat(tokenizer, row["prompt"])
        (gen,) = ccft.generate([p], mode="prefillshare", decoder=dec, max_new_tokens=N_NEW)
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=N_NEW,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        peft_ids = out[0, len(p) :].tolist()
        eos = tokenizer.eos_token_id
        assert [t for t in peft_ids if t != eos] == [t for t in gen.token_ids if t != eos]
        assert len(gen.token_ids) > 0


def test_one_token_newline_handoff_trap(sharp_dir, tmp_path, tokenizer, gsm8k_rows, capsys):
    """handoff_tokens=1 on SmolLM2's chat template: the invocation is the newline ending the generation
    prompt.

    Exported with a warning naming the fix (handoff_tokens=4: "ass", "istant" are two tokens). Exact for
    responses without a newline and for generation; a response holding a newline moves PEFT's activation point
    to it (the last occurrence), so stock teacher-forced scoring differs before it. Passing PEFT's
    ``alora_offsets`` (the handoff position) explicitly restores ccft's logits.
    """
    dec, folder = _lora_folder(sharp_dir, tmp_path / "dec", handoff=1)
    with pytest.warns(UserWarning, match="LAST occurrence"):
        res = export_decoder(folder, "peft-alora", tmp_path / "alora")
    nl = tokenizer.convert_tokens_to_ids("Ċ")
    assert res.invocation.ids == [nl] and not res.invocation.has_control_token
    assert res.invocation.safe_handoff_tokens == 4 and "handoff_tokens=4" in res.warnings[0]
    card = (tmp_path / "alora" / "README.md").read_text()
    assert "LAST occurrence" in card
    from ccft.cli.main import main

    capsys.readouterr()
    assert main(["export", str(folder), "--to", "peft-alora", str(tmp_path / "alora-cli")]) == 0
    err = capsys.readouterr().err
    assert err.count("LAST occurrence") == 1 and "ccft export: warning: " in err  # printed once, by the CLI
    model = _stock_peft(sharp_dir, tmp_path / "alora")
    prompt = _chat(tokenizer, gsm8k_rows[1]["prompt"])

    flat = tokenize_response(tokenizer, "The answer is 42.")
    assert nl not in flat
    assert (_ccft_logits(dec, prompt, flat) - _peft_logits(model, prompt, flat, 1)).abs().max().item() <= TOL

    multi = tokenize_response(tokenizer, "Step one.\nStep two.\nThe answer is 42.")
    last_nl = len(multi) - 1 - multi[::-1].index(nl)
    ours = _ccft_logits(dec, prompt, multi)
    theirs = _peft_logits(model, prompt, multi, 1)
    # From the last newline of the response on, both run the adapter on the same tokens ... but the KV of the
    # earlier response tokens differs (adapter off there in PEFT), so only the logits *before* it are compared
    # for the trap: PEFT computed them as the plain base would.
    before = slice(0, 1 + last_nl)
    assert (ours[before] - theirs[before]).abs().max().item() > 1e-2
    with torch.no_grad(), model.disable_adapter():
        plain = model(input_ids=torch.tensor([prompt + multi])).logits[0, len(prompt) - 1 :]
    assert (theirs[before] - plain[before]).abs().max().item() <= TOL
    # The workaround: give PEFT the activation offset (tokens from the handoff to the end) yourself.
    fixed = _peft_logits(model, prompt, multi, 1, alora_offsets=[1 + len(multi)])
    assert (ours - fixed).abs().max().item() <= TOL
    # Generation is exact: PEFT fixes the offset on the prompt; every new token runs with the adapter.
    _assert_same_greedy(dec, model, tokenizer, prompt)


def test_refusals_name_the_fix(sharp_dir, tmp_path, tokenizer):
    base = ccft.load_base(str(sharp_dir))
    full = make_full(base, seed=1)
    ccft.save_decoder(full, tmp_path / "full", recipe={"chat_template": "true"})
    with pytest.raises(ConfigError, match="full-weight decoder.*--to merged"):
        export_decoder(tmp_path / "full", "peft-alora", tmp_path / "o1")

    _lora_folder(sharp_dir, tmp_path / "fullft", handoff=1, method="full-ft")
    with pytest.raises(ConfigError, match="method='full-ft', on its own prefill.*--to merged"):
        export_decoder(tmp_path / "fullft", "peft-alora", tmp_path / "o2")

    _lora_folder(sharp_dir, tmp_path / "plain", handoff=1, recipe={"chat_template": "false"})
    with pytest.raises(ConfigError, match="plain-text prompts.*--invocation-text"):
        export_decoder(tmp_path / "plain", "peft-alora", tmp_path / "o3")
    with pytest.raises(ConfigError, match="is 2 token.*handoff_tokens is 1"):
        export_decoder(tmp_path / "plain", "peft-alora", tmp_path / "o3", invocation_text="Answer:")
    with pytest.warns(UserWarning, match="holds no control token"):  # the caller names the suffix: exported
        res = export_decoder(tmp_path / "plain", "peft-alora", tmp_path / "o3", invocation_text=":")
    assert res.invocation.ids == tokenizer(":", add_special_tokens=False)["input_ids"]

    _lora_folder(sharp_dir, tmp_path / "long", handoff=8)
    with pytest.raises(ConfigError, match="handoff_tokens=8 reaches past the fixed end.*6 token.*<= 6"):
        export_decoder(tmp_path / "long", "peft-alora", tmp_path / "o4")

    _lora_folder(sharp_dir, tmp_path / "saved", handoff=4, lora={"modules_to_save": ["lm_head"]})
    with pytest.raises(ConfigError, match="modules_to_save=.*--to merged"):
        export_decoder(tmp_path / "saved", "peft-alora", tmp_path / "o5")

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    _lora_folder(sharp_dir, tmp_path / "ok", handoff=4)
    with pytest.raises(ConfigError, match="busy exists and is not empty"):
        export_decoder(tmp_path / "ok", "peft-alora", tmp_path / "busy")
    with pytest.raises(ConfigError, match="--invocation-text is for decoders trained on plain-text prompts"):
        export_decoder(tmp_path / "ok", "peft-alora", tmp_path / "o6", invocation_text="\n")
    with pytest.raises(ConfigError, match="--to 'gguf'; use one of peft-alora, merged"):
        export_decoder(tmp_path / "ok", "gguf", tmp_path / "o6")
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 4, 5, 6))


def _assert_same_greedy(dec, model, tokenizer, prompt) -> None:
    """ccft's prefillshare greedy tokens equal stock PEFT ``model.generate`` on ``prompt`` (EOS dropped)."""
    (gen,) = ccft.generate([prompt], mode="prefillshare", decoder=dec, max_new_tokens=N_NEW)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=N_NEW,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            pad_token_id=tokenizer.pad_token_id,
        )
    eos = tokenizer.eos_token_id
    assert [t for t in out[0, len(prompt) :].tolist() if t != eos] == [t for t in gen.token_ids if t != eos]


def _assert_stock_peft_matches(dec, model, tokenizer, rows, handoff: int = 4) -> None:
    """Stock PEFT ``model`` gives ``dec``'s prefillshare logits (within TOL of their scale) and greedy
    tokens."""
    for row in rows:
        prompt = _chat(tokenizer, row["prompt"])
        response = tokenize_response(tokenizer, row["response"])
        ours = _ccft_logits(dec, prompt, response)
        theirs = _peft_logits(model, prompt, response, handoff)
        assert (ours - theirs).abs().max().item() <= TOL * max(1.0, ours.abs().max().item())
        _assert_same_greedy(dec, model, tokenizer, prompt)


@pytest.mark.slow
def test_alora_export_on_the_embedded_model(tmp_path, tokenizer, gsm8k_rows):
    """The embedded SmolLM2-135M (fp32, 30 layers) with a random non-zero LoRA, handoff_tokens=4: logits
    within 3e-5 of the logits' scale (two passes vs one forward round differently over 30 layers), same greedy
    tokens."""
    from ccft.core.models import resolve_model_path

    base = ccft.load_base("smollm2-135m-instruct")
    dec = make_lora(base, "default", 7, r=8, handoff=4)
    ccft.save_decoder(dec, tmp_path / "dec", recipe={"chat_template": "true"})
    res = export_decoder(tmp_path / "dec", "peft-alora", tmp_path / "alora")
    assert res.warnings == [] and res.invocation.text == "<|im_start|>assistant\n"
    model = _stock_peft(resolve_model_path("smollm2-135m-instruct"), tmp_path / "alora")
    _assert_stock_peft_matches(dec, model, tokenizer, gsm8k_rows[:2])


@pytest.mark.slow
def test_alora_export_of_a_trained_decoder_on_the_embedded_model(tmp_path, tokenizer, gsm8k_rows):
    """A CCFT LoRA decoder trained by ``ccft train`` (the math recipe, handoff_tokens=4, 3 steps) on the
    embedded SmolLM2-135M, exported as a PEFT aLoRA adapter: stock PEFT gives ccft's prefillshare logits and
    greedy tokens."""
    from ccft.core.models import resolve_model_path
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
            "learning_rate=1e-3",
            "warmup_steps=0",
            "eval_strategy=no",
            "save_strategy=no",
            "logging_steps=1",
            "use_cpu=true",
            "disable_tqdm=true",
            f"output_dir={tmp_path / 'dec'}",
        ],
    )
    result = run_training(cfg, recipe=raw)
    assert len(result.loss_curve) == 3 and all(math.isfinite(x) for _, x in result.loss_curve)
    base = ccft.load_base("smollm2-135m-instruct")
    dec = ccft.load_decoder(tmp_path / "dec", base=base)
    res = export_decoder(tmp_path / "dec", "peft-alora", tmp_path / "alora")
    assert res.warnings == [] and res.invocation.text == "<|im_start|>assistant\n"
    model = _stock_peft(resolve_model_path("smollm2-135m-instruct"), tmp_path / "alora")
    _assert_stock_peft_matches(dec, model, tokenizer, gsm8k_rows[:2])
