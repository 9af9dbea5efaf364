"""``ccft train`` then ``ccft export``: a decoder trained a few steps, its model cards, and stock PEFT on the
export.

Model cards are Hub model cards: the YAML header parses (``huggingface_hub.ModelCard``) with
``base_model``, ``library_name``, ``tags`` and ``datasets`` as ``ccft.json`` says.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from huggingface_hub import ModelCard

import ccft
from ccft.cli.main import main
from ccft.core.tokens import tokenize_prompt, tokenize_response
from ccft.train.card import model_card_text

STEPS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_dir):
    """A CCFT LoRA decoder trained STEPS steps on 8 GSM8K rows, chat prompts, handoff_tokens=4."""
    folder = tmp_path_factory.mktemp("trained")
    recipe = {
        "base": str(tiny_dir),
        "output_dir": str(folder / "dec"),
        "train_data": "gsm8k:train",
        "train_rows": 8,
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "learning_rate": 5e-2,
        "use_cpu": True,
        "disable_tqdm": True,
        "chat_template": True,
        "save_strategy": "no",
        "seed": 3,
        "lora_r": 4,
        "lora_alpha": 8,
        "handoff_tokens": 4,
        "report_to": "none",
    }
    (folder / "r.yaml").write_text(yaml.safe_dump(recipe))
    out = folder / "dec"
    rc = main(["train", str(folder / "r.yaml")])
    assert rc == 0
    return out


def _header(path):
    text = path.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1]), text


def test_train_writes_a_model_card(trained):
    meta = json.loads((trained / "ccft.json").read_text())
    header, text = _header(trained / "README.md")
    assert header["library_name"] == "peft" and header["datasets"] == ["openai/gsm8k"]
    assert {"ccft", "prefillshare", "lora", "method-ccft"} <= set(header["tags"])
    assert "base_model" not in header  # a local folder is no Hub id
    assert ModelCard.load(trained / "README.md").data.library_name == "peft"
    assert f"steps: {STEPS}" in text and f"training rows: {meta['data']['train_rows']}" in text
    assert "last 4 prompt token(s)" in text and "ccft.load_decoder" in text and "ccft serve" in text


def test_card_header_fields_for_an_embedded_base():
    meta = {
        "method": "ccft",
        "decoder_kind": "lora",
        "handoff_tokens": 1,
        "base_fingerprint": "abc",
        "base": {"name": "smollm2-135m-instruct", "path": "/x"},
        "data": {"train_data": "mbpp:train"},
        "recipe": {"system_prompt": "{{ not jinja }}"},
    }
    summary = {
        "task": "gsm8k",
        "modes": {
            "prefillshare": {"n": 5, "nll": 0.5, "metrics": {"accuracy": {"mean": 0.4}}},
            "full-ft": {"n": 5, "nll": 0.4, "metrics": {"accuracy": {"mean": 0.6}}},
        },
    }
    text = model_card_text(meta, evals=[summary])
    header = yaml.safe_load(text.split("---\n")[1])
    assert header["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert header["datasets"] == ["google-research-datasets/mbpp"] and header["library_name"] == "peft"
    assert "| gsm8k | prefillshare | 5 | 0.5000 | accuracy 0.4000 |" in text
    assert "| gsm8k | full-ft | 5 | 0.4000 | accuracy 0.6000 |" in text
    assert "{{ not jinja }}" in text


def test_export_cli_alora_from_a_trained_decoder_runs_on_stock_peft(
    trained, tmp_path, tiny_dir, tokenizer, gsm8k_rows, capsys
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    summary = tmp_path / "summary.json"
    summary.write_text(
        json.dumps(
            {"task": "gsm8k", "modes": {"prefillshare": {"n": 2, "metrics": {"accuracy": {"mean": 0.5}}}}}
        )
    )
    rc = main(
        [
            "export",
            str(trained),
            "--to",
            "peft-alora",
            str(tmp_path / "alora"),
            "--eval-summary",
            str(summary),
        ]
    )
    out = capsys.readouterr()
    assert rc == 0 and "invocation tokens" in out.out and "warning" not in out.err
    header, text = _header(tmp_path / "alora" / "README.md")
    assert header["library_name"] == "peft" and {"alora", "method-ccft"} <= set(header["tags"])
    assert (
        "| gsm8k | prefillshare | 2 | - | accuracy 0.5000 |" in text and "PeftModel.from_pretrained" in text
    )

    dec = ccft.load_decoder(trained)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32), str(tmp_path / "alora")
    ).eval()
    prompt = tokenize_prompt(tokenizer, gsm8k_rows[20]["prompt"], chat_template=True)
    response = tokenize_response(tokenizer, gsm8k_rows[20]["response"])
    cache = ccft.compute_base_cache(dec.base, [prompt], handoff_tokens=4)
    with torch.no_grad():
        ours = ccft.decoder_forward(dec, cache, torch.tensor([prompt[-4:] + response]))[0]
        theirs = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 4 :]
        with model.disable_adapter():
            untrained = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 4 :]
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - untrained).abs().max().item() > 1e-3  # three steps moved the adapter off zero

    rc = main(["export", str(trained), "--to", "merged", str(tmp_path / "merged")])
    assert rc == 0 and json.loads((tmp_path / "merged" / "ccft.json").read_text())["decoder_kind"] == "full"
    rc = main(["export", str(trained), "--to", "peft-alora", str(tmp_path / "alora")])
    assert rc == 2 and "exists and is not empty" in capsys.readouterr().err
