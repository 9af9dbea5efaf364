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

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

# Text that has bitten tokenisers and templates: brackets at the boundary, a leading newline, special-token
# look-alikes, template markers, unicode, lone whitespace.
PIECES = [
    "]",
    "{",
    "}",
    "\n",
    " ",
    "  ",
    "\t",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "assistant",
    "user\n",
    "####",
    "8,000",
    "$1,325",
    "é",
    "中文",
    "🙂",
    "\u200b",
    "\\",
    '"',
    "def f():\n    return 1",
    "The answer is 42.",
    "Q:",
    "A:",
]
text = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(PIECES), max_size=8).map("".join),
    st.sampled_from(["", " ", "\n", "x"]),
)
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
        return draw(
            st.sampled_from(
                [
                    {},
                    {"prompt": "hi"},
                    {"response": "hi"},
                    {"messages": []},
                    {"messages": "hello"},
                    {"messages": [{"role": "assistant"}]},
                ]
            )
        )
    return {"prompt": draw(text), "response": draw(text), "id": draw(st.integers()), "meta": {"x": 1}}


@pytest.fixture(scope="module")
def fuzz_decoder(tiny_dir):
    base = load_base(str(tiny_dir))
    torch.manual_seed(0)
    decoder = make_decoder(
        base, "lora", lora={"r": 2, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    )
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
        assert labels[i, k : k + len(e.response_ids)].tolist() == list(e.response_ids)
        assert bool((labels[i, :k] == IGNORE_INDEX).all())


def _malformed(row: dict) -> str | None:
    """Why ``row`` breaks the documented row format (README "Data"), or None: an independent restatement."""

    def nonblank(x):
        return isinstance(x, str) and x.strip() != ""

    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or len(msgs) < 2:
            return "messages is not a list of >= 2 turns"
        if not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs
        ):
            return "a turn without a string role and content"
        if msgs[-1]["role"] != "assistant" or not nonblank(msgs[-1]["content"]):
            return "no final non-empty assistant turn"
        return None
    if not nonblank(row.get("prompt")):
        return "no non-empty string prompt"
    if not nonblank(row.get("response", row.get("completion"))):
        return "no non-empty string response/completion"
    return None


def _holds_control_text(row: dict, tokenizer) -> bool:
    """Any string in ``row`` contains a special token's text (ccft may refuse it: docs/design.md K2)."""
    specials = [
        t
        for t in tokenizer.all_special_tokens + [str(a) for a in tokenizer.added_tokens_decoder.values()]
        if t
    ]
    leaves = json.dumps(row, ensure_ascii=False)
    return any(t in leaves for t in specials)


def _refusal_is_justified(msg: str, data, tokenizer, max_length: int, k: int, chat) -> bool:
    """A DataError is acceptable when some row is malformed or holds control text, chat messages come with
    ``chat_template=False``, or for a length reason whose numbers are consistent (the prompt is below k+1
    tokens / every row is over max_length)."""
    import re

    if any(_malformed(r) or _holds_control_text(r, tokenizer) for r in data):
        return True
    if chat is False and any("messages" in r for r in data):
        return True
    short = re.search(r"the prompt has (\d+) tokens; with handoff_tokens=(\d+)", msg)
    if short:
        return int(short[1]) < int(short[2]) + 1 and int(short[2]) == k
    over = re.search(r"no rows left: (\d+) of (\d+) rows are longer than max_length=(\d+)", msg)
    if over:
        return int(over[1]) == int(over[2]) == len(data) and int(over[3]) == max_length
    return False


