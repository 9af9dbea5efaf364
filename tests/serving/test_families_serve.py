"""``ccft serve`` over every model family the engine runs (tests/families.py): a tiny random base of each
family and one CCFT LoRA decoder, served over loopback (``BackgroundServer``, as tests/serving/test_server.py)
with and without chunked prefill (a piece budget of 8 tokens: every prompt spans several pieces). Greedy
completions (streamed and not) and a chat request, for the base and for the decoder, sent together so that
they decode in the same engine steps, answer the token ids and text of offline ``ccft.generate`` (the
reference path: HF forwards) for the same prompt and decoder. A sliding-window model is served only within
its window: a prompt + ``max_tokens`` beyond ``config.sliding_window`` is refused with
``context_length_exceeded``, the message naming the field.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import ccft
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from ccft.serving.prefix_store import PrefixKVStore
from ccft.serving.scheduler import Scheduler
from ccft.serving.server import BackgroundServer, create_app
from conftest import make_lora
from families import MODEL_FAMILIES, make_family_folder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models are latency-bound

WAIT = 120.0  # seconds: bound on every wait (against hangs only; nothing asserts on time)
MAX_TOKENS = 5
CHUNK = 8  # chunked prefill's per-step token budget (decode rows + prefill pieces)
BLOCK = 4  # prefix-store block tokens (piece boundaries fall on them)


@pytest.fixture(scope="module", params=MODEL_FAMILIES)
def world(request, tmp_path_factory, tokenizer):
    family = request.param
    folder = make_family_folder(tmp_path_factory.mktemp(f"serve_{family}"), tokenizer, family)
    base = ccft.load_base(str(folder))
    assert base.config.model_type == ("gemma3_text" if family == "gemma3" else family)
    return family, base, {"math": make_lora(base, "math", 60, 4)}


@pytest.fixture(scope="module")
def texts(gsm8k_rows):
    """Two real prompts (about 25 and 40 tokens) and a chat turn."""
    return gsm8k_rows[0]["prompt"][:110], gsm8k_rows[1]["prompt"][:170], gsm8k_rows[2]["prompt"][:90]


def _reference(base, decs, ids: list[int], decoder: str, max_tokens: int = MAX_TOKENS):
    """Offline ``ccft.generate`` (the reference path): the base alone, or the decoder on C_base
    (prefillshare)."""
    if decoder == "base":
        return ccft.generate([list(ids)], mode="base", base=base, max_new_tokens=max_tokens)[0]
    return ccft.generate([list(ids)], mode="prefillshare", decoder=decs[decoder], max_new_tokens=max_tokens)[
        0
    ]


async def _complete(client: httpx.AsyncClient, body: dict, *, chat: bool = False) -> dict:
    """POST one request (streamed or not) -> {status, text, token_ids, prompt_token_ids, finish_reason}
    (or {status, error})."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**body, "return_token_ids": True, "temperature": 0}
    if not body.get("stream"):
        r = await client.post(path, json=body)
        data = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "error": data["error"]}
        c = data["choices"][0]
        return {
            "status": 200,
            "text": c["message"]["content"] if chat else c["text"],
            "token_ids": c["token_ids"],
            "prompt_token_ids": c["prompt_token_ids"],
            "finish_reason": c["finish_reason"],
        }
    out = {"status": 0, "text": "", "token_ids": [], "prompt_token_ids": None, "finish_reason": None}
    async with client.stream("POST", path, json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            payload = line[len("data: ") :] if line.startswith("data: ") else None
            if not payload or payload == "[DONE]":
                continue
            data = json.loads(payload)
            assert "error" not in data, data
            for c in data["choices"]:
                out["text"] += c["delta"].get("content", "") if chat else c["text"]
                out["token_ids"] += c["token_ids"]
                out["prompt_token_ids"] = c.get("prompt_token_ids", out["prompt_token_ids"])
                out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
    return out


def _gather(url: str, *jobs):
    """Send ``(body, chat)`` jobs concurrently; their results in order."""

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=WAIT) as client:
            return await asyncio.gather(*(_complete(client, body, chat=chat) for body, chat in jobs))

    return asyncio.run(asyncio.wait_for(go(), WAIT * 2))


