"""Request bodies of ``ccft serve`` as pydantic models (``ccft.serving.schemas``): strict JSON types, the
OpenAI error object naming the field (``param``) and the fix, no-op values of unimplemented options
(docs/design.md, fault class K9). The HTTP-level answers are in test_server.py."""

from __future__ import annotations

import json

import pytest

from ccft.core.sampling import SamplingParams
from ccft.serving.schemas import APIError, ChatCompletionRequest, CompletionRequest, Reply, parse_request

PROMPT = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _raw(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _error(body, chat: bool = False) -> APIError:
    with pytest.raises(APIError) as e:
        parse_request(_raw(body), chat=chat, vocab_size=100)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


@pytest.mark.parametrize(
    "body, chat, param, message",
    [
        (b"{not json", False, None, "the request body is not valid JSON"),
        (
            b'{"model": "\\ud800", "prompt": "x"}',
            False,
            "model",
            "not valid JSON",
        ),  # a lone surrogate, its field named
        (
            b'{"model": "m", "prompt": "\\ud83d abc"}',
            False,
            "prompt",
            "'prompt' holds a lone UTF-16 surrogate (\\ud83d)",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "ok"}, {"role": "user", '
            b'"content": "a\\udc00"}]}',
            True,
            "messages[1].content",
            "lone UTF-16 surrogate",
        ),
        (b'{"model": "m", "prompt": "x", "stop": ["\\udfff"]}', False, "stop[0]", "lone UTF-16 surrogate"),
        (b"\xff\xfe", False, None, "not valid JSON"),
        (b'"text"', False, None, "the request body must be a JSON object, got string"),
        (
            {**PROMPT, "max_tokens": True},
            False,
            "max_tokens",
            "'max_tokens' must be an integer, got boolean (true)",
        ),
        ({**PROMPT, "max_tokens": 2.0}, False, "max_tokens", "must be an integer, got number"),
        (
            {**PROMPT, "temperature": "0.5"},
            False,
            "temperature",
            "'temperature' must be a number, got string",
        ),
        (b'{"model": "m", "prompt": "hi", "temperature": NaN}', False, "temperature", "finite number"),
        (b'{"model": "m", "prompt": "hi", "top_p": 1e999}', False, "top_p", "finite number"),
        ({**PROMPT, "top_p": 0}, False, "top_p", "'top_p'=0.0; it must be in (0, 1]"),
        ({**PROMPT, "seed": -1}, False, "seed", "'seed'=-1; it must be in 0 .. 2**63-1"),
        ({**PROMPT, "shared_prefix_tokens": -2}, False, "shared_prefix_tokens", "it must be ≥ 0"),
        ({**PROMPT, "session_id": 5}, False, "session_id", "must be a string"),
        (
            {**PROMPT, "stream_options": {"include_usage": "yes"}},
            False,
            "stream_options.include_usage",
            "boolean",
        ),
        ({**PROMPT, "stream_options": []}, False, "stream_options", "must be an object, got array"),
        (
            {**PROMPT, "best_of": 2},
            False,
            "best_of",
            "'best_of'=2 is not supported by this server (accepted: 1)",
        ),
        ({**PROMPT, "echo": 1}, False, "echo", "'echo' must be a boolean, got integer"),
        ({**PROMPT, "logprobs": 21}, False, "logprobs", "'logprobs'=21; it must be in 0..20"),
        ({**PROMPT, "logprobs": True}, False, "logprobs", "'logprobs' must be an integer, got boolean"),
        ({**PROMPT, "n": 0}, False, "n", "'n'=0; it must be in 1..64"),
        (
            {**PROMPT, "max_tokens": -1},
            False,
            "max_tokens",
            "'max_tokens'=-1; it must be ≥ 0 (0 only with echo: true)",
        ),
        ({**PROMPT, "logit_bias": {"5": 1}}, False, "logit_bias", "drop the field"),
        ({"model": "m", "prompt": []}, False, "prompt", "non-empty array of token ids, got array"),
        ({"model": "m", "prompt": [1, True]}, False, "prompt", "got array"),
        ({"model": "m", "prompt": [3, -1]}, False, "prompt", "token ids outside 0..99: [-1]"),
        ({"model": "m", "prompt": None}, False, "prompt", "'prompt' is required"),
        (
            {**CHAT, "max_completion_tokens": 0},
            True,
            "max_completion_tokens",
            "'max_completion_tokens'=0; it must be ≥ 1",
        ),
        ({**CHAT, "logprobs": 1}, True, "logprobs", "'logprobs' must be a boolean, got integer"),
        ({**CHAT, "top_logprobs": 2}, True, "top_logprobs", "'top_logprobs'=2 needs \"logprobs\": true"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "it must be in 0..20"),
        ({**CHAT, "max_tokens": 0}, True, "max_tokens", "'max_tokens'=0; it must be ≥ 1"),
        ({**CHAT, "echo": True, "n": 65}, True, "n", "'n'=65; it must be in 1..64"),
        ({**CHAT, "tools": {}}, True, "tools", "must be an array"),
        ({"model": "m"}, True, "messages", "'messages' is required"),
        (
            {"model": "m", "messages": [7]},
            True,
            "messages[0]",
            "'messages[0]' must be an object, got integer",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "", "content": "b"}]},
            True,
            "messages[1].role",
            "must be a string (system, user, assistant, tool)",
        ),
        (
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}
                ],
            },
            True,
            "messages[0].content",
            "'messages[0].content[1]' must be a text part",
        ),
    ],
)
def test_bad_bodies_name_the_field(body, chat, param, message):
    err = _error(body, chat)
    assert err.param == param and message in err.message, (err.param, err.message)