@settings(FUZZ, max_examples=80)
@given(
    data=st.lists(rows(), min_size=1, max_size=4),
    chat=st.sampled_from(["auto", True, False]),
    system=st.one_of(st.none(), text),
    max_length=st.integers(2, 300),
    k=st.integers(1, 4),
)
def test_rows_tokenise_to_supervised_batches_or_raise_data_error(
    tokenizer, fuzz_decoder, data, chat, system, max_length, k
):
    base, decoder = fuzz_decoder
    try:
        ds = build_dataset(
            data,
            tokenizer,
            max_length=max_length,
            handoff_tokens=k,
            chat_template=chat,
            system_prompt=system or None,
        )
    except DataError as e:
        # refused only for a reason the rows really have (checked here, not taken from ccft)
        assert str(e) and _refusal_is_justified(str(e), data, tokenizer, max_length, k, chat), (str(e), data)
        return
    assert not any(_malformed(r) for r in data), [
        _malformed(r) for r in data
    ]  # nothing malformed slips through
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
        cache = prefill_tensors(
            m,
            batch["prefix_ids"],
            batch["prefix_mask"],
            batch["tail_ids"][:, :k],
            handoff_tokens=k,
            fingerprint=base.fingerprint,
        )
    with torch.no_grad():
        nll, count = response_nll_sum(
            decoder_forward(decoder.model, cache, batch["tail_ids"], batch["tail_mask"]), batch["labels"]
        )
    assert int(count) == int(batch["num_supervised"]) and math.isfinite(float(nll / count))


CONTROL_PIECES = {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
plain = (
    st.lists(
        st.sampled_from([p for p in PIECES if p not in CONTROL_PIECES] + ["word", "7"]),
        min_size=1,
        max_size=8,
    )
    .map("".join)
    .map(lambda t: "Question: " + t)
)  # never blank, >= 2 tokens before it


@st.composite
def well_formed_rows(draw) -> dict:
    kind = draw(st.sampled_from(["pr", "pc", "messages", "extra"]))
    if kind == "pr":
        return {"prompt": draw(plain), "response": draw(plain)}
    if kind == "pc":
        return {"prompt": draw(plain), "completion": draw(plain)}
    if kind == "messages":
        turns = [{"role": "user", "content": draw(plain)}, {"role": "assistant", "content": draw(plain)}]
        if draw(st.booleans()):
            turns.insert(0, {"role": "system", "content": draw(plain)})
        return {"messages": turns}
    return {"prompt": draw(plain), "response": draw(plain), "id": draw(st.integers()), "meta": {"x": 1}}


@settings(FUZZ, max_examples=40)
@given(
    data=st.lists(well_formed_rows(), min_size=1, max_size=4),
    chat=st.sampled_from(["auto", True, False]),
    k=st.integers(1, 2),
)
def test_well_formed_rows_are_never_refused(tokenizer, data, chat, k):
    """Rows in the documented format, without control-token text, short enough: build_dataset keeps them all
    (a DataError here is a refusal of good data)."""
    assert not any(_malformed(r) or _holds_control_text(r, tokenizer) for r in data)
    if chat is False:  # chat messages need the template: documented refusal, tested in the property above
        data = [r for r in data if "messages" not in r] or [{"prompt": "Question: 7", "response": "7"}]
    ds = build_dataset(data, tokenizer, max_length=4096, handoff_tokens=k, chat_template=chat)
    assert len(ds) == len(data) and ds.dropped_too_long == 0
    assert all(e.response_ids[-1] == tokenizer.eos_token_id for e in ds.examples)


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
    rows_ = [
        {
            "prompt": f"Q{i}: what is {i} + {i}?" + " Think." * (i % 3),
            "response": f"{2 * i}." + " Ok." * (i % 2),
        }
        for i in range(6)
    ]
    path = d / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return d, path


@settings(FUZZ, max_examples=30)
@given(
    chosen=st.dictionaries(st.sampled_from(sorted(OVERRIDES)), st.none(), max_size=5).flatmap(
        lambda keys: st.fixed_dictionaries({k: OVERRIDES[k] for k in keys})
    )
)
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
    ov = {
        "base": str(tiny_dir),
        "train_data": str(path),
        "output_dir": str(d / "run"),
        "max_steps": 1,
        "per_device_train_batch_size": 3,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "chat_template": "false",
        "lora_r": 2,
        "logging_steps": 1,
    }
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
