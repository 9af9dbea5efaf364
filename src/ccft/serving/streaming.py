"""Streaming responses of ``ccft serve``: token hand-off from the scheduler thread, text deltas, SSE.

* ``TokenSink`` receives a ticket's callbacks on the scheduler thread and hands them to the
  asyncio loop (``loop.call_soon_threadsafe`` into a per-request queue, ``DONE`` last).
* ``StreamText`` turns the generated ids into text deltas that are safe to send: the one streaming
  decoder (``ccft.core.text.TextStream``, linear in the output length, holds back an incomplete
  UTF-8 character) and the one stop rule (``ccft.core.text.StopMatcher``: a tail that could still
  grow into a stop string is held back; a stop string and what follows it are never sent), as
  docs/design.md, "Stop strings and streaming" specifies. The deltas concatenate to a prefix of the
  engine's final text, and ``finish`` sends the rest, so a stream's text equals the non-streamed
  response's text (fault class K7).
* ``sse_events`` is the server-sent-event stream of one request (``data: {...}`` chunks, then
  ``data: [DONE]``), its ``n`` choices' chunks (``choice_chunks``, with their logprobs) merged in
  arrival order; ``watch_disconnect`` cancels the tickets whose client went away.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

from ccft.core.text import StopMatcher, TextStream
from ccft.serving.scheduler import Ticket
from ccft.serving.schemas import FINISH_REASONS, Reply

log = logging.getLogger(__name__)

__all__ = ["DONE", "TokenSink", "StreamText", "watch_disconnect", "sse", "choice_chunks", "sse_events"]

#: the last item a ``TokenSink`` queue receives
DONE = object()


class TokenSink:
    """A ticket's callbacks (scheduler thread) → ``queue`` on the asyncio ``loop``: token ids, then ``DONE``.

    ``on_finished(ticket)`` runs on the loop when the ticket ends, before ``DONE`` is queued.
    """

    __slots__ = ("loop", "queue", "on_finished")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_finished: Callable[[Ticket], None]):
        self.loop, self.queue, self.on_finished = loop, asyncio.Queue(), on_finished

    def on_token(self, ticket: Ticket, token_id: int) -> None:
        self._post(self.queue.put_nowait, token_id)

    def on_done(self, ticket: Ticket) -> None:
        self._post(self._finish, ticket)

    def _finish(self, ticket: Ticket) -> None:  # on the loop
        try:
            self.on_finished(ticket)
        finally:
            self.queue.put_nowait(DONE)

    def _post(self, fn, arg) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: the server has shut down
            pass


class StreamText:
    """Generated token ids → text deltas that are safe to send (see the module docstring).

    Only the held-back tail (shorter than the longest stop string) is scanned again when new text
    arrives, so a request's deltas cost time linear in its output length.

    Args:
        tokenizer: a Hugging Face tokenizer; deltas follow ``decode(ids, skip_special_tokens=True)``,
            as the engine's final text does.
        stop: the request's stop strings (empty strings ignored).
    """

    def __init__(self, tokenizer, stop: Sequence[str] | str | None = None):
        self.stream = TextStream(tokenizer)
        self.stop = StopMatcher(stop)
        self.held = ""  # decoded but not sent: it could be the start of a stop string
        self.stopped = False  # a stop string was found: nothing more is sent before ``finish``
        self._sent: list[str] = []

    @property
    def sent(self) -> str:
        """The text emitted so far (``push`` and ``finish`` deltas, concatenated)."""
        return "".join(self._sent)

    def push(self, ids: Iterable[int]) -> str:
        """Add generated ids; return the text that is now safe to send (possibly "")."""
        new = self.stream.push(ids)
        if self.stopped or not new:
            return ""
        text = self.held + new
        if self.stop:
            # A stop string that ends in ``new`` starts in it or in ``held`` (its part before ``new`` is a
            # suffix of the earlier text that is a proper prefix of the stop string: held back).
            cut = self.stop.find(text)
            if cut >= 0:
                text, self.held, self.stopped = text[:cut], "", True
            else:
                keep = self.stop.holdback(text)
                text, self.held = text[: len(text) - keep], text[len(text) - keep :]
        if text:
            self._sent.append(text)
        return text

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the engine's ``Generation.text``) after what was sent: the last
        delta."""
        sent = self.sent
        if not final_text.startswith(sent):  # pragma: no cover - the engine's text extends every delta
            log.warning(
                "streamed text %r is not a prefix of the final text %r; sending nothing more",
                sent[-40:],
                final_text[-40:],
            )
            return ""
        delta = final_text[len(sent) :]
        self._sent.append(delta)
        self.held = ""
        return delta


async def watch_disconnect(request, tickets: Ticket | Sequence[Ticket]) -> None:
    """Cancel ``tickets`` (one or the choices of one request) when the client of ``request`` (a Starlette
    request) goes away before they are done."""
    tickets = [tickets] if isinstance(tickets, Ticket) else list(tickets)
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                break
    except asyncio.CancelledError:
        return
    except Exception:  # noqa: BLE001 - a broken receive channel means the client is gone too
        pass
    for ticket in tickets:
        if not ticket.done.is_set():
            ticket.cancel()