def test_valid_bodies_and_defaults():
    r = parse_request(
        _raw(
            {
                **PROMPT,
                "n": 1,
                "logprobs": 0,
                "echo": False,
                "user": "someone",
                "stop": ["", "##"],
                "presence_penalty": 0,
            }
        ),
        chat=False,
    )
    assert isinstance(r, CompletionRequest)
    assert (
        r.prompt == "hi"
        and r.stop == ["##"]
        and r.new_tokens(16) == 16
        and r.max_tokens_field == "max_tokens"
    )
    assert r.sampling() == SamplingParams() and not r.stream and not r.include_usage
    assert parse_request(_raw({**PROMPT, "stop": ""}), chat=False).stop is None
    assert parse_request(_raw({"model": "m", "prompt": [[5, 6, 7]]}), chat=False).prompt == [
        5,
        6,
        7,
    ]  # batch of one
    assert parse_request(_raw({"model": "m", "prompt": ["x"], "max_tokens": None}), chat=False).prompt == "x"
    s = parse_request(_raw({**PROMPT, "temperature": 1, "top_p": 0.5, "seed": 3}), chat=False).sampling()
    assert s == SamplingParams(do_sample=True, temperature=1.0, top_p=0.5, seed=3)

    c = parse_request(
        _raw(
            {
                "model": "m",
                "max_tokens": 9,
                "max_completion_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
                "tools": [{"type": "function"}],
                "messages": [
                    {"role": "system", "content": None},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                        "name": "u",
                    },
                ],
            }
        ),
        chat=True,
    )
    assert isinstance(c, ChatCompletionRequest)
    assert c.new_tokens(256) == 4 and c.max_tokens_field == "max_completion_tokens" and c.include_usage
    assert [m.template_dict() for m in c.messages] == [
        {"role": "system", "content": ""},
        {"name": "u", "role": "user", "content": "ab"},
    ]


def test_reply_shapes():
    from ccft.core.generation import Generation

    g = Generation("out", [4, 5], "eos")
    r = Reply(False, "m", [1, 2, 3], return_token_ids=True)
    body = r.completion(g)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [
        {
            "text": "out",
            "index": 0,
            "finish_reason": "stop",
            "logprobs": None,
            "prompt_token_ids": [1, 2, 3],
            "token_ids": [4, 5],
        }
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chat = Reply(True, "m", [1], include_usage=True)
    first = chat.chunk("", [], first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    assert chat.chunk("", [9])["choices"][0]["delta"] == {}
    assert chat.usage_chunk(g)["choices"] == [] and chat.completion(g)["object"] == "chat.completion"


def test_surrogate_pairs_are_text():
    """A UTF-16 surrogate pair is the character it encodes (only a lone surrogate is refused)."""
    r = parse_request(b'{"model": "m", "prompt": "a \\ud83d\\ude00 b"}', chat=False)
    assert r.prompt == "a \U0001f600 b"
