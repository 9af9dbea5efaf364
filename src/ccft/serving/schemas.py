"""Wire format of ``ccft serve``: request bodies as pydantic models, the OpenAI error object, and the
response / stream-chunk shapes.

Request bodies are validated by pydantic in strict JSON mode (``"5"`` is not an integer, ``true`` is
not a number, ``NaN`` / ``Infinity`` are refused), as OpenAI-compatible servers do. A body that does
not validate is answered 400 with an OpenAI error object naming the first offending field in
``param`` (``max_tokens``, ``stream_options.include_usage``, ``messages[0].content``) and a message
that says what to send instead (docs/design.md, fault class K9: hostile requests get an answer,
not a crash). Unknown fields are ignored (clients send ``user``, ``metadata``, ...); fields of the
OpenAI API this server does not implement (penalties, ``logit_bias``, ``best_of``, ``suffix``,
``response_format``) are accepted only with their no-op value. ``n``, ``logprobs`` /
``top_logprobs`` and ``echo`` are implemented (docs/serving.md, "OpenAI fields").

The ccft extensions of the request (``shared_prefix_tokens``, ``ignore_eos``, ``return_token_ids``,
``session_id``) are documented on ``CompletionRequest`` and in ``docs/server.md``.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from ccft.serving.extra import serve_extra_missing

try:
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
    from pydantic_core import PydanticCustomError
except ImportError as e:  # pragma: no cover - depends on the installation
    raise serve_extra_missing(e) from e

from ccft.core.generation import Generation
from ccft.core.sampling import DecodeParams, SamplingParams

__all__ = [
    "APIError",
    "error_response",
    "FINISH_REASONS",
    "json_type",
    "StreamOptions",
    "ChatMessage",
    "CompletionRequest",
    "ChatCompletionRequest",
    "parse_request",
    "Reply",
    "LogprobText",
    "TokenLogprob",
    "MAX_N",
    "MAX_LOGPROBS",
    "AssistantMessage",
    "ChatChoice",
    "ChatChunkChoice",
    "CompletionChoice",
    "CompletionResponse",
    "Delta",
    "Usage",
]

#: most choices (``n``) one request may ask for
MAX_N = 64
#: most top log-probabilities per token (``logprobs`` of a completion, ``top_logprobs`` of a chat), as
#: OpenAI's 20
MAX_LOGPROBS = 20

#: Generation.finish_reason → OpenAI finish_reason
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


# ---------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered as an OpenAI error object ``{"error": {message, type, param, code}}`` with HTTP
    ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, type=self.type, param=self.param, code=self.code, headers=self.headers
        )


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    """The OpenAI-shaped error response ``{"error": {"message", "type", "param", "code"}}``.

    ``message`` and ``param`` may quote the request; a lone surrogate there is written as its ``\\uXXXX``
    escape, so an error about hostile text can always be sent (docs/design.md, fault class K9)."""
    return JSONResponse(
        {"error": {"message": _sendable(message), "type": type, "param": _sendable(param), "code": code}},
        status_code=status,
        headers=headers,
    )


def _sendable(text: str | None) -> str | None:
    """``text`` with lone surrogates (not encodable as UTF-8) replaced by their backslash escapes."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_type(v: Any) -> str:
    """The JSON type name of a parsed JSON value (``null``, ``string``, ``integer``, ``number``, ...)."""
    return (
        "null"
        if v is None
        else {
            "str": "string",
            "int": "integer",
            "float": "number",
            "bool": "boolean",
            "list": "array",
            "dict": "object",
        }.get(type(v).__name__, type(v).__name__)
    )


def _invalid(detail: str, sub: str = "") -> PydanticCustomError:
    """A validation error whose message is ``'<field><sub>'<detail>`` (the field path is filled in from its
    location)."""
    return PydanticCustomError("ccft_invalid", "{detail}", {"detail": detail, "sub": sub})


_TYPE_NAMES = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
}


