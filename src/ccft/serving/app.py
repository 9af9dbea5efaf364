"""``create_app``: an OpenAI-compatible HTTP server over a ``Scheduler`` (``ccft serve``).

Every decoder of the scheduler's engine is a *model* (``"base"`` is the base model itself); all of
them decode on the base's shared prefill (docs/design.md, "Modes": ``prefillshare`` for CCFT
decoders). Endpoints:

* ``POST /v1/completions``: a ``CompletionRequest`` body (``ccft.serving.schemas``): ``model``,
  ``prompt`` (a string, tokenized as ``tokenize_prompt(tokenizer, prompt, chat_template=False)``,
  or a list of token ids, used as they are), ``max_tokens`` (default 16), ``stop``, ``temperature``
  / ``top_p`` / ``seed`` (``temperature`` 0 or absent: greedy decoding, the default), ``stream``
  (server-sent events ``data: {...}`` then ``data: [DONE]``; ``stream_options: {"include_usage":
  true}`` adds a final usage chunk), ``n`` choices (seeds seed, seed+1, ...; submitted together
  so the prompt is prefilled once), ``logprobs`` (legacy format) and ``echo`` (the prompt, with
  its logprobs, before the completion; ``max_tokens`` may then be 0). The response carries ``id``,
  ``object``, ``created``, ``model``, ``choices[{text, index, finish_reason, logprobs}]`` and
  ``usage``. ``finish_reason``: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_tokens``
  reached). Log-probabilities: docs/serving.md, "Log-probabilities".
* ``POST /v1/chat/completions``: a ``ChatCompletionRequest``: ``messages`` rendered with the
  tokenizer's chat template (``add_generation_prompt=True``; ``tools`` are rendered too, tool calls
  are not parsed), the same options (``max_completion_tokens`` is an alias of ``max_tokens``;
  default ``default_max_tokens``; ``logprobs`` / ``top_logprobs`` give ``logprobs.content``),
  chat-shaped responses (``message``) and stream chunks (``delta``; the first chunk also carries
  the role).
* ``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health``, ``GET /metrics`` (Prometheus
  text format, one registry per app; ``ccft.serving.metrics.ServerMetrics``).
* ``POST /v1/models/{model}/reload`` with ``{"path": FOLDER}``, only with ``create_app(allow_reload=True)``
  (``ccft serve --allow-reload``; 404 otherwise): a LoRA decoder takes new weights in place
  (``ServerState.reload``; 400 naming the field when the folder is refused).

ccft extensions of the request: ``shared_prefix_tokens`` (how many leading prompt tokens are
context shared with other requests, ``ServeRequest.shared_len``; a placement hint only, the output
does not depend on it), ``ignore_eos``, ``return_token_ids``, ``session_id``, ``echo_context_tokens``.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: a body over
``max_body_bytes`` → 413 (``request_too_large``), answered from the ``Content-Length`` header before
any of the body is read (or as soon as a chunked body passes the limit); a malformed body, a
missing / wrong-typed / unsupported field, text the tokenizer cannot encode, or control-token text
outside a message content (``ccft.core.tokens.tokenize_prompt``) → 400 naming the field; an unknown model →
404 listing the served ones; a prompt that can never be served (``PromptTooLongError``, or
prompt + ``max_tokens`` beyond the model's positions) → 400 with code ``context_length_exceeded``; a full
queue (``QueueFullError``) → 503 with ``Retry-After``; a request the engine failed → 500. When a client
disconnects before its response is complete (streaming or not), its ticket is cancelled: the
scheduler aborts the engine row and frees its KV (docs/design.md, fault class K9). Every error is
answered on the request's own connection and leaves it open (keep-alive): an exception no handler
knows is a 500 answer, never a dropped connection (``BodyLimitAndErrors``).

Threading: the scheduler loop runs in its own thread (``Scheduler.start``, started in the app's
lifespan unless it already runs, stopped on shutdown when the app started it). Its callbacks only
hand tokens to the asyncio loop (``ccft.serving.streaming.TokenSink``). Request bodies are validated
and prompts tokenized off the event loop, in one worker thread with its own copy of the tokenizer
(``ServerState.prepare``), so a large body never stalls ``/health`` or other streams; stream text is
decoded on the loop with another copy (linear in the output length).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Mapping, Sequence

from ccft.serving.extra import serve_extra_missing

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - depends on the installation
    raise serve_extra_missing(e) from e

from ccft.core.errors import CCFTError, ConfigError, DataError
from ccft.core.tokens import tokenize_prompt
from ccft.inference import BASE
from ccft.serving.metrics import CONTENT_TYPE, ServerMetrics
from ccft.serving.scheduler import PromptTooLongError, QueueFullError, Scheduler, ServeRequest, Ticket
from ccft.serving.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LogprobText,
    Reply,
    error_response,
    parse_request,
)
from ccft.serving.streaming import DONE, StreamText, TokenSink, sse_events, watch_disconnect

log = logging.getLogger(__name__)

__all__ = ["create_app", "ServerState", "BodyLimitAndErrors", "DEFAULT_MAX_BODY_BYTES"]

#: Default limit on a request body (bytes): far above any prompt a model can take, far below what hurts.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class _BodyTooLarge(Exception):
    """Raised by ``BodyLimitAndErrors``' receive channel when a chunked body passes the limit."""


