"""The main job under test: ``ccft demo`` end to end on the tiny model, its report checked independently.

The demo trains a CCFT and a Full-FT LoRA decoder (3 steps each), evaluates base / full-ft / naive /
prefillshare on 4 GSM8K test rows (generations on 3, 8 new tokens) and writes ``results.json``,
``README.md`` and the runner folder ``gsm8k/``. The report's numbers are recomputed here without ccft's
model code:

* models: the base folder with ``transformers.AutoModelForCausalLM``, each decoder folder (a PEFT adapter
  folder) with ``peft.PeftModel`` on its own fresh copy of the base;
* prompts: the tokenizer's chat template on the question (the demo's "decoder" prompt format: no system
  prompt), checked against the report's per-item ``prompt_sha``; responses: the reference answer + EOS;
* NLL per response token, one unpadded row at a time: ``base`` / ``full-ft`` one forward over prompt +
  response; ``naive`` / ``prefillshare`` (docs/design.md "Modes"): the base's KV cache over ``prompt[:-1]``
  (handoff k = 1), then the decoder over ``[prompt[-1]] + response`` on that cache;
* exact match: the recorded generations re-scored with a hand-written ``#### N`` check, and the greedy
  generations of every mode regenerated with HF ``generate`` (naive / prefillshare on the base's cache).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

MODES = ("base", "full-ft", "naive", "prefillshare")
NLL_ROWS, EM_ROWS, NEW_TOKENS = 4, 3, 8
GSM8K_TEST = Path(__file__).resolve().parents[2] / "src" / "ccft" / "resources" / "gsm8k" / "test.jsonl"


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_dir):
    """Run ``ccft demo`` once (the CLI's entry point, in process) and return its folders and report."""
    from ccft.cli.main import main

    d = tmp_path_factory.mktemp("demo")
    (d / "r.yaml").write_text(f"""base: {tiny_dir}
decoder_kind: lora
lora_r: 4
lora_alpha: 8
handoff_tokens: 1
dtype: float32
train_data: gsm8k:train
train_rows: 6
max_length: 384
max_steps: 3
per_device_train_batch_size: 2
learning_rate: 5.0e-2
seed: 0
logging_steps: 1
save_strategy: "no"
use_cpu: true
report_to: none
eval:
  task: gsm8k
  nll_rows: {NLL_ROWS}
  em_rows: {EM_ROWS}
  max_new_tokens: {NEW_TOKENS}
  batch_size: 4
  modes: [base, full-ft, naive, prefillshare]
  bootstrap: 50
""")
    rc = main(["demo", str(d / "r.yaml"), "--out", str(d / "report"), "--runs", str(d / "runs")])
    assert rc == 0
    out = d / "report"
    items = {
        m: sorted(
            (json.loads(x) for x in (out / "gsm8k" / f"items.{m}.jsonl").read_text().splitlines()),
            key=lambda r: r["index"],
        )
        for m in MODES
    }
    return {
        "dir": d,
        "base": Path(tiny_dir),
        "runs": d / "runs",
        "results": json.loads((out / "results.json").read_text()),
        "summary": json.loads((out / "gsm8k" / "summary.json").read_text()),
        "items": items,
        "readme": (out / "README.md").read_text(),
    }


@pytest.fixture(scope="module")
def hf(demo):
    """Independent models: the base and one PEFT model per decoder folder (each on its own base copy)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def plain():
        return AutoModelForCausalLM.from_pretrained(demo["base"], dtype=torch.float32).eval()

    return {
        "tok": AutoTokenizer.from_pretrained(demo["base"]),
        "base": plain(),
        "ccft": PeftModel.from_pretrained(plain(), demo["runs"] / "ccft").eval(),
        "full-ft": PeftModel.from_pretrained(plain(), demo["runs"] / "full-ft").eval(),
    }


def _rows():
    return [json.loads(x) for x in GSM8K_TEST.read_text().splitlines()[:NLL_ROWS]]


def _prompt(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _response(tok, answer: str) -> list[int]:
    return tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def _cache_of_base(hf, prompt: list[int]):
    with torch.no_grad():
        return hf["base"](input_ids=torch.tensor([prompt[:-1]]), use_cache=True).past_key_values


def _nll(hf, mode: str, prompt: list[int], response: list[int]) -> float:
    """Mean NLL (nats) per response token (+ EOS) under ``mode``, one unpadded row, plain HF / PEFT
    forwards."""
    n, r = len(prompt), len(response)
    target = torch.tensor(response)
    with torch.no_grad():
        if mode in ("base", "full-ft"):
            model = hf["base"] if mode == "base" else hf["full-ft"]
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, n - 1 : n + r - 1]
        else:  # the decoder reads the base's cache over prompt[:-1], recomputes the last prompt token
            decoder = hf["full-ft"] if mode == "naive" else hf["ccft"]
            cache = _cache_of_base(hf, prompt)
            logits = decoder(
                input_ids=torch.tensor([prompt[-1:] + response]),
                past_key_values=cache,
                position_ids=torch.arange(n - 1, n + r)[None],
            ).logits[0, :r]
    return float(-torch.log_softmax(logits.float(), -1).gather(-1, target[:, None]).mean())


def _greedy(hf, mode: str, prompt: list[int]) -> list[int]:
    model = {
        "base": hf["base"],
        "full-ft": hf["full-ft"],
        "naive": hf["full-ft"],
        "prefillshare": hf["ccft"],
    }[mode]
    kw = {}
    if mode in ("naive", "prefillshare"):
        kw["past_key_values"] = _cache_of_base(hf, prompt)
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=hf["tok"].pad_token_id,
            **kw,
        )
    return out[0, len(prompt) :].tolist()


def _hand_em(text: str, answer: str) -> float:
    """1.0 when the first ``#### N`` of ``text`` is the reference's final number (commas dropped), else
    0.0."""
    want = answer.split("####")[-1].strip().replace(",", "")
    m = re.search(r"#### \$?(-?[0-9][0-9,]*(?:\.[0-9]+)?)", text)
    return float(m is not None and m.group(1).replace(",", "").rstrip(".") == want)


def test_demo_writes_the_report(demo):
    res, summary = demo["results"], demo["summary"]
    assert res["kind"] == "ccft-demo" and res["steps"] == 3 and res["train_rows"] == 6
    assert set(summary["modes"]) == set(MODES) and summary["task"] == "gsm8k"
    for method in ("ccft", "full-ft"):
        steps = [s for s, _ in res["loss_curve"][method]]
        assert steps == [1, 2, 3] and all(v == v and abs(v) < 1e3 for _, v in res["loss_curve"][method])
    for mode in MODES:
        assert [r["index"] for r in demo["items"][mode]] == list(range(NLL_ROWS))
        assert sum("text" in r for r in demo["items"][mode]) == EM_ROWS
        assert f"| {mode} |" in demo["readme"]


def test_prompts_and_responses_are_the_documented_ones(demo, hf):
    tok = hf["tok"]
    for row, rec in zip(_rows(), demo["items"]["base"], strict=True):
        prompt = _prompt(tok, row["question"])
        assert rec["prompt_sha"] == hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest()[:16]
        assert rec["prompt_tokens"] == len(prompt)
        assert rec["nll_tokens"] == len(_response(tok, row["answer"]))


def test_report_nll_equals_an_independent_forward(demo, hf):
    tok = hf["tok"]
    rows = _rows()
    expected = {
        mode: [_nll(hf, mode, _prompt(tok, r["question"]), _response(tok, r["answer"])) for r in rows]
        for mode in MODES
    }
    for mode in MODES:
        got = [rec["nll"] for rec in demo["items"][mode]]
        assert got == pytest.approx(expected[mode], abs=2e-4), mode
        assert demo["summary"]["modes"][mode]["nll"] == pytest.approx(
            sum(expected[mode]) / NLL_ROWS, abs=2e-4
        )
        assert demo["results"]["eval"]["modes"][mode]["nll"] == demo["summary"]["modes"][mode]["nll"]
    # the four modes really differ on these rows (a report that swapped two modes would fail above)
    means = sorted(sum(v) / NLL_ROWS for v in expected.values())
    assert min(b - a for a, b in zip(means, means[1:])) > 5e-3, means


def test_report_generations_and_exact_match_rescored(demo, hf):
    tok = hf["tok"]
    rows = _rows()
    for mode in MODES:
        scored = [rec for rec in demo["items"][mode] if "text" in rec]
        hand = []
        for rec in scored:
            row = rows[rec["index"]]
            new = _greedy(hf, mode, _prompt(tok, row["question"]))
            assert rec["new_tokens"] == len(new) == NEW_TOKENS or tok.eos_token_id in new, (mode, rec)
            assert rec["text"] == tok.decode(new, skip_special_tokens=True), (mode, rec["index"])
            hand.append(_hand_em(rec["text"], row["answer"]))
            assert rec["scores"]["exact_match_strict"] == hand[-1]
        em = demo["summary"]["modes"][mode]["metrics"]["exact_match_strict"]
        assert em["n"] == EM_ROWS and em["mean"] == pytest.approx(sum(hand) / EM_ROWS)


def test_hand_em_check_itself():
    assert _hand_em("so 5 + 13 = 18\n#### 18", "...\n#### 18") == 1.0
    assert _hand_em("#### 1,450,000", "x\n#### 1450000") == 1.0
    assert _hand_em("The answer is 18", "#### 18") == 0.0
    assert _hand_em("#### 17", "#### 18") == 0.0