def _param(loc: tuple) -> str:
    """A pydantic error location as a field path: ``("messages", 0, "content")`` → ``messages[0].content``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _api_error(err: dict) -> APIError:
    """The 400 ``APIError`` of one pydantic error (the first one of a ``ValidationError``)."""
    kind, loc, value = err["type"], tuple(err["loc"]), err.get("input")
    if not loc:  # the body itself
        if kind == "json_invalid":
            why = (err.get("ctx") or {}).get("error", err["msg"])
            return APIError(400, f"the request body is not valid JSON ({why}); send a JSON object")
        return APIError(400, f"the request body must be a JSON object, got {json_type(value)}")
    param = _param(loc)
    if kind == "ccft_invalid":
        message = f"'{param}{err['ctx']['sub']}'{err['ctx']['detail']}"
    elif kind == "missing":
        message = f"'{param}' is required"
    elif kind in _TYPE_NAMES:
        message = f"'{param}' must be {_TYPE_NAMES[kind]}, got {json_type(value)} ({json.dumps(value)[:80]})"
    elif kind == "finite_number":
        message = f"'{param}' must be a finite number, got {value}"
    else:  # pragma: no cover - every constraint of the models below is one of the kinds above
        message = f"'{param}': {err['msg']}"
    return APIError(400, message, param=param)


# ---------------------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` (and ``"usage": null`` to the
    others)."""

    include_usage: bool | None = None