async def _send_json(send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class BodyLimitAndErrors:
    """The app's outermost ASGI layer (inside Starlette's own): request-size limit and last-resort errors.

    * A request whose ``Content-Length`` exceeds ``max_body_bytes`` is answered 413 at once, before any
      of its body is read or parsed (uvicorn discards the rest of the body and keeps the connection); a
      chunked body is counted as it arrives and answered 413 once it passes the limit.
    * An exception that no handler answered becomes a 500 error object when no response has started,
      or ends the started response cleanly; it is never re-raised to the server, which would close
      the connection (docs/design.md, fault class K9: errors stay with their request).

    ``on_reject(outcome)`` is called for each 413 (``"too_large"``). ``max_body_bytes=None``: no limit.
    """

    def __init__(self, app, max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES, on_reject=None):
        self.app, self.max_body_bytes, self.on_reject = app, max_body_bytes, on_reject

    def _too_large(self) -> dict:
        if self.on_reject is not None:
            self.on_reject("too_large")
        return {
            "error": {
                "message": f"the request body is larger than this server's limit of {self.max_body_bytes} "
                "bytes (ccft serve --max-body-mb); send a smaller request",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        }

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        if limit is not None:
            length = dict(scope.get("headers") or []).get(b"content-length")
            try:
                too_long = length is not None and int(length) > limit
            except ValueError:
                too_long = False  # the HTTP server refuses a malformed Content-Length itself
            if too_long:
                await _send_json(send, 413, self._too_large())
                return
        state = {"started": False, "ended": False, "received": 0}

        async def send_(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        async def receive_():
            message = await receive()
            if limit is not None and message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, receive_, send_)
        except _BodyTooLarge:
            if not state["started"]:
                await _send_json(send_, 413, self._too_large())
        except Exception as exc:  # noqa: BLE001 - a bug: answer it, keep the connection and the server
            log.exception("unhandled error in %s", scope.get("path"))
            if not state["started"]:
                await _send_json(
                    send_,
                    500,
                    {
                        "error": {
                            "message": f"internal error: {type(exc).__name__}: {exc}",
                            "type": "server_error",
                            "param": None,
                            "code": None,
                        }
                    },
                )
            elif not state["ended"]:
                await send_({"type": "http.response.body", "body": b"", "more_body": False})


class ServerState:
    """The state behind one FastAPI app (``app.state.ccft``; see ``create_app``)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer,
        models: dict[str, str],
        *,
        default_max_tokens: int,
        completions_default_max_tokens: int,
        max_model_len: int | None,
        retry_after_s: int,
        max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
        allow_reload: bool = False,
        reload_timeout_s: float = 300.0,
        max_model_len_source: str | None = None,
    ):
        self.scheduler, self.tokenizer, self.models = scheduler, tokenizer, models
        self.allow_reload, self.reload_timeout_s = bool(allow_reload), float(reload_timeout_s)
        #: the tokenizer of the prepare thread (each copy is used by one thread only)
        self.prompt_tokenizer = copy.deepcopy(tokenizer)
        self.max_body_bytes = max_body_bytes
        #: token strings of logprobs objects (on the event loop, with the loop's tokenizer copy)
        self.logprob_text = LogprobText(tokenizer)
        self._executor: ThreadPoolExecutor | None = None
        self.default_max_tokens = default_max_tokens
        self.completions_default_max_tokens = completions_default_max_tokens
        self.max_model_len, self.retry_after_s = max_model_len, retry_after_s
        #: what sets ``max_model_len`` (named in a ``context_length_exceeded`` refusal): a config field of the
        #: base such as ``config.sliding_window``, or ``max_model_len`` when the app was given one
        self.max_model_len_source = max_model_len_source
        self.metrics = ServerMetrics(scheduler)
        self.created = int(time.time())
        engine = scheduler.engine
        cfg = getattr(getattr(engine, "base", None), "config", None)
        self.vocab_size = getattr(cfg, "vocab_size", None)
        self.base_name = getattr(getattr(engine, "base", None), "name", BASE)
        self.started_scheduler = False

    # ------------------------------------------------------------------ helpers
    def resolve(self, model: str) -> str:
        """The decoder name behind the public model name. Raises ``APIError`` 404 (``model_not_found``)."""
        if model not in self.models:
            self.metrics.rejected("", "unknown_model")
            raise APIError(
                404,
                f"The model '{model}' does not exist; served models: {', '.join(self.models)}",
                param="model",
                code="model_not_found",
            )
        return self.models[model]

    def prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The prompt's token ids (``ccft.core.tokens.tokenize_prompt``; docs/design.md, "Token boundary").

        A completion prompt string is tokenized as it is (control-token text included, as OpenAI-style
        servers do); in a chat only the template's markup yields control tokens, message contents are
        plain text (docs/design.md, fault class K9). Runs on the prepare thread (``prepare``).

        Raises:
            APIError: 400 naming the field: text the tokenizer cannot encode; control-token text in a
                role, another message field or a tool schema; a chat request to a tokenizer without a
                chat template, or a conversation the template refuses.
        """
        tok = self.prompt_tokenizer
        if isinstance(req, CompletionRequest):
            if not isinstance(req.prompt, str):
                return list(req.prompt)
            try:
                return tokenize_prompt(tok, req.prompt, chat_template=False)
            except Exception as e:  # noqa: BLE001 - text the tokenizer cannot encode
                raise APIError(
                    400,
                    f"'prompt' cannot be tokenized ({type(e).__name__}: {e}); send valid text",
                    param="prompt",
                ) from None
        if not getattr(tok, "chat_template", None):
            raise APIError(
                400,
                "this model's tokenizer has no chat template; use /v1/completions with a prompt",
                param="messages",
            )
        messages = [m.template_dict() for m in req.messages]
        try:
            return tokenize_prompt(tok, messages, chat_template=True, tools=req.tools or None)
        except DataError as e:
            raise APIError(400, str(e), param=getattr(e, "field", None) or "messages") from None
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot encode, or a template that refuses
            for i, m in enumerate(req.messages):  # name the message the tokenizer cannot encode
                try:
                    tok(m.content, add_special_tokens=False)
                except Exception as inner:  # noqa: BLE001
                    raise APIError(
                        400,
                        f"'messages[{i}].content' cannot be tokenized ({type(inner).__name__}: "
                        f"{inner}); send valid text",
                        param=f"messages[{i}].content",
                    ) from None
            raise APIError(
                400, f"the chat template cannot render these messages: {e}", param="messages"
            ) from None

    def prepare(self, raw: bytes, *, chat: bool) -> tuple[Any, int, str, list[int]]:
        """(request, max_tokens, decoder, prompt ids) of a raw body: validation, model, tokenization, lengths.

        CPU work on the request's text, run off the event loop (``off_loop``).

        Raises:
            APIError: 400 (invalid body or field, prompt too long), 404 (unknown model).
        """
        try:
            req = parse_request(raw, chat=chat, vocab_size=self.vocab_size)
            max_tokens = req.new_tokens(
                self.default_max_tokens if chat else self.completions_default_max_tokens
            )
            decoder = self.resolve(req.model)
            prompt_ids = self.prompt_ids(req)
            if max_tokens == 0 and not req.echo_prompt:
                raise APIError(
                    400,
                    "'max_tokens'=0 generates nothing; it is accepted only with \"echo\": true "
                    "(score the prompt); set max_tokens ≥ 1 or echo",
                    param="max_tokens",
                )
            c = getattr(req, "echo_context_tokens", None)
            if c is not None and c >= len(prompt_ids):
                raise APIError(
                    400,
                    f"'echo_context_tokens'={c} leaves no continuation: the prompt has "
                    f"{len(prompt_ids)} tokens; it must be in 1..{len(prompt_ids) - 1}",
                    param="echo_context_tokens",
                )
            self.check_length(prompt_ids, req, max_tokens)
        except APIError as e:
            if e.status == 400 and e.code != "context_length_exceeded":
                self.metrics.rejected("", "invalid")
            raise
        return req, max_tokens, decoder, prompt_ids

    async def off_loop(self, fn, *args, **kwargs):
        """Run ``fn`` in the app's one prepare thread (the tokenizer is used by one thread at a time)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ccft-prepare")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        """Stop the prepare thread (a later request starts a new one)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def check_length(self, prompt_ids: list[int], req, max_tokens: int) -> None:
        """400 when ``shared_prefix_tokens`` exceeds the prompt or prompt + ``max_tokens`` exceed
        ``max_model_len``."""
        n = len(prompt_ids)
        if req.shared_prefix_tokens is not None and req.shared_prefix_tokens > n:
            raise APIError(
                400,
                f"'shared_prefix_tokens'={req.shared_prefix_tokens} exceeds the prompt's {n} tokens",
                param="shared_prefix_tokens",
            )
        field = req.max_tokens_field
        if self.max_model_len is not None and n + max_tokens > self.max_model_len:
            self.metrics.rejected(req.model, "prompt_too_long")
            source = f" ({self.max_model_len_source})" if self.max_model_len_source else ""
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens{source}, but the "
                f"prompt has {n} tokens and {field}={max_tokens}; shorten the prompt or lower "
                f"{field}",
                param=field,
                code="context_length_exceeded",
            )

    def submit(
        self, decoder: str, prompt_ids: list[int], req, max_tokens: int, sinks: Sequence[TokenSink]
    ) -> list[Ticket]:
        """Hand the request's ``n`` choices to the scheduler, one ``ServeRequest`` each (together:
        ``Scheduler.submit_many``, so the prompt is prefilled once): choice j samples with seed + j,
        the first one also scores the prompt when ``echo`` asks for its logprobs.
        Raises ``APIError`` 503 (queue full) or 400 (never servable)."""
        echo_lps = req.token_logprobs if req.echo_prompt else None
        requests = [
            ServeRequest(
                decoder,
                prompt_ids,
                shared_len=req.shared_prefix_tokens,
                params=req.decode_params(max_tokens, j),
                session_id=req.session_id,
                prompt_logprobs=echo_lps if j == 0 else None,
                prompt_context_tokens=getattr(req, "echo_context_tokens", None),
            )
            for j in range(len(sinks))
        ]
        try:
            if len(requests) == 1:
                return [
                    self.scheduler.submit(
                        requests[0],
                        on_token=sinks[0].on_token if req.stream else None,
                        on_done=sinks[0].on_done,
                    )
                ]
            return self.scheduler.submit_many(
                requests,
                on_token=[s.on_token if req.stream else None for s in sinks],
                on_done=[s.on_done for s in sinks],
            )
        except QueueFullError as e:
            self.metrics.rejected(req.model, "queue_full")
            raise APIError(
                503,
                f"the server is busy: {e}",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        except PromptTooLongError as e:
            self.metrics.rejected(req.model, "prompt_too_long")
            raise APIError(
                400,
                f"{e} (HTTP fields: max_new_tokens = {req.max_tokens_field}, shared_len = "
                "shared_prefix_tokens)",
                param="prompt",
                code="context_length_exceeded",
            ) from None
        except CCFTError as e:
            self.metrics.rejected("", "invalid")
            msg = str(e)
            param = (
                "shared_prefix_tokens"
                if "shared_len" in msg
                else req.max_tokens_field
                if "max_new_tokens" in msg
                else "prompt"
            )
            raise APIError(400, msg, param=param) from None

    # ------------------------------------------------------------------ endpoint
    async def generate(self, request: Request, *, chat: bool):
        """``POST /v1/completions`` (``chat=False``) or ``/v1/chat/completions``: JSON or an SSE stream."""
        req, max_tokens, decoder, prompt_ids = await self.off_loop(
            self.prepare, await request.body(), chat=chat
        )
        model = req.model
        loop = asyncio.get_running_loop()
        # each choice is counted in ccft_requests_total (by its finish reason); the prompt's tokens once
        sinks = [
            TokenSink(loop, lambda t, first=(j == 0): self.metrics.finished(model, t, count_prompt=first))
            for j in range(req.choices)
        ]
        tickets = self.submit(decoder, prompt_ids, req, max_tokens, sinks)
        echo = req.echo_prompt
        prompt_text = ""
        if echo:
            prompt_text = req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(prompt_ids)
        reply = Reply(
            chat,
            model,
            list(prompt_ids),
            return_token_ids=bool(req.return_token_ids),
            include_usage=req.include_usage,
            logprobs=req.token_logprobs,
            echo=echo,
            prompt_text=prompt_text,
            tokens=self.logprob_text,
        )
        watcher = asyncio.ensure_future(watch_disconnect(request, tickets))
        if req.stream:
            texts = [StreamText(self.tokenizer, req.stop) for _ in tickets]
            events = sse_events(tickets, sinks, reply, texts, watcher)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            for sink in sinks:
                while await sink.queue.get() is not DONE:
                    pass
        finally:
            watcher.cancel()
            for ticket in tickets:
                if not ticket.done.is_set():
                    ticket.cancel()  # the handler was cancelled (the client is gone, or the server stops)
        for ticket in tickets:
            if ticket.state != "done" or ticket.result is None:
                if ticket.state == "cancelled":
                    return error_response(
                        499, "the request was cancelled (client disconnected)", code="cancelled"
                    )
                return error_response(500, f"the request failed: {ticket.error}", type="server_error")
        return JSONResponse(
            reply.completion(
                [t.result for t in tickets], [t.token_logprobs for t in tickets], tickets[0].prompt_logprobs
            )
        )

    async def reload(self, model: str, raw: bytes) -> dict:
        """``POST /v1/models/{model}/reload`` with body ``{"path": FOLDER}``: the LoRA decoder behind
        ``model`` takes the weights of the decoder folder (``Scheduler.reload_decoder``, at a step boundary;
        validated in a worker thread first, so streams go on meanwhile).

        Raises:
            APIError: 404 when the server was started without ``--allow-reload`` or ``model`` is unknown;
                400 when the body is not ``{"path": "..."}`` or the folder is refused (the message names
                the field and the fix; nothing is changed); 503 when the scheduler did not reach a step
                boundary in ``reload_timeout_s``.
        """
        if not self.allow_reload:
            raise APIError(
                404,
                "reload is not enabled on this server; start it with `ccft serve --allow-reload`",
                code="not_found",
            )
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f'the body is not valid JSON ({e}); send {{"path": "FOLDER"}}') from None
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise APIError(400, '\'path\' is missing or not a string; send {"path": "FOLDER"}', param="path")
        decoder = self.resolve(model)
        try:
            key = await asyncio.to_thread(
                self.scheduler.reload_decoder, decoder, path, timeout=self.reload_timeout_s
            )
        except CCFTError as e:
            raise APIError(400, str(e), param="path") from None
        except TimeoutError as e:
            raise APIError(503, str(e), type="server_error", code="reload_timeout") from None
        log.info("reloaded model %s from %s (producer key %s)", model, path, key)
        return {"id": model, "object": "model.reload", "path": path, "producer_key": key}

    # ------------------------------------------------------------------ other endpoints
    def model_card(self, name: str) -> dict:
        """The ``/v1/models`` entry of a served model (``parent``: the base, for decoders)."""
        decoder = self.models[name]
        entry = self.scheduler.engine.decoders[decoder]
        d = getattr(entry, "decoder", None)
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "ccft",
            "root": self.base_name if decoder == BASE else (getattr(d, "path", None) or decoder),
            "parent": None if decoder == BASE else self.base_name,
            "max_model_len": self.max_model_len,
        }

    def health(self) -> tuple[int, dict]:
        """(status, body) of ``/health``: 200 while the scheduler loop runs, else 503."""
        s = self.scheduler
        alive = s.running
        body = {
            "status": "ok" if alive else "scheduler not running",
            "queue_depth": s.queue_depth,
            "active_requests": s.active,
            "live_kv_bytes": s.live_bytes,
            "prefix_store_bytes": s.store_bytes,
            "models": list(self.models),
        }
        return (200 if alive else 503), body


