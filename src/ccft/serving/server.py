"""``create_app``: an OpenAI-compatible HTTP server over a ``Scheduler`` (``ccft serve``).

Every decoder of the scheduler's engine is a *model* (``"base"`` is the base model itself); all of
them decode on the base's shared prefill. Endpoints:

* ``POST /v1/completions``: ``model``, ``prompt`` (a string, tokenized as
  ``ccft.data.tokenize_prompt(tokenizer, prompt, chat_template=False)``, or a list of token ids,
  used as they are), ``max_tokens`` (default 16), ``stop`` (a string or a list),
  ``temperature`` / ``top_p`` / ``seed`` (``temperature`` 0 or absent: greedy decoding, the default;
  > 0: sampling, seeded by ``seed`` or a random seed), ``stream`` (server-sent events
  ``data: {...}`` then ``data: [DONE]``; ``stream_options: {"include_usage": true}`` adds a final
  usage chunk). The response carries ``id``, ``object``, ``created``, ``model``,
  ``choices[{text, index, finish_reason, logprobs: null}]`` and ``usage``. ``finish_reason``:
  ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_tokens`` reached).
* ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template
  (``add_generation_prompt=True``; ``tools`` are rendered too, tool calls are not parsed), the
  same options (``max_completion_tokens`` is an alias of ``max_tokens``; default
  ``default_max_tokens``), chat-shaped responses (``message``) and stream chunks (``delta``; the
  first chunk also carries the role).
* ``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health``, ``GET /metrics`` (Prometheus
  text format, one registry per app; see ``ServerMetrics``).

ccft extensions of the request (not in the OpenAI API):

* ``shared_prefix_tokens``: how many leading prompt tokens are context shared with other requests
  (``ServeRequest.shared_len``; default: the whole prompt). Requests that read the same shared
  context while it is live decode on one prefill of it; the rest of each prompt is computed per
  request. A placement hint only: the output does not depend on it.
* ``ignore_eos``: decode ``max_tokens`` tokens whatever the model emits (benchmarks).
* ``return_token_ids``: add ``prompt_token_ids`` and ``token_ids`` to each choice (and the ids of
  each stream chunk's tokens to the chunk's choice).
* ``session_id``: the caller's session (``ServeRequest.session_id``).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: a malformed body or a
missing / wrong-typed / unsupported field → 400 naming the field; an unknown model → 404 listing the
served ones; a prompt that can never be served (``PromptTooLongError``, or prompt + ``max_tokens``
beyond the model's positions) → 400 with code ``context_length_exceeded``; a full queue
(``QueueFullError``) → 503 with ``Retry-After``; a request the engine failed → 500. When a client
disconnects before its response is complete (streaming or not), its ticket is cancelled: the
scheduler aborts the engine row and frees its KV.

Threading: the scheduler loop runs in its own thread (``Scheduler.start``, started in the app's
lifespan unless it already runs, stopped on shutdown when the app started it). Its callbacks only
hand tokens to the asyncio loop (``loop.call_soon_threadsafe`` into a per-request queue); text is
decoded on the loop with the app's own copy of the tokenizer.

Example::

    from ccft.serving.server import BackgroundServer, create_app
    app = create_app(Scheduler(engine, store=PrefixKVStore()), base.tokenizer)
    with BackgroundServer(app, port=8000) as srv:   # or: uvicorn.run(app, port=8000)
        ...                                         # POST srv.url + "/v1/completions"
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, Mapping, Sequence

try:
    import prometheus_client as prom
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(f"ccft's HTTP server needs the `serve` extra ({e.name} is missing): "
                      "pip install 'ccft[serve]'") from e

from ccft.core.errors import CCFTError, ConfigError
from ccft.core.tokens import tokenize_prompt
from ccft.inference import BASE, SamplingParams
from ccft.serving.scheduler import PromptTooLongError, QueueFullError, Scheduler, ServeRequest, Ticket
from ccft.serving.text_stream import IncrementalDetokenizer

log = logging.getLogger(__name__)

__all__ = ["create_app", "BackgroundServer", "ServerMetrics", "APIError", "FINISH_REASONS"]

#: Generation.finish_reason → OpenAI finish_reason
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
#: latency histogram buckets (seconds): CPU serving reaches tens of seconds under load
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_DONE = object()
_MISSING = object()


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return _error_response(self.status, self.message, type=self.type, param=self.param, code=self.code,
                               headers=self.headers)


def _error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                    code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------- metrics
class ServerMetrics:
    """Prometheus metrics of one app, in their own ``CollectorRegistry`` (``registry``).

    Histograms by ``model``: ``ccft_time_to_first_token_seconds`` (submit → first token, measured
    by the scheduler), ``ccft_time_per_output_token_seconds`` (mean per token after the first, one
    observation per request), ``ccft_e2e_request_latency_seconds`` (submit → end of a completed
    request). Counters: ``ccft_requests_total{model, outcome}`` with outcome ``stop`` / ``length``
    (completed, by finish reason), ``cancelled`` (client went away), ``error`` (engine failure),
    ``queue_full``, ``prompt_too_long``, ``invalid`` (400), ``unknown_model`` (404, model "");
    ``ccft_prompt_tokens_total`` and ``ccft_generation_tokens_total`` by model. Read from the
    scheduler at scrape time: gauges ``ccft_queue_depth``, ``ccft_active_requests``,
    ``ccft_live_kv_bytes`` (``Scheduler.live_bytes``), ``ccft_prefix_store_bytes``,
    ``ccft_prefix_hit_ratio`` (context tokens copied from the prefix store / context tokens of
    every prefill; a context already live is not prefilled again and is not counted),
    ``ccft_kv_budget_bytes`` (when set) and counters ``ccft_scheduler_<name>_total`` for the
    scheduler's counters (prefills, prefill_tokens, prefix_hit_tokens, decode_steps, ...).
    """

    SCHEDULER_COUNTERS = ("submitted", "admitted", "prefills", "prefill_tokens", "prefix_hit_tokens", "decode_steps",
                          "decode_rows", "admission_waits", "done", "cancelled", "error", "rejected_queue_full")

    def __init__(self, scheduler: Scheduler):
        self.registry = prom.CollectorRegistry()
        self.scheduler = scheduler
        r = self.registry
        self.ttft = prom.Histogram("ccft_time_to_first_token_seconds", "Seconds from submit to the first token",
                                   ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = prom.Histogram("ccft_time_per_output_token_seconds",
                                   "Mean seconds per output token after the first (one observation per request)",
                                   ["model"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = prom.Histogram("ccft_e2e_request_latency_seconds",
                                  "Seconds from submit to the end of a completed request", ["model"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.requests = prom.Counter("ccft_requests", "Requests by outcome", ["model", "outcome"], registry=r)
        self.prompt_tokens = prom.Counter("ccft_prompt_tokens", "Prompt tokens of completed requests", ["model"],
                                          registry=r)
        self.generation_tokens = prom.Counter("ccft_generation_tokens", "Tokens generated (every request)",
                                              ["model"], registry=r)
        r.register(_SchedulerCollector(scheduler, self.SCHEDULER_COUNTERS))

    def finished(self, model: str, ticket: Ticket) -> None:
        """Record a ticket that ended (on the asyncio loop)."""
        if ticket.ttft is not None:
            self.ttft.labels(model).observe(ticket.ttft)
        self.generation_tokens.labels(model).inc(len(ticket.tokens))
        if ticket.state == "done" and ticket.result is not None:
            if ticket.latency is not None:
                self.e2e.labels(model).observe(ticket.latency)
            if ticket.tpot is not None:
                self.tpot.labels(model).observe(ticket.tpot)
            self.prompt_tokens.labels(model).inc(len(ticket.request.prompt_ids))
            outcome = FINISH_REASONS.get(ticket.result.finish_reason, ticket.result.finish_reason)
        else:
            outcome = ticket.state
        self.requests.labels(model, outcome).inc()

    def rejected(self, model: str, outcome: str) -> None:
        self.requests.labels(model, outcome).inc()

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


class _SchedulerCollector:
    """Scheduler gauges and counters, read when /metrics is scraped."""

    def __init__(self, scheduler: Scheduler, counter_names: Sequence[str]):
        self.s, self.names = scheduler, counter_names

    def describe(self):
        return []  # collected lazily; nothing to check at registration

    def collect(self):
        s = self.s
        counters = s.counters

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=float(value))

        yield gauge("ccft_queue_depth", "Requests waiting for admission", s.queue_depth)
        yield gauge("ccft_active_requests", "Requests decoding in the engine", s.active)
        yield gauge("ccft_live_kv_bytes", "Live KV bytes: context handles + tail slots reserved by active requests",
                    s.live_bytes)
        yield gauge("ccft_prefix_store_bytes", "Bytes of K/V blocks in the prefix store", s.store_bytes)
        hit, miss = counters.get("prefix_hit_tokens", 0), counters.get("prefill_tokens", 0)
        yield gauge("ccft_prefix_hit_ratio", "Context tokens copied from the prefix store / context tokens prefilled",
                    hit / (hit + miss) if hit + miss else 0.0)
        if s.kv_budget_bytes is not None:
            yield gauge("ccft_kv_budget_bytes", "KV byte budget (live KV + prefix store)", s.kv_budget_bytes)
        for name in self.names:
            c = CounterMetricFamily(f"ccft_scheduler_{name}", f"Scheduler counter {name!r}")
            c.add_metric([], float(counters.get(name, 0)))
            yield c


# ---------------------------------------------------------------------------------------- request parsing
def _typename(v: Any) -> str:
    return "null" if v is None else {"str": "string", "int": "integer", "float": "number", "bool": "boolean",
                                     "list": "array", "dict": "object"}.get(type(v).__name__, type(v).__name__)


def _get(body: dict, name: str, kind: str, default: Any = _MISSING) -> Any:
    """``body[name]`` checked against ``kind`` (integer, number, boolean, string, array, object); 400 otherwise."""
    if body.get(name) is None:
        if default is _MISSING:
            raise APIError(400, f"'{name}' is required", param=name)
        return default
    v = body[name]
    ok = {"integer": isinstance(v, int) and not isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": isinstance(v, bool), "string": isinstance(v, str), "array": isinstance(v, list),
          "object": isinstance(v, dict)}[kind]
    if not ok:
        raise APIError(400, f"'{name}' must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {_typename(v)} "
                            f"({json.dumps(v)[:80]})", param=name)
    return v


def _unsupported(body: dict, allowed: Mapping[str, Any]) -> None:
    """400 for fields this server does not implement, unless they hold their no-op value(s)."""
    for name, ok in allowed.items():
        if name in body and body[name] is not None and body[name] not in ok:
            raise APIError(400, f"'{name}'={json.dumps(body[name])[:80]} is not supported by this server "
                                f"(accepted: {', '.join(json.dumps(o) for o in ok)}); drop the field", param=name)


_UNSUPPORTED_COMMON = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},)}
_UNSUPPORTED_COMPLETIONS = {**_UNSUPPORTED_COMMON, "best_of": (1,), "echo": (False,), "logprobs": (0,),
                            "suffix": ("",)}
_UNSUPPORTED_CHAT = {**_UNSUPPORTED_COMMON, "logprobs": (False,), "top_logprobs": (0,),
                     "response_format": ({"type": "text"},)}


def _options(body: dict, default_max_tokens: int, *, chat: bool) -> dict:
    """The decoding options shared by both endpoints (validated)."""
    _unsupported(body, _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETIONS)
    o: dict[str, Any] = {"model": _get(body, "model", "string")}
    name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    o["max_tokens"] = _get(body, name, "integer", default_max_tokens)
    if o["max_tokens"] < 1:
        raise APIError(400, f"'{name}'={o['max_tokens']}; it must be ≥ 1", param=name)
    o["max_tokens_field"] = name
    stop = body.get("stop")
    if stop is None:
        o["stop"] = None
    elif isinstance(stop, str):
        o["stop"] = [stop] if stop else None
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        o["stop"] = [s for s in stop if s] or None
    else:
        raise APIError(400, f"'stop' must be a string or an array of strings, got {_typename(stop)}", param="stop")
    temperature = _get(body, "temperature", "number", 0.0)
    if temperature < 0:
        raise APIError(400, f"'temperature'={temperature}; it must be ≥ 0 (0: greedy)", param="temperature")
    top_p = _get(body, "top_p", "number", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"'top_p'={top_p}; it must be in (0, 1]", param="top_p")
    seed = _get(body, "seed", "integer", None)
    if seed is not None and not 0 <= seed < 2 ** 63:
        raise APIError(400, f"'seed'={seed}; it must be in 0 .. 2**63-1", param="seed")
    o["sampling"] = (SamplingParams() if temperature == 0 else
                     SamplingParams(do_sample=True, temperature=float(temperature), top_p=float(top_p),
                                    seed=secrets.randbits(63) if seed is None else seed))
    o["stream"] = _get(body, "stream", "boolean", False)
    so = _get(body, "stream_options", "object", {})
    o["include_usage"] = bool(_get(so, "include_usage", "boolean", False)) if so else False
    o["shared_len"] = _get(body, "shared_prefix_tokens", "integer", None)
    if o["shared_len"] is not None and o["shared_len"] < 0:
        raise APIError(400, f"'shared_prefix_tokens'={o['shared_len']}; it must be ≥ 0", param="shared_prefix_tokens")
    o["ignore_eos"] = _get(body, "ignore_eos", "boolean", False)
    o["return_token_ids"] = _get(body, "return_token_ids", "boolean", False)
    o["session_id"] = _get(body, "session_id", "string", None)
    return o


# ---------------------------------------------------------------------------------------- per-request plumbing
class _Sink:
    """Receives a ticket's callbacks on the scheduler thread and hands them to the asyncio loop."""

    __slots__ = ("loop", "queue", "on_finished")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_finished):
        self.loop, self.queue, self.on_finished = loop, asyncio.Queue(), on_finished

    def on_token(self, ticket: Ticket, token_id: int) -> None:
        self._post(self.queue.put_nowait, token_id)

    def on_done(self, ticket: Ticket) -> None:
        self._post(self._finish, ticket)

    def _finish(self, ticket: Ticket) -> None:  # on the loop
        try:
            self.on_finished(ticket)
        finally:
            self.queue.put_nowait(_DONE)

    def _post(self, fn, arg) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: the server has shut down
            pass