class ChatMessage(BaseModel):
    """One chat message. ``content``: a string or a list of text parts (joined); other keys (``name``,
    ``tool_calls``, ...) are passed to the chat template as they are."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Any = Field(None, validate_default=True)
    content: Any = Field(None, validate_default=True)

    @field_validator("role")
    @classmethod
    def _role(cls, role: Any) -> str:
        if not isinstance(role, str) or not role:
            raise _invalid(" must be a string (system, user, assistant, tool)")
        return role

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any) -> str:
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise _invalid(
                        ' must be a text part ({"type": "text", "text": ...}); other parts are not supported',
                        sub=f"[{j}]",
                    )
                texts.append(part["text"])
            return "".join(texts)
        if content is None:
            return ""
        if not isinstance(content, str):
            raise _invalid(f" must be a string or an array of text parts, got {json_type(content)}")
        return content

    def template_dict(self) -> dict:
        """The message as the chat template reads it (extra keys first, then ``role`` and ``content``)."""
        return {**(self.model_extra or {}), "role": self.role, "content": self.content}


_NOT_IMPLEMENTED = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},)}


class _GenerationRequest(_Strict):
    """The options both endpoints share (see ``CompletionRequest``)."""

    #: fields of the OpenAI API this server does not implement → the no-op values it accepts
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple]] = _NOT_IMPLEMENTED
    #: the smallest ``max_tokens`` accepted (a completion with ``echo`` may ask for 0: score the prompt only)
    MIN_MAX_TOKENS: ClassVar[int] = 1

    # not implemented (declared first: they are reported before anything else)
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    # the OpenAI options
    model: str
    n: int | None = None
    max_tokens: int | None = None
    stop: Any = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # ccft extensions
    shared_prefix_tokens: int | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    session_id: str | None = None

    @field_validator("*")
    @classmethod
    def _not_implemented(cls, v: Any, info: ValidationInfo) -> Any:
        ok = cls.NOT_IMPLEMENTED.get(info.field_name)
        if ok is not None and v is not None and v not in ok:
            raise _invalid(
                f"={json.dumps(v)[:80]} is not supported by this server (accepted: "
                f"{', '.join(json.dumps(o) for o in ok)}); drop the field"
            )
        return v

    @field_validator("max_tokens")
    @classmethod
    def _at_least_one(cls, v: int | None) -> int | None:
        if v is not None and v < cls.MIN_MAX_TOKENS:
            extra = " (0 only with echo: true)" if cls.MIN_MAX_TOKENS == 0 else ""
            raise _invalid(f"={v}; it must be ≥ {cls.MIN_MAX_TOKENS}{extra}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_N:
            raise _invalid(f"={v}; it must be in 1..{MAX_N}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> list[str] | None:
        if stop is None:
            return None
        if isinstance(stop, str):
            return [stop] if stop else None
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return [s for s in stop if s] or None
        raise _invalid(f" must be a string or an array of strings, got {json_type(stop)}")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and v < 0:
            raise _invalid(f"={v}; it must be ≥ 0 (0: greedy)")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise _invalid(f"={v}; it must be in (0, 1]")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < 2**63:
            raise _invalid(f"={v}; it must be in 0 .. 2**63-1")
        return v

    @field_validator("shared_prefix_tokens")
    @classmethod
    def _shared(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise _invalid(f"={v}; it must be ≥ 0")
        return v

    # ------------------------------------------------------------------ what the server does with it
    @property
    def max_tokens_field(self) -> str:
        """The field that set the token budget (named in length errors)."""
        return "max_tokens"

    def new_tokens(self, default: int) -> int:
        """``max_tokens`` (``default`` when absent)."""
        return default if self.max_tokens is None else self.max_tokens

    def sampling(self, choice: int = 0) -> SamplingParams:
        """Greedy when ``temperature`` is 0 or absent; else nucleus sampling seeded by ``seed`` + ``choice``
        (mod 2**63; the ``n`` choices draw with seeds seed, seed+1, ...), a fresh random seed without
        one: call once per choice. ``ccft.core.sampling``, docs/design.md "Sampling"."""
        if not self.temperature:
            return SamplingParams()
        return SamplingParams(
            do_sample=True,
            temperature=float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            seed=secrets.randbits(63) if self.seed is None else (self.seed + choice) % 2**63,
        )

    def decode_params(self, max_tokens: int, choice: int = 0) -> DecodeParams:
        """The request's decoding settings whole (``DecodeParams``) for choice ``choice``: ``max_tokens``,
        ``stop``, ``ignore_eos``, ``sampling(choice)`` and the generated tokens' logprobs."""
        return DecodeParams(
            max_new_tokens=int(max_tokens),
            stop=self.stop,
            ignore_eos=bool(self.ignore_eos),
            sampling=self.sampling(choice),
            logprobs=self.token_logprobs,
        )

    @property
    def choices(self) -> int:
        """``n`` (1 when absent)."""
        return 1 if self.n is None else self.n

    @property
    def token_logprobs(self) -> int | None:
        """None (no logprobs), or how many top logprobs each generated token reports."""
        return None

    @property
    def echo_prompt(self) -> bool:
        """Whether the response starts with the prompt (completions' ``echo``)."""
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    """The body of ``POST /v1/completions``.

    ``prompt``: a string (tokenized as ``tokenize_prompt(tokenizer, prompt, chat_template=False)``), a
    non-empty list of token ids (used as they are; each in ``0 .. vocab_size-1``, the vocabulary size
    passed as validation context ``{"vocab_size": n}``), or a batch of one of either. ``max_tokens``
    (≥ 1; default 16, as OpenAI), ``stop`` (a string or a list; empty strings ignored),
    ``temperature`` (≥ 0; 0 or absent: greedy) / ``top_p`` (in (0, 1]) / ``seed`` (0 .. 2**63-1),
    ``stream`` and ``stream_options.include_usage``. ``n`` (1..64) choices; ``logprobs`` (0..20: the
    sampled token's logprob and that many top tokens per position, OpenAI's legacy format);
    ``echo`` (the prompt, and with ``logprobs`` its tokens' logprobs, precede the completion;
    ``max_tokens`` may then be 0).

    ccft extensions: ``shared_prefix_tokens`` (≥ 0: leading prompt tokens that are context shared
    with other requests, ``ServeRequest.shared_len``), ``ignore_eos``, ``return_token_ids``,
    ``session_id``, ``echo_context_tokens`` (with ``echo`` and ``logprobs``: the prompt's first c
    tokens are a context, the rest one continuation scored as the decoder generating it;
    ``ccft.inference.scoring``, docs/serving.md "Log-probabilities").
    """

    NOT_IMPLEMENTED: ClassVar[dict[str, tuple]] = {**_NOT_IMPLEMENTED, "best_of": (1,), "suffix": ("",)}
    MIN_MAX_TOKENS: ClassVar[int] = 0

    best_of: Any = None
    suffix: Any = None
    echo: bool | None = None
    logprobs: int | None = None
    echo_context_tokens: int | None = None
    prompt: Any = Field(None, validate_default=True)

    @field_validator("echo_context_tokens")
    @classmethod
    def _echo_context(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is None:
            return v
        if not (info.data.get("echo") and info.data.get("logprobs") is not None):
            raise _invalid(' scores the prompt: it needs "echo": true and "logprobs"; set them or drop it')
        if v < 1:
            raise _invalid(f"={v}; it must be ≥ 1 (the context's tokens)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise _invalid(f"={v}; it must be in 0..{MAX_LOGPROBS} (the top log-probabilities per token)")
        return v

    @property
    def token_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_prompt(self) -> bool:
        return bool(self.echo)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, p: Any, info: ValidationInfo) -> str | list[int]:
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            vocab = (info.context or {}).get("vocab_size")
            bad = [t for t in p if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                span = f"0..{vocab - 1}" if vocab is not None else "0.."
                raise _invalid(f" holds token ids outside {span}: {bad[:5]}")
            return list(p)
        if p is None:
            raise _invalid(" is required")
        if isinstance(p, list) and p and all(isinstance(t, (str, list)) for t in p):
            raise _invalid(f" holds {len(p)} prompts; this server takes one prompt per request")
        raise _invalid(f" must be a string or a non-empty array of token ids, got {json_type(p)}")


class ChatCompletionRequest(_GenerationRequest):
    """The body of ``POST /v1/chat/completions``: ``messages`` (a non-empty list of ``ChatMessage``),
    ``tools`` (rendered by the chat template; tool calls are not parsed), ``max_completion_tokens``
    (an alias of ``max_tokens`` that wins when both are set), ``logprobs`` (true: each choice's
    ``logprobs.content`` lists its tokens with their logprobs) with ``top_logprobs`` (0..20) and the
    options of ``CompletionRequest`` (``n`` included; not ``echo``)."""

    NOT_IMPLEMENTED: ClassVar[dict[str, tuple]] = {**_NOT_IMPLEMENTED, "response_format": ({"type": "text"},)}

    response_format: Any = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    messages: list[ChatMessage] | None = Field(None, validate_default=True)
    tools: list[Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise _invalid(f"={v}; it must be in 0..{MAX_LOGPROBS}")
        if v and not info.data.get("logprobs"):
            raise _invalid(f'={v} needs "logprobs": true; set it (or drop top_logprobs)')
        return v

    @property
    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("max_completion_tokens")
    @classmethod
    def _at_least_one_completion(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise _invalid(f"={v}; it must be ≥ 1")
        return v

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[ChatMessage] | None) -> list[ChatMessage]:
        if messages is None:
            raise _invalid(" is required")
        if not messages:
            raise _invalid(" is empty; send at least one message")
        return messages

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def new_tokens(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().new_tokens(default)


def parse_request(
    raw: bytes | str, *, chat: bool, vocab_size: int | None = None
) -> CompletionRequest | ChatCompletionRequest:
    """Validate a raw request body (JSON bytes) for ``/v1/chat/completions`` (``chat``) or
    ``/v1/completions``.

    Raises:
        APIError: 400 naming the first field that does not validate (``param``), or the body when it
            is not a JSON object; a string holding a lone UTF-16 surrogate (``"\\ud83d"``, text no
            tokenizer can encode) is refused naming its field (docs/design.md, fault class K9).
    """
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate_json(raw, context={"vocab_size": vocab_size})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            found = _lone_surrogate(raw)
            if found is not None:
                path, char = found
                raise APIError(
                    400,
                    f"'{path}' holds a lone UTF-16 surrogate (\\u{ord(char):04x}), which is not "
                    "valid JSON text for this server; send the character itself or a surrogate "
                    "pair",
                    param=path,
                ) from None
        raise _api_error(err) from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(raw: bytes | str) -> tuple[str, str] | None:
    """(field path, surrogate) of the first string (key or value) of ``raw`` holding a lone surrogate, if the
    body is JSON once lone surrogates are allowed (Python's ``json`` allows them; pydantic does not)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    stack: deque[tuple[Any, tuple]] = deque([(value, ())])  # breadth first: the first field in document order
    while stack:
        v, loc = stack.popleft()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m:
                return _param(loc) or "(body)", m.group()
        elif isinstance(v, dict):
            for k, item in v.items():
                m = _SURROGATE.search(k)
                if m:
                    return _param(loc + (k,)), m.group()
                stack.append((item, loc + (k,)))
        elif isinstance(v, list):
            stack.extend((item, loc + (j,)) for j, item in enumerate(v))
    return None


# ---------------------------------------------------------------------------------------- responses
#: one token's log-probabilities: (logprob, [(top id, logprob), ...]); None for a prompt's first token
TokenLogprob = tuple[float, list[tuple[int, float]]]


# ------------------------------------------------------------- responses (OpenAI's shapes, ccft's extensions)
class _Out(BaseModel):
    """A response object: fields left unset (an extension not asked for) are left out of the JSON
    (``body()``: ``model_dump(exclude_unset=True)``); fields set to None are written as null."""

    model_config = ConfigDict(extra="forbid")

    def body(self) -> dict:
        return self.model_dump(exclude_unset=True)


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(_Out):
    role: str  # "assistant" (set explicitly: an unset field is left out)
    content: str


class Delta(_Out):
    """A chat stream chunk's delta: the role in the first chunk, then content (an empty delta at the end)."""

    role: str | None = None
    content: str | None = None


class _Choice(_Out):
    index: int
    finish_reason: str | None
    logprobs: dict | None
    prompt_token_ids: list[int] | None = None  # ``return_token_ids`` (as vLLM)
    token_ids: list[int] | None = None


class CompletionChoice(_Choice):
    text: str


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatChunkChoice(_Choice):
    delta: Delta


class CompletionResponse(_Out):
    """``/v1/completions`` and ``/v1/chat/completions`` bodies and their stream chunks (``object`` tells
    which)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice | ChatChoice | ChatChunkChoice]
    usage: Usage | None = None


class LogprobText:
    """Token ids → the token strings, bytes and offsets of OpenAI's logprobs objects (one tokenizer, one
    thread).

    A token's string is ``tokenizer.decode([id])`` (a token that ends inside a multi-byte UTF-8
    character shows U+FFFD); its ``bytes`` are that string's UTF-8 bytes. Strings are memoised.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = self._text[token_id] = self.tokenizer.decode([int(token_id)])
        return s

    def completion(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int = 0) -> dict:
        """The legacy completions object ``{tokens, token_logprobs, top_logprobs, text_offset}``.

        ``top_logprobs[i]``: ``{token string: logprob}`` of the top tokens (None where ``entries[i]`` is);
        ``text_offset[i]``: ``offset`` + the length of the token strings before token i.
        """
        tokens, lps, tops, offsets = [], [], [], []
        for tok, e in zip(ids, entries, strict=True):
            s = self.text(tok)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            lps.append(None if e is None else e[0])
            tops.append(None if e is None else {self.text(t): lp for t, lp in e[1]})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, ids: Sequence[int], entries: Sequence[TokenLogprob]) -> dict:
        """The chat object ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
        bytes}]}]}``."""

        def one(t: int, lp: float) -> dict:
            s = self.text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "backslashreplace"))}

        return {
            "content": [
                {**one(tok, e[0]), "top_logprobs": [one(t, lp) for t, lp in e[1]]}
                for tok, e in zip(ids, entries, strict=True)
            ]
        }


