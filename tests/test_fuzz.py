"""Property-based input fuzzing (hypothesis): every input trains or fails with a clear ccft error.

Properties:
  * rows × formats × chat templates × lengths × handoff: ``build_dataset`` raises ``DataError`` or
    gives examples whose token boundary holds (ids = prompt + response + [EOS], ≥ k+1 prompt tokens,
    ≤ max_length), and every collated batch supervises exactly the response + EOS of every row (never a
    silently all-masked row or batch), with a finite CCFT loss on a tiny decoder.
  * recipe overrides: ``load_recipe`` raises ``ConfigError``, or ``setup`` + one optimizer step raises a
    ``CCFTError`` or trains with a finite loss on batches that all carry supervised tokens.
Anything else (a bare ValueError/TypeError/KeyError from deep inside, a NaN loss, an empty batch) fails.
Runs are derandomized so CI sees the same examples every time.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ccft import CCFTError, DataError, load_base, make_decoder
from ccft.core.cache import prefill_tensors
from ccft.core.decoder import decoder_forward
from ccft.core.tokens import IGNORE_INDEX
from ccft.train.config import load_recipe
from ccft.train.data import Collator, build_dataset
from ccft.train.run import setup
from ccft.train.trainer import response_nll_sum

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

# Text that has bitten tokenisers and templates: brackets at the boundary, a leading newline, special-token
# look-alikes, template markers, unicode, lone whitespace.
PIECES = ["]", "{", "}", "\n", " ", "  ", "\t", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "assistant",
          "user\n", "####", "8,000", "$1,325", "é", "中文", "🙂", "\u200b", "\\", '"', "def f():\n    return 1",
          "The answer is 42.", "Q:", "A:"]
text = st.one_of(st.text(max_size=40),
                 st.lists(st.sampled_from(PIECES), max_size=8).map("".join),
                 st.sampled_from(["", " ", "\n", "x"]))
content = st.one_of(text, text, st.none(), st.integers(), st.lists(st.integers(), max_size=2))
role = st.sampled_from(["system", "user", "assistant", "tool", "bogus"])
message = st.fixed_dictionaries({"role": role, "content": content})


@st.composite
def rows(draw) -> dict:
    kind = draw(st.sampled_from(["pr", "pc", "messages", "messages_ok", "missing", "extra"]))
    if kind == "pr":
        return {"prompt": draw(content), "response": draw(content)}
    if kind == "pc":
        return {"prompt": draw(text), "completion": draw(text)}
    if kind == "messages":
        return {"messages": draw(st.lists(message, max_size=4))}
    if kind == "messages_ok":
        turns = [{"role": "user", "content": draw(text)}, {"role": "assistant", "content": draw(text)}]
        if draw(st.booleans()):
            turns.insert(0, {"role": "system", "content": draw(text)})
        return {"messages": turns}
    if kind == "missing":
        return draw(st.sampled_from([{}, {"prompt": "hi"}, {"response": "hi"}, {"messages": []},
                                     {"messages": "hello"}, {"messages": [{"role": "assistant"}]}]))
    return {"prompt": draw(text), "response": draw(text), "id": draw(st.integers()), "meta": {"x": 1}}


@pytest.fixture(scope="module")
def fuzz_decoder(tiny_dir):
    base = load_base(str(tiny_dir))
    torch.manual_seed(0)
    decoder = make_decoder(base, "lora", lora={"r": 2, "target_modules": ["q_proj", "v_proj"],
                                               "init_lora_weights": False})
    decoder.model.eval()
    return base, decoder


def check_batch(batch: dict, examples, k: int) -> None:
    """Every row supervises exactly its response + EOS; labels equal the next tail ids."""
    labels, tail = batch["labels"], batch["tail_ids"]
    per_row = (labels[:, 1:] != IGNORE_INDEX).sum(-1)
    want = torch.tensor([len(e.response_ids) for e in examples])
    assert torch.equal(per_row, want) and bool((per_row >= 1).all()), (per_row, want)
    assert int(batch["num_supervised"]) == int(want.sum()) > 0
    for i, e in enumerate(examples):
        row = tail[i, : k + len(e.response_ids)].tolist()
        assert row == list(e.prompt_ids[-k:]) + list(e.response_ids)
        assert labels[i, k:k + len(e.response_ids)].tolist() == list(e.response_ids)
        assert bool((labels[i, :k] == IGNORE_INDEX).all())


@settings(FUZZ, max_examples=80)
@given(data=st.lists(rows(), min_size=1, max_size=4), chat=st.sampled_from(["auto", True, False]),
       system=st.one_of(st.none(), text), max_length=st.integers(2, 300), k=st.integers(1, 4))
def test_rows_tokenise_to_supervised_batches_or_raise_data_error(tokenizer, fuzz_decoder, data, chat, system,
                                                                 max_length, k):
    base, decoder = fuzz_decoder
    try:
        ds = build_dataset(data, tokenizer, max_length=max_length, handoff_tokens=k, chat_template=chat,
                           system_prompt=system or None)
    except DataError as e:
        assert str(e)  # a message that names the problem
        return
    eos = tokenizer.eos_token_id
    assert len(ds) + ds.dropped_too_long == len(data) and len(ds) >= 1
    for e in ds.examples:
        assert len(e.prompt_ids) >= k + 1
        assert len(e.response_ids) >= 1 and e.response_ids[-1] == eos
        assert len(e.input_ids) <= max_length
        if tokenizer.bos_token_id is not None:
            assert list(e.prompt_ids[:2]) != [tokenizer.bos_token_id] * 2  # one BOS at most
    batch = Collator(tokenizer.pad_token_id, k)(ds.examples)
    check_batch(batch, ds.examples, k)
    with torch.no_grad(), base.base_weights() as m:
        cache = prefill_tensors(m, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"][:, :k],
                                 handoff_tokens=k, fingerprint=base.fingerprint)
    with torch.no_grad():
        nll, count = response_nll_sum(decoder_forward(decoder.model, cache, batch["tail_ids"], batch["tail_mask"]),
                                      batch["labels"])
    assert int(count) == int(batch["num_supervised"]) and math.isfinite(float(nll / count))


# ------------------------------------------------------------------ recipe overrides

OVERRIDES = {
    "handoff_tokens": st.sampled_from([0, 1, 2, 3, 40, -1, "two"]),
    "max_length": st.sampled_from([1, 2, 8, 24, 64, 512]),
    "learning_rate": st.sampled_from([1e-3, "1e-3", 0.0, "fast"]),
    "per_device_train_batch_size": st.sampled_from([0, 1, 3, 8, -2]),
    "gradient_accumulation_steps": st.sampled_from([0, 1, 2]),
    "method": st.sampled_from(["ccft", "full-ft", "sft"]),
    "decoder_kind": st.sampled_from(["lora", "full", "qlora"]),
    "train_path": st.sampled_from(["auto", "two-pass", "one-pass", "none"]),
    "lora_r": st.sampled_from([0, 1, 4, -3]),
    "lora_dropout": st.sampled_from([0.0, 0.1, 1.0, 1.5, -0.1]),
    "lora_target_modules": st.sampled_from([["q_proj"], ["nope_proj"], [], "q_proj"]),
    "chat_template": st.sampled_from(["auto", "true", "false", "maybe"]),
    "train_rows": st.sampled_from([0, 1, 5, 100, -1]),
    "data_offset": st.sampled_from([0, 3, 1000, -5]),
    "max_steps": st.sampled_from([1, 0, -1]),
    "gradient_checkpointing": st.sampled_from([True, False]),
    "system_prompt": st.sampled_from([None, "", "Be brief."]),
    "dtype": st.sampled_from(["float32", "fp32", "int8"]),
    "columns": st.sampled_from([None, {"prompt": "question"}, {"prompt": "prompt", "response": "response"}]),
    "bogus_key": st.just(1),
}


@pytest.fixture(scope="module")
def fuzz_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    rows_ = [{"prompt": f"Q{i}: what is {i} + {i}?" + " Think." * (i % 3), "response": f"{2 * i}." + " Ok." * (i % 2)}
             for i in range(6)]
    path = d / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return d, path


@settings(FUZZ, max_examples=30)
@given(chosen=st.dictionaries(st.sampled_from(sorted(OVERRIDES)), st.none(), max_size=5).flatmap(
    lambda keys: st.fixed_dictionaries({k: OVERRIDES[k] for k in keys})))
# Each of these once escaped as a bare ZeroDivisionError / ValueError from transformers or PEFT.
@example(chosen={"gradient_accumulation_steps": 0})
@example(chosen={"lora_target_modules": ["nope_proj"]})
@example(chosen={"lora_dropout": 1.5})
@example(chosen={"train_rows": 0})
@example(chosen={"handoff_tokens": 40})
@example(chosen={"max_length": 8})
@example(chosen={"train_path": "one-pass", "gradient_checkpointing": True, "gradient_accumulation_steps": 2})
def test_recipe_overrides_train_or_raise_a_ccft_error(tiny_dir, fuzz_data, chosen):
    d, path = fuzz_data
    ov = {"base": str(tiny_dir), "train_data": str(path), "output_dir": str(d / "run"), "max_steps": 1,
          "per_device_train_batch_size": 3, "use_cpu": True, "report_to": "none", "save_strategy": "no",
          "disable_tqdm": True, "chat_template": "false", "lora_r": 2, "logging_steps": 1}
    ov.update(chosen)
    items = [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) or v is None else v}" for k, v in ov.items()]
    try:
        cfg, _, _ = load_recipe(None, items)
    except CCFTError as e:
        assert str(e)
        return
    try:
        base, decoder, train_set, _, trainer = setup(cfg)
    except CCFTError as e:
        assert str(e)
        return
    seen = []
    orig = trainer.compute_loss

    def spy(model, inputs, **kw):
        per_row = (inputs["labels"][:, 1:] != IGNORE_INDEX).sum(-1)
        seen.append(per_row.min().item())
        loss = orig(model, inputs, **kw)
        assert torch.isfinite(loss)
        return loss

    trainer.compute_loss = spy
    before = torch.get_num_threads()
    try:
        out = trainer.train()
    except CCFTError as e:
        assert str(e)
        return
    finally:
        torch.set_num_threads(before)
    assert seen and min(seen) >= 1, seen  # every row of every batch carried a supervised token
    assert math.isfinite(out.training_loss)