def _same(got: dict, ref, prompt_ids: list[int]) -> None:
    assert got["status"] == 200, got
    assert got["prompt_token_ids"] == list(prompt_ids)
    assert got["token_ids"] == list(ref.token_ids)
    assert got["text"] == ref.text
    assert got["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[ref.finish_reason]


def _serve(base, decs, **sched_kw):
    engine = SharedPrefillEngine(base, decoders=decs)
    scheduler = Scheduler(engine, store=PrefixKVStore(block_tokens=BLOCK), **sched_kw)
    return engine, scheduler, BackgroundServer(create_app(scheduler, base.tokenizer))


@pytest.mark.parametrize("chunk", [None, CHUNK], ids=["whole-prefill", "chunked-prefill"])
def test_served_greedy_equals_offline_generate(world, texts, tokenizer, chunk):
    family, base, decs = world
    a, b, question = texts
    ids = [tokenize_prompt(tokenizer, t, chat_template=False) for t in (a, b)]
    assert all(len(p) > 2 * CHUNK for p in ids)  # each prompt's context spans several pieces
    messages = [{"role": "user", "content": question}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    jobs = [
        ({"model": "base", "prompt": a, "max_tokens": MAX_TOKENS}, False),
        ({"model": "math", "prompt": a, "max_tokens": MAX_TOKENS, "stream": True}, False),
        ({"model": "math", "prompt": ids[1], "max_tokens": MAX_TOKENS}, False),
        ({"model": "base", "prompt": ids[1], "max_tokens": MAX_TOKENS, "stream": True}, False),
        ({"model": "math", "messages": messages, "max_tokens": MAX_TOKENS}, True),
        ({"model": "base", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True}, True),
    ]
    wants = [(ids[0], "base"), (ids[0], "math"), (ids[1], "math"), (ids[1], "base")]
    wants += [(rendered, "math"), (rendered, "base")]
    engine, scheduler, server = _serve(base, decs, prefill_chunk_tokens=chunk)
    with server:
        got = _gather(server.url, *jobs)
    for g, (prompt, decoder) in zip(got, wants, strict=True):
        _same(g, _reference(base, decs, prompt, decoder), prompt)
    if chunk is not None:  # both contexts (and the chat's) were prefilled in pieces
        assert scheduler.counters["prefill_chunks"] >= sum(len(p) - 1 for p in ids) // CHUNK
    assert scheduler.live_bytes == 0 and engine.active == 0


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tokenizer):
    """A ``family`` folder saved with ``sliding_window=64`` (its other fields as tests/families.py's)."""

    def make(family: str):
        folder = make_family_folder(tmp_path_factory.mktemp(f"window_{family}"), tokenizer, family)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["sliding_window"] = 64
        (folder / "config.json").write_text(json.dumps(cfg))
        return ccft.load_base(str(folder))

    return make


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_prompt_beyond_the_sliding_window_is_refused(windowed, gsm8k_rows, tokenizer, family):
    base = windowed(family)
    decs = {"math": make_lora(base, "math", 61, 4)}
    engine, scheduler, server = _serve(base, decs, prefill_chunk_tokens=CHUNK)
    assert engine.max_positions == 64
    prompt = tokenize_prompt(
        tokenizer, gsm8k_rows[3]["prompt"] + gsm8k_rows[4]["prompt"], chat_template=False
    )
    prompt = prompt[:60]
    assert len(prompt) == 60
    with server:
        over, stream_over, within = _gather(
            server.url,
            ({"model": "math", "prompt": prompt, "max_tokens": 10}, False),
            ({"model": "base", "prompt": prompt, "max_tokens": 10, "stream": True}, False),
            ({"model": "math", "prompt": prompt, "max_tokens": 4}, False),  # 64 positions: within the window
        )
        card = httpx.get(server.url + "/v1/models/math", timeout=WAIT).json()
    for g in (over, stream_over):
        assert g["status"] == 400, g
        err = g["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err
        assert "64" in err["message"] and "sliding_window" in err["message"], err
    _same(within, _reference(base, decs, prompt, "math", 4), prompt)
    assert card["max_model_len"] == 64
    assert scheduler.live_bytes == 0 and engine.active == 0