@dataclass
class Reply:
    """The response shapes of one request: the JSON body (``completion``) or its stream chunks.

    ``rid``: ``cmpl-…`` / ``chatcmpl-…``; ``created``: Unix seconds. With ``return_token_ids`` each
    choice carries ``token_ids`` (the first stream chunk and the JSON body also ``prompt_token_ids``).
    ``logprobs``: None (``"logprobs": null`` in every choice), else the top count each token reports
    (the entries come from the scheduler's tickets; ``tokens`` formats them, ``LogprobText``).
    ``echo``: a completion's text starts with ``prompt_text`` (and its logprobs with the prompt's).
    """

    chat: bool
    model: str
    prompt_ids: list[int]
    return_token_ids: bool = False
    include_usage: bool = False
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: int | None = None
    echo: bool = False
    prompt_text: str = ""
    tokens: LogprobText | None = None

    def __post_init__(self):
        if not self.rid:
            self.rid = f"{'chatcmpl' if self.chat else 'cmpl'}-{secrets.token_hex(12)}"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def usage(self, completion_tokens: int) -> Usage:
        n = len(self.prompt_ids)
        return Usage(prompt_tokens=n, completion_tokens=completion_tokens, total_tokens=n + completion_tokens)

    def logprobs_of(
        self, ids: Sequence[int], entries: Sequence | None, *, offset: int = 0, prompt: Sequence | None = None
    ) -> dict | None:
        """The choice's ``logprobs`` object for generated ``ids`` (None without ``logprobs``). ``prompt``:
        the prompt's entries (``echo``), placed before the generated tokens; ``offset``: text offset of the
        first token."""
        if self.logprobs is None or self.tokens is None:
            return None
        entries = list(entries or [])
        if len(entries) != len(ids):  # pragma: no cover - the scheduler records one entry per token
            raise ValueError(f"{len(ids)} tokens but {len(entries)} logprob entries")
        if self.chat:
            return self.tokens.chat(ids, entries)
        if prompt is not None:
            return self.tokens.completion(list(self.prompt_ids) + list(ids), list(prompt) + entries, offset)
        return self.tokens.completion(ids, entries, offset)

    def completion(
        self,
        g: Generation | Sequence[Generation],
        logprobs: Sequence | None = None,
        prompt_logprobs: Sequence | None = None,
    ) -> dict:
        """The non-streaming response body of finished ``Generation``s (one per choice, or one).

        ``logprobs``: per choice, its tokens' entries (``Ticket.token_logprobs``); ``prompt_logprobs``:
        the prompt's entries (``Ticket.prompt_logprobs``), used with ``echo``."""
        gens = [g] if isinstance(g, Generation) else list(g)
        choices = []
        for i, gen in enumerate(gens):
            finish = FINISH_REASONS.get(gen.finish_reason, gen.finish_reason)
            entries = logprobs[i] if logprobs is not None else None
            ids = (
                {"prompt_token_ids": list(self.prompt_ids), "token_ids": list(gen.token_ids)}
                if self.return_token_ids
                else {}
            )
            if self.chat:
                choice = ChatChoice(
                    index=i,
                    message=AssistantMessage(role="assistant", content=gen.text),
                    finish_reason=finish,
                    logprobs=self.logprobs_of(gen.token_ids, entries),
                    **ids,
                )
            else:
                text = (self.prompt_text if self.echo else "") + gen.text
                lp = self.logprobs_of(
                    gen.token_ids,
                    entries,
                    prompt=(prompt_logprobs or [None] * len(self.prompt_ids)) if self.echo else None,
                )
                choice = CompletionChoice(text=text, index=i, finish_reason=finish, logprobs=lp, **ids)
            choices.append(choice)
        return CompletionResponse(
            id=self.rid,
            object="chat.completion" if self.chat else "text_completion",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(sum(len(gen.token_ids) for gen in gens)),
        ).body()

    def chunk(
        self,
        text: str,
        ids: list[int],
        finish: str | None = None,
        *,
        first: bool = False,
        index: int = 0,
        logprobs: dict | None = None,
    ) -> dict:
        """One stream chunk of choice ``index``: ``text`` with the ``ids`` that produced it (chat: a
        ``delta``, with the role in the ``first`` chunk) and their ``logprobs`` object (``logprobs_of``)."""
        extra: dict = {}
        if self.return_token_ids:
            extra["token_ids"] = list(ids)
            if first:
                extra["prompt_token_ids"] = list(self.prompt_ids)
        if self.chat:
            delta = (
                Delta(role="assistant", content=text) if first else (Delta(content=text) if text else Delta())
            )
            choice = ChatChunkChoice(
                index=index, delta=delta, finish_reason=finish, logprobs=logprobs, **extra
            )
        else:
            choice = CompletionChoice(
                text=text, index=index, finish_reason=finish, logprobs=logprobs, **extra
            )
        out = CompletionResponse(
            id=self.rid, object=self.chunk_object, created=self.created, model=self.model, choices=[choice]
        )
        if self.include_usage:
            out.usage = None  # a set field: written as null in every chunk but the last
        return out.body()

    def usage_chunk(self, g: Generation | Sequence[Generation]) -> dict:
        """The last chunk of a stream with ``include_usage``: no choices, the usage (tokens of every
        choice)."""
        gens = [g] if isinstance(g, Generation) else list(g)
        return CompletionResponse(
            id=self.rid,
            object=self.chunk_object,
            created=self.created,
            model=self.model,
            choices=[],
            usage=self.usage(sum(len(gen.token_ids) for gen in gens)),
        ).body()