async def _watch_disconnect(request: Request, ticket: Ticket) -> None:
    """Cancel ``ticket`` when the client goes away before it is done."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break
    except asyncio.CancelledError:
        return
    except Exception:  # noqa: BLE001 - a broken receive channel means the client is gone too
        pass
    if not ticket.done.is_set():
        ticket.cancel()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _App:
    """The state behind one FastAPI app (see ``create_app``)."""

    def __init__(self, scheduler: Scheduler, tokenizer, models: dict[str, str], *, default_max_tokens: int,
                 completions_default_max_tokens: int, max_model_len: int | None, retry_after_s: int):
        self.scheduler, self.tokenizer, self.models = scheduler, tokenizer, models
        self.default_max_tokens = default_max_tokens
        self.completions_default_max_tokens = completions_default_max_tokens
        self.max_model_len, self.retry_after_s = max_model_len, retry_after_s
        self.metrics = ServerMetrics(scheduler)
        self.created = int(time.time())
        engine = scheduler.engine
        cfg = getattr(getattr(engine, "base", None), "config", None)
        self.vocab_size = getattr(cfg, "vocab_size", None)
        self.base_name = getattr(getattr(engine, "base", None), "name", BASE)
        self.started_scheduler = False

    # ------------------------------------------------------------------ helpers
    def resolve(self, model: str) -> str:
        if model not in self.models:
            self.metrics.rejected("", "unknown_model")
            raise APIError(404, f"The model '{model}' does not exist; served models: {', '.join(self.models)}",
                           param="model", code="model_not_found")
        return self.models[model]

    async def json_body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {_typename(body)}")
        return body

    def completion_prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            return tokenize_prompt(self.tokenizer, p, chat_template=False)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
            if bad:
                raise APIError(400, f"'prompt' holds token ids outside 0..{self.vocab_size - 1}: {bad[:5]}", param="prompt")
            return list(p)
        if p is None:
            raise APIError(400, "'prompt' is required", param="prompt")
        if isinstance(p, list) and p and all(isinstance(t, (str, list)) for t in p):
            raise APIError(400, f"'prompt' holds {len(p)} prompts; this server takes one prompt per request",
                           param="prompt")
        raise APIError(400, f"'prompt' must be a string or a non-empty array of token ids, got {_typename(p)}",
                       param="prompt")

    def chat_prompt(self, body: dict) -> list[int]:
        messages = _get(body, "messages", "array")
        if not messages:
            raise APIError(400, "'messages' is empty; send at least one message", param="messages")
        clean = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise APIError(400, f"'{where}' must be an object, got {_typename(m)}", param=where)
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise APIError(400, f"'{where}.role' must be a string (system, user, assistant, tool)",
                               param=f"{where}.role")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                texts = []
                for j, part in enumerate(content):
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                        raise APIError(400, f"'{where}.content[{j}]' must be a text part "
                                            '({"type": "text", "text": ...}); other parts are not supported',
                                       param=f"{where}.content")
                    texts.append(part["text"])
                content = "".join(texts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise APIError(400, f"'{where}.content' must be a string or an array of text parts, got "
                                    f"{_typename(content)}", param=f"{where}.content")
            clean.append({**{k: v for k, v in m.items() if k not in ("role", "content")}, "role": role,
                          "content": content})
        tools = _get(body, "tools", "array", None)
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt",
                           param="messages")
        try:
            return tokenize_prompt(self.tokenizer, clean, chat_template=True, tools=tools or None)
        except Exception as e:  # noqa: BLE001 - a template that refuses the conversation (roles, ...)
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None

    def check_length(self, prompt_ids: list[int], o: dict) -> None:
        n = len(prompt_ids)
        if o["shared_len"] is not None and o["shared_len"] > n:
            raise APIError(400, f"'shared_prefix_tokens'={o['shared_len']} exceeds the prompt's {n} tokens",
                           param="shared_prefix_tokens")
        if self.max_model_len is not None and n + o["max_tokens"] > self.max_model_len:
            self.metrics.rejected(o["model"], "prompt_too_long")
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, but the "
                                f"prompt has {n} tokens and {o['max_tokens_field']}={o['max_tokens']}; shorten the "
                                f"prompt or lower {o['max_tokens_field']}", param=o["max_tokens_field"],
                           code="context_length_exceeded")

    def submit(self, decoder: str, prompt_ids: list[int], o: dict, sink: _Sink, stream: bool) -> Ticket:
        req = ServeRequest(decoder, prompt_ids, shared_len=o["shared_len"], max_new_tokens=o["max_tokens"],
                           stop=o["stop"], sampling=o["sampling"], ignore_eos=o["ignore_eos"],
                           session_id=o["session_id"])
        try:
            return self.scheduler.submit(req, on_token=sink.on_token if stream else None, on_done=sink.on_done)
        except QueueFullError as e:
            self.metrics.rejected(o["model"], "queue_full")
            raise APIError(503, f"the server is busy: {e}", type="server_error", code="queue_full",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        except PromptTooLongError as e:
            self.metrics.rejected(o["model"], "prompt_too_long")
            raise APIError(400, f"{e} (HTTP fields: max_new_tokens = {o['max_tokens_field']}, shared_len = "
                                "shared_prefix_tokens)", param="prompt", code="context_length_exceeded") from None
        except CCFTError as e:
            self.metrics.rejected("", "invalid")
            msg = str(e)
            param = ("shared_prefix_tokens" if "shared_len" in msg else
                     o["max_tokens_field"] if "max_new_tokens" in msg else "prompt")
            raise APIError(400, msg, param=param) from None

    # ------------------------------------------------------------------ endpoint
    async def generate(self, request: Request, *, chat: bool):
        try:
            body = await self.json_body(request)
            o = _options(body, self.default_max_tokens if chat else self.completions_default_max_tokens, chat=chat)
            decoder = self.resolve(o["model"])
            prompt_ids = self.chat_prompt(body) if chat else self.completion_prompt(body)
            self.check_length(prompt_ids, o)
        except APIError as e:
            if e.status == 400 and e.code != "context_length_exceeded":
                self.metrics.rejected("", "invalid")
            raise
        model = o["model"]
        sink = _Sink(asyncio.get_running_loop(), lambda t: self.metrics.finished(model, t))
        ticket = self.submit(decoder, prompt_ids, o, sink, o["stream"])
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        created = int(time.time())
        watcher = asyncio.ensure_future(_watch_disconnect(request, ticket))
        if o["stream"]:
            return StreamingResponse(self.events(ticket, sink, watcher, o, prompt_ids, rid, created, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while await sink.queue.get() is not _DONE:
                pass
        finally:
            watcher.cancel()
            if not ticket.done.is_set():
                ticket.cancel()  # the handler was cancelled (the client is gone, or the server stops)
        return self.final_response(ticket, o, prompt_ids, rid, created, chat)

    def final_response(self, ticket: Ticket, o: dict, prompt_ids: list[int], rid: str, created: int, chat: bool):
        if ticket.state != "done" or ticket.result is None:
            if ticket.state == "cancelled":
                return _error_response(499, "the request was cancelled (client disconnected)", code="cancelled")
            return _error_response(500, f"the request failed: {ticket.error}", type="server_error")
        g = ticket.result
        finish = FINISH_REASONS.get(g.finish_reason, g.finish_reason)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": g.text}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"text": g.text, "index": 0, "finish_reason": finish, "logprobs": None}
        if o["return_token_ids"]:
            choice.update(prompt_token_ids=list(prompt_ids), token_ids=list(g.token_ids))
        n_out = len(g.token_ids)
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": o["model"], "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                      "total_tokens": len(prompt_ids) + n_out}})

    async def events(self, ticket: Ticket, sink: _Sink, watcher, o: dict, prompt_ids: list[int], rid: str,
                     created: int, chat: bool):
        """The SSE stream of one request (an async generator of ``data: ...`` events)."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        first = True

        def chunk(text: str, ids: list[int], finish: str | None = None) -> str:
            nonlocal first
            if chat:
                delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"text": text, "index": 0, "finish_reason": finish, "logprobs": None}
            if o["return_token_ids"]:
                choice["token_ids"] = ids
                if first:
                    choice["prompt_token_ids"] = list(prompt_ids)
            first = False
            out = {"id": rid, "object": obj, "created": created, "model": o["model"], "choices": [choice]}
            if o["include_usage"]:
                out["usage"] = None
            return _sse(out)

        detok = IncrementalDetokenizer(self.tokenizer, o["stop"])
        pending: list[int] = []  # ids not yet reported in a chunk
        tail = ""  # text of the last batch of tokens, sent with the final chunk
        try:
            done = False
            while not done:
                items = [await sink.queue.get()]
                while not sink.queue.empty():  # tokens that arrived meanwhile go out in one chunk
                    items.append(sink.queue.get_nowait())
                done = items[-1] is _DONE
                ids = [i for i in items if i is not _DONE]
                if not ids:
                    continue
                pending += ids
                text = detok.push(ids)
                if done:
                    tail = text
                elif text or o["return_token_ids"]:
                    yield chunk(text, pending)
                    pending = []
            if ticket.state == "done" and ticket.result is not None:
                g = ticket.result
                yield chunk(tail + detok.finish(g.text), pending, FINISH_REASONS.get(g.finish_reason, g.finish_reason))
                if o["include_usage"]:
                    n_out = len(g.token_ids)
                    yield _sse({"id": rid, "object": obj, "created": created, "model": o["model"], "choices": [],
                                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                                          "total_tokens": len(prompt_ids) + n_out}})
            else:
                reason = ("the request was cancelled" if ticket.state == "cancelled"
                          else f"the request failed: {ticket.error}")
                yield _sse({"error": {"message": reason, "type": "server_error", "param": None,
                                      "code": ticket.state}})
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not ticket.done.is_set():
                ticket.cancel()  # the client went away mid-stream: abort the engine row, free its KV

    # ------------------------------------------------------------------ other endpoints
    def model_card(self, name: str) -> dict:
        decoder = self.models[name]
        entry = self.scheduler.engine.decoders[decoder]
        d = getattr(entry, "decoder", None)
        return {"id": name, "object": "model", "created": self.created, "owned_by": "ccft",
                "root": self.base_name if decoder == BASE else (getattr(d, "path", None) or decoder),
                "parent": None if decoder == BASE else self.base_name,
                "max_model_len": self.max_model_len}

    def health(self) -> tuple[int, dict]:
        s = self.scheduler
        alive = s.running
        body = {"status": "ok" if alive else "scheduler not running", "queue_depth": s.queue_depth,
                "active_requests": s.active, "live_kv_bytes": s.live_bytes, "prefix_store_bytes": s.store_bytes,
                "models": list(self.models)}
        return (200 if alive else 503), body