def _positions_field(engine) -> str | None:
    """The config field that sets ``engine.max_positions`` (``"config.sliding_window"``, ...), or None when it
    cannot be told (an engine without a transformers config)."""
    field = getattr(engine, "max_positions_field", None)  # a public name, should the engine offer one
    if field is None:
        config = getattr(getattr(engine, "base", None), "config", None)
        if config is None:
            return None
        try:
            from ccft.inference.architectures import architecture

            field = architecture(config).max_positions_field
        except Exception:  # noqa: BLE001 - only the refusal's wording depends on it
            return None
    return field if str(field).startswith("config.") else f"config.{field}"


def create_app(
    scheduler: Scheduler,
    tokenizer=None,
    *,
    served_model_names: Sequence[str] | Mapping[str, str] | None = None,
    default_max_tokens: int = 256,
    completions_default_max_tokens: int = 16,
    max_model_len: int | None = None,
    retry_after_s: int = 1,
    title: str = "ccft serve",
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
    allow_reload: bool = False,
) -> FastAPI:
    """An OpenAI-compatible FastAPI app over ``scheduler`` (see the module docstring).

    Args:
        scheduler: the ``Scheduler`` (its engine's decoders are the models). Started in the app's
            lifespan unless it already runs; stopped on shutdown if the app started it.
        tokenizer: the tokenizer of the base (default: the engine's). The app works on its own copy.
        served_model_names: which decoders to serve (default: all of ``engine.decoders``, ``"base"``
            included), or a mapping public name → decoder name (aliases).
        default_max_tokens: ``max_tokens`` of a chat request that sets none.
        completions_default_max_tokens: ``max_tokens`` of a completion request that sets none (16, as OpenAI).
        max_model_len: longest prompt + ``max_tokens`` accepted (default: the engine's
            ``max_positions``: the base's ``max_position_embeddings``, or its ``sliding_window`` where that is
            smaller; a refusal names the config field).
        retry_after_s: the ``Retry-After`` header of a 503 (queue full).
        max_body_bytes: longest request body accepted (default 4 MiB); longer ones get 413 before they
            are read (``BodyLimitAndErrors``). ``None``: no limit.
        allow_reload: serve ``POST /v1/models/{model}/reload`` (``ServerState.reload``); off: it answers 404.
    Raises:
        ConfigError: a served name that is not a decoder of the engine.
    """
    engine = scheduler.engine
    if tokenizer is None or tokenizer is getattr(engine, "tokenizer", None):
        tokenizer = engine.tokenizer
    tokenizer = copy.deepcopy(
        tokenizer
    )  # the engine decodes stop strings on the scheduler thread with its own
    if served_model_names is None:
        models = {n: n for n in engine.decoders}
    elif isinstance(served_model_names, Mapping):
        models = dict(served_model_names)
    else:
        models = {n: n for n in served_model_names}
    unknown = sorted(d for d in models.values() if d not in engine.decoders)
    if unknown or not models:
        raise ConfigError(
            f"served_model_names: {unknown or 'none'} are not decoders of the engine; registered: "
            f"{', '.join(engine.decoders)}"
        )
    if max_model_len is None:  # the engine's own bound (SharedPrefillEngine.max_positions)
        max_model_len = getattr(engine, "max_positions", None)
        source = _positions_field(engine) if max_model_len is not None else None
    else:
        source = "max_model_len"
    state = ServerState(
        scheduler,
        tokenizer,
        models,
        default_max_tokens=int(default_max_tokens),
        completions_default_max_tokens=int(completions_default_max_tokens),
        max_model_len=max_model_len,
        retry_after_s=int(retry_after_s),
        max_body_bytes=None if max_body_bytes is None else int(max_body_bytes),
        allow_reload=allow_reload,
        max_model_len_source=source,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        running = scheduler.running
        if not running:
            scheduler.start()
            state.started_scheduler = True
        try:
            yield
        finally:
            state.close()
            if state.started_scheduler:
                scheduler.stop()
                state.started_scheduler = False

    app = FastAPI(title=title, lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.ccft = state
    app.add_middleware(
        BodyLimitAndErrors,
        max_body_bytes=state.max_body_bytes,
        on_reject=lambda outcome: state.metrics.rejected("", outcome),
    )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(
            exc.status_code,
            str(exc.detail),
            code=None,
            type="invalid_request_error" if exc.status_code < 500 else "server_error",
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await state.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.generate(request, chat=True)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [state.model_card(n) for n in state.models]}

    @app.post("/v1/models/{model:path}/reload")
    async def reload_model(request: Request, model: str):
        return await state.reload(model, await request.body())

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
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app