def sse(obj: Any) -> str:
    """One server-sent event ``data: <compact JSON>`` (UTF-8 text, not ASCII-escaped)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def choice_chunks(
    ticket: Ticket,
    sink: TokenSink,
    reply: Reply,
    text: StreamText,
    index: int = 0,
    prompt_ticket: Ticket | None = None,
) -> AsyncIterator[dict]:
    """The chunks of one choice: a chunk per batch of tokens that arrived together (empty text chunks
    only with ``return_token_ids`` or ``logprobs``), then the final chunk with the rest of the text and
    the finish reason; a failed or cancelled ticket ends with an error object instead. With ``echo``
    the first chunk is the prompt (text, and its logprobs from ``prompt_ticket``, default ``ticket``).
    Each token's logprobs go out in the chunk that carries its id."""
    first = True
    pending: list[int] = []  # ids not yet reported in a chunk
    pos = 0  # tokens of ``ticket.tokens`` reported so far
    offset = 0  # text offset of the next token (legacy completions logprobs)
    tail = ""  # text of the last batch of tokens, sent with the final chunk

    def lp_of(ids: list[int]) -> dict | None:
        nonlocal pos, offset
        out = reply.logprobs_of(ids, ticket.token_logprobs[pos : pos + len(ids)], offset=offset)
        pos += len(ids)
        if out is not None and not reply.chat:
            offset += sum(len(t) for t in out["tokens"])
        return out

    done = False
    while not done:
        items = [await sink.queue.get()]
        while not sink.queue.empty():  # tokens that arrived meanwhile go out in one chunk
            items.append(sink.queue.get_nowait())
        done = items[-1] is DONE
        if first and reply.echo:  # the prompt first (its logprobs were computed at admission)
            source = prompt_ticket or ticket
            prompt_lps = None
            if reply.logprobs is not None and reply.tokens is not None:
                entries = source.prompt_logprobs or [None] * len(reply.prompt_ids)
                prompt_lps = reply.tokens.completion(reply.prompt_ids, entries, 0)
                offset = sum(len(t) for t in prompt_lps["tokens"])
            yield reply.chunk(reply.prompt_text, [], first=True, index=index, logprobs=prompt_lps)
            first = False
        ids = [i for i in items if i is not DONE]
        if not ids:
            continue
        pending += ids
        delta = text.push(ids)
        if done:
            tail = delta
        elif delta or reply.return_token_ids or reply.logprobs is not None:
            yield reply.chunk(delta, pending, first=first, index=index, logprobs=lp_of(pending))
            first, pending = False, []
    if ticket.state == "done" and ticket.result is not None:
        g = ticket.result
        finish = FINISH_REASONS.get(g.finish_reason, g.finish_reason)
        yield reply.chunk(
            tail + text.finish(g.text), pending, finish, first=first, index=index, logprobs=lp_of(pending)
        )
    else:
        reason = (
            "the request was cancelled"
            if ticket.state == "cancelled"
            else f"the request failed: {ticket.error}"
        )
        yield {"error": {"message": reason, "type": "server_error", "param": None, "code": ticket.state}}


async def sse_events(
    tickets: Ticket | Sequence[Ticket],
    sinks: TokenSink | Sequence[TokenSink],
    reply: Reply,
    texts: StreamText | Sequence[StreamText],
    watcher: asyncio.Future | None = None,
) -> AsyncIterator[str]:
    """The SSE stream of one request with one or several choices (``n``): each choice's chunks
    (``choice_chunks``; choices interleave as their tokens arrive), the usage chunk
    (``include_usage``: every choice's tokens), then ``data: [DONE]``. Cancels the tickets (and
    ``watcher``) when the consumer stops early.
    """
    single = isinstance(tickets, Ticket)
    tickets = [tickets] if single else list(tickets)
    sinks = [sinks] if isinstance(sinks, TokenSink) else list(sinks)
    texts = [texts] if isinstance(texts, StreamText) else list(texts)
    gens = [
        choice_chunks(t, s, reply, x, i, tickets[0])
        for i, (t, s, x) in enumerate(zip(tickets, sinks, texts, strict=True))
    ]
    pumps: list[asyncio.Task] = []
    try:
        if len(gens) == 1:
            async for chunk in gens[0]:
                yield sse(chunk)
        else:  # merge the choices' chunks in arrival order
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(gen) -> None:
                try:
                    async for chunk in gen:
                        merged.put_nowait(chunk)
                finally:
                    merged.put_nowait(DONE)

            pumps = [asyncio.ensure_future(pump(g)) for g in gens]
            left = len(pumps)
            while left:
                item = await merged.get()
                if item is DONE:
                    left -= 1
                else:
                    yield sse(item)
        ok = [t.result for t in tickets if t.state == "done" and t.result is not None]
        if reply.include_usage and len(ok) == len(tickets):
            yield sse(reply.usage_chunk(ok))
        yield "data: [DONE]\n\n"
    finally:
        for p in pumps:
            p.cancel()
        if watcher is not None:
            watcher.cancel()
        for ticket in tickets:
            if not ticket.done.is_set():
                ticket.cancel()  # the client went away mid-stream: abort the engine row, free its KV