def create_app(scheduler: Scheduler, tokenizer=None, *, served_model_names: Sequence[str] | Mapping[str, str] | None = None,
               default_max_tokens: int = 256, completions_default_max_tokens: int = 16,
               max_model_len: int | None = None, retry_after_s: int = 1, title: str = "ccft serve") -> FastAPI:
    """An OpenAI-compatible FastAPI app over ``scheduler`` (see the module docstring).

    Args:
        scheduler: the ``Scheduler`` (its engine's decoders are the models). Started in the app's
            lifespan unless it already runs; stopped on shutdown if the app started it.
        tokenizer: the tokenizer of the base (default: the engine's). The app works on its own copy.
        served_model_names: which decoders to serve (default: all of ``engine.decoders``, ``"base"``
            included), or a mapping public name → decoder name (aliases).
        default_max_tokens: ``max_tokens`` of a chat request that sets none.
        completions_default_max_tokens: ``max_tokens`` of a completion request that sets none (16, as OpenAI).
        max_model_len: longest prompt + ``max_tokens`` accepted (default: the model's
            ``max_position_embeddings``).
        retry_after_s: the ``Retry-After`` header of a 503 (queue full).
    Raises:
        ConfigError: a served name that is not a decoder of the engine.
    """
    engine = scheduler.engine
    if tokenizer is None or tokenizer is getattr(engine, "tokenizer", None):
        tokenizer = engine.tokenizer
    tokenizer = copy.deepcopy(tokenizer)  # the engine decodes stop strings on the scheduler thread with its own
    if served_model_names is None:
        models = {n: n for n in engine.decoders}
    elif isinstance(served_model_names, Mapping):
        models = dict(served_model_names)
    else:
        models = {n: n for n in served_model_names}
    unknown = sorted(d for d in models.values() if d not in engine.decoders)
    if unknown or not models:
        raise ConfigError(f"served_model_names: {unknown or 'none'} are not decoders of the engine; registered: "
                          f"{', '.join(engine.decoders)}")
    if max_model_len is None:
        cfg = getattr(getattr(engine, "base", None), "config", None)
        max_model_len = getattr(cfg, "max_position_embeddings", None)
    state = _App(scheduler, tokenizer, models, default_max_tokens=int(default_max_tokens),
                 completions_default_max_tokens=int(completions_default_max_tokens), max_model_len=max_model_len,
                 retry_after_s=int(retry_after_s))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        running = scheduler.running
        if not running:
            scheduler.start()
            state.started_scheduler = True
        try:
            yield
        finally:
            if state.started_scheduler:
                scheduler.stop()
                state.started_scheduler = False

    app = FastAPI(title=title, lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.ccft = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(exc.status_code, str(exc.detail), code=None,
                               type="invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # pragma: no cover - a bug; keep serving
        log.exception("unhandled error in %s", request.url.path)
        return _error_response(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.generate(request, chat=True)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [state.model_card(n) for n in state.models]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        state.resolve(model)
        return state.model_card(model)

    @app.get("/health")
    async def health():
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

    return app


class BackgroundServer:
    """Run an ASGI app with uvicorn in a background thread (tests, notebooks, benchmarks).

    ``port=0`` picks a free port; ``url`` is the base URL once started. Use as a context manager
    or call ``start()`` / ``stop()``.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", **uvicorn_kwargs):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                     **uvicorn_kwargs)
        self.server = uvicorn.Server(self.config)
        self.thread: threading.Thread | None = None
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread = threading.Thread(target=self.server.run, name="ccft-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port} (port in use?)")
            time.sleep(0.02)
        sockets = [s for srv in getattr(self.server, "servers", []) for s in srv.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
            self.thread = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
