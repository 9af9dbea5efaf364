"""``Scheduler``: continuous batching of multi-agent requests on one ``SharedPrefillEngine``.

A request is one agent call: a decoder name, a prompt of ``shared_len`` context tokens (the part
several agents / turns have in common) followed by the agent's own tokens, and decoding settings.
Each ``step()``:

1. **admits** queued requests in arrival order while the decoder's lane has a free slot
   (``max_batch``) and the KV byte budget allows it; admission prefills what is missing and adds
   the request to the engine (``add_request``). Rows join between decode steps;
2. runs **one decode step** for every active row of every decoder (the engine batches each lane's
   rows across sessions: LoRA decoders on the base share one lane);
3. **delivers** the new tokens (``Ticket.on_token``) and finishes requests that ended.

A failing request fails alone: when a decode step raises for some rows (a broken decoder, a bad
token), the engine confines the error to the requests that cause it (``SharedPrefillEngine.step``,
``StepError``); only their tickets end in ``"error"``, every other request batched with them is
served on (docs/design.md, fault classes K9, K12). A request whose admission raises fails alone too.

Sharing (``share=True``, PrefillShare): the base prefills the shared context once into a
``PrefixHandle``; every agent request that reads the same context while it is live decodes on that
handle, its own tokens computed by the base into its tail (``add_request(suffix_ids=...)``), so
live KV is ``L_shared + N·(L_unique + generated)`` per context (the paper's Eq. 9). With a
``PrefixKVStore`` the context's full token blocks are kept after the handle is gone, so the next
turn (whose context extends this one) computes only its new tokens.

No sharing (``share=False``, the per-model baseline the paper compares against): every decoder
prefills its own prompt with its own weights into its own handle and its own store namespace
(producer = that decoder), as N separately deployed models would: live KV
``N·(L_shared + L_unique + generated)``.

KV budget (``kv_budget_bytes``): live KV (handles + the tail slots reserved by active requests, at
``layers × 2 × kv_heads × head_dim × dtype bytes`` per token) plus the store's blocks never exceed
it. Admission first evicts unreferenced store blocks (LRU); a request that still does not fit waits
in the queue (head of line: arrival order is kept), and one that could never fit alone is refused
at ``submit`` (``PromptTooLongError``). A full queue refuses new requests (``QueueFullError``).

Threading: ``submit`` and ``Ticket.cancel`` may be called from any thread; ``step`` /
``run_until_idle`` / the background loop (``start``) run the engine in one thread. Callbacks run
on the scheduler thread and must not block.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ccft.core.errors import CCFTError, ConfigError
from ccft.core.generation import Generation
from ccft.inference import BASE, SamplingParams, SharedPrefillEngine, StepError
from ccft.inference.scoring import prompt_logprobs


class QueueFullError(CCFTError, RuntimeError):
    """The scheduler's queue holds ``max_queue`` requests; retry later (HTTP 503)."""


class PromptTooLongError(CCFTError, ValueError):
    """A request can never be admitted: prompt + max_new_tokens exceed the engine's or the KV budget's limits."""


@dataclass
class ServeRequest:
    """One agent call.

    Attributes:
        decoder: registered decoder name (``"base"`` for the base model itself).
        prompt_ids: the whole prompt's token ids (shared context + the agent's own tokens).
        shared_len: how many leading prompt tokens are the shared context (default: the whole
            prompt). Only a hint for placing KV: outputs do not depend on it.
        max_new_tokens, stop, sampling, ignore_eos: decoding settings (``SharedPrefillEngine.add_request``).
            ``max_new_tokens`` may be 0 only with ``prompt_logprobs`` (score the prompt, generate nothing).
        session_id: the caller's session (metrics, routing); optional.
        logprobs: None, or k ≥ 0: each generated token's logprob and the k most likely tokens
            (``Ticket.token_logprobs``; ``SharedPrefillEngine.add_request(logprobs=k)``).
        prompt_logprobs: None, or k ≥ 0: the prompt's own tokens' logprobs with k top tokens, computed
            at admission on the scheduler thread (``Ticket.prompt_logprobs``; ``ccft.inference.scoring``).
        prompt_context_tokens: with ``prompt_logprobs``: the prompt's first c tokens are a context and
            the rest one continuation (``prompt_logprobs(context_tokens=c)``).
    """

    decoder: str
    prompt_ids: Sequence[int]
    shared_len: int | None = None
    max_new_tokens: int = 64
    stop: Sequence[str] | None = None
    sampling: SamplingParams | None = None
    ignore_eos: bool = False
    session_id: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_context_tokens: int | None = None


@dataclass(eq=False)
class Ticket:
    """A submitted request's state. Times are ``time.perf_counter()`` seconds.

    ``state``: queued → running → done | error | cancelled. ``tokens``: ids generated so far.
    ``result``: the ``Generation`` once done. ``done``: an event set when the request ends.
    ``token_logprobs``: with ``request.logprobs``, one ``(logprob, [(id, logprob), ...])`` per token of
    ``tokens`` (appended before ``on_token`` is called). ``prompt_logprobs``: with
    ``request.prompt_logprobs``, ``ccft.inference.scoring.prompt_logprobs`` of the prompt (set at admission).
    """

    id: int
    request: ServeRequest
    on_token: Callable[["Ticket", int], None] | None = None
    on_done: Callable[["Ticket"], None] | None = None
    state: str = "queued"
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    result: Generation | None = None
    error: str | None = None
    t_submit: float = 0.0
    t_admit: float | None = None
    t_first: float | None = None
    t_done: float | None = None
    prefix_hit_tokens: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    _cancel: bool = False
    _rid: int | None = None
    _reserved: int = 0
    _ctx: "_Context | None" = None

    def cancel(self) -> None:
        """Ask the scheduler to drop this request (thread-safe; takes effect at its next step)."""
        self._cancel = True

    @property
    def ttft(self) -> float | None:
        """Seconds from submit to the first generated token."""
        return None if self.t_first is None else self.t_first - self.t_submit

    @property
    def latency(self) -> float | None:
        """Seconds from submit to the end of the request."""
        return None if self.t_done is None else self.t_done - self.t_submit

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None with fewer than 2 tokens)."""
        if self.t_done is None or self.t_first is None or len(self.tokens) < 2:
            return None
        return (self.t_done - self.t_first) / (len(self.tokens) - 1)


@dataclass(eq=False)
class _Context:
    """A live prefilled context (one ``PrefixHandle``) and the tickets decoding on it."""

    key: tuple
    handle: object
    tokens: int
    users: int = 0


class Scheduler:
    """Continuous batching over one engine with a KV byte budget (see the module docstring).

    Args:
        engine: the ``SharedPrefillEngine`` (its decoders are the servable models).
        share: PrefillShare (True) or the per-model baseline (False).
        store: a ``PrefixKVStore`` for prompt-prefix reuse across requests (None: no reuse).
        kv_budget_bytes: cap on live KV + store bytes (None: unbounded).
        max_queue: queued requests beyond which ``submit`` raises ``QueueFullError``.
        max_prompt_tokens: longest accepted prompt (None: the engine's limits only).
    """

    def __init__(self, engine: SharedPrefillEngine, *, share: bool = True, store=None,
                 kv_budget_bytes: int | None = None, max_queue: int = 4096, max_prompt_tokens: int | None = None):
        self.engine, self.share, self.store = engine, bool(share), store
        self.kv_budget_bytes = None if kv_budget_bytes is None else int(kv_budget_bytes)
        self.max_queue, self.max_prompt_tokens = int(max_queue), max_prompt_tokens
        self.bytes_per_token = engine.kv_bytes_per_token
        self._queue: collections.deque[Ticket] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._running: dict[int, Ticket] = {}  # engine request id -> ticket
        self._contexts: dict[tuple, _Context] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.live_bytes = 0  # handles + reserved tail slots of active requests
        self.peak_live_bytes = 0
        self.peak_total_bytes = 0
        self.counters = collections.Counter()
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0

    # ------------------------------------------------------------------ submission (any thread)
    def submit(self, request: ServeRequest, *, on_token=None, on_done=None) -> Ticket:
        """Queue a request; returns its ``Ticket``.

        Raises:
            ConfigError: unknown decoder, empty prompt, bad ``shared_len`` or ``max_new_tokens``.
            PromptTooLongError: the request could never be admitted (prompt / tail / budget limits).
            QueueFullError: ``max_queue`` requests are waiting.
        """
        return self.submit_many([request], on_token=[on_token], on_done=[on_done])[0]

    def submit_many(self, requests: Sequence[ServeRequest], *, on_token: Sequence | None = None,
                    on_done: Sequence | None = None) -> list[Ticket]:
        """Queue several requests together (all or none; adjacent in the queue); one ``Ticket`` each.

        Requests over the same prompt (the ``n`` choices of one HTTP request) are admitted one after
        the other, so the first prefills the shared context and the others decode on that live
        context (``counters["context_reuse_tokens"]``): the prompt is prefilled once.
        ``on_token`` / ``on_done``: one callback (or None) per request.

        Raises:
            as ``submit`` (QueueFullError when they do not all fit in the queue).
        """
        on_token = list(on_token) if on_token is not None else [None] * len(requests)
        on_done = list(on_done) if on_done is not None else [None] * len(requests)
        for r in requests:
            self._validate(r)
        now = time.perf_counter()
        with self._lock:
            if len(self._queue) + len(requests) > self.max_queue:
                self.counters["rejected_queue_full"] += len(requests)
                raise QueueFullError(f"{len(self._queue)} requests are queued (max_queue={self.max_queue}); "
                                     "retry later or raise max_queue")
            tickets = [Ticket(next(self._ids), r, on_token=tok, on_done=done, t_submit=now)
                       for r, tok, done in zip(requests, on_token, on_done, strict=True)]
            self._queue.extend(tickets)
            self.counters["submitted"] += len(tickets)
            self._wake.notify_all()
        return tickets

    def _validate(self, r: ServeRequest) -> None:
        if r.decoder not in self.engine.decoders:
            raise ConfigError(f"unknown decoder {r.decoder!r}; served: {', '.join(self.engine.decoders)}")
        n = len(r.prompt_ids)
        k = self._handoff(r.decoder)
        if n < k + 1:
            raise ConfigError(f"prompt_ids has {n} tokens; a request needs at least handoff_tokens+1={k + 1}")
        if r.shared_len is not None and not 0 <= int(r.shared_len) <= n:
            raise ConfigError(f"shared_len={r.shared_len} is outside 0..{n} (the prompt's length)")
        if int(r.max_new_tokens) < (0 if r.prompt_logprobs is not None else 1):
            raise ConfigError(f"max_new_tokens={r.max_new_tokens}; it must be ≥ 1 (0 only with prompt_logprobs)")
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise PromptTooLongError(f"the prompt has {n} tokens but max_prompt_tokens={self.max_prompt_tokens}; "
                                     "shorten it")
        ctx, tail = self._split(r)
        if tail + r.max_new_tokens > self.engine.max_tail_tokens:
            raise PromptTooLongError(
                f"the agent's own {tail} prompt tokens + max_new_tokens={r.max_new_tokens} exceed the engine's "
                f"max_tail_tokens={self.engine.max_tail_tokens}; lower max_new_tokens or mark more of the prompt "
                "as shared (shared_len)")
        need = (ctx + tail + r.max_new_tokens) * self.bytes_per_token
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise PromptTooLongError(f"the request needs {need} bytes of KV but kv_budget_bytes="
                                     f"{self.kv_budget_bytes}; shorten the prompt or raise the budget")

    def _handoff(self, decoder: str) -> int:
        d = self.engine.decoders[decoder].decoder
        return d.handoff_tokens if d is not None else 1

    def _split(self, r: ServeRequest) -> tuple[int, int]:
        """(tokens in the context handle's prefix, tokens in the request's tail before generation)."""
        n, k = len(r.prompt_ids), self._handoff(r.decoder)
        s = n if r.shared_len is None else max(int(r.shared_len), k + 1)
        s = min(s, n)
        return s - k, n - s + k

    # ------------------------------------------------------------------ the loop (one thread)
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._running)

    @property
    def store_bytes(self) -> int:
        return 0 if self.store is None else int(self.store.bytes_in_use)

    @property
    def running(self) -> bool:
        """True while the background loop (``start``) is alive."""
        return self._thread is not None and self._thread.is_alive()

    def idle(self) -> bool:
        return not self._queue and not self._running

    def step(self) -> int:
        """Admit what fits, run one decode step, deliver tokens; returns the number of rows stepped."""
        self._reap_cancelled()
        self._admit()
        if not self._running:
            self._drop_unused_contexts()
            return 0
        t0 = time.perf_counter()
        failed: dict = {}
        try:
            outs = self.engine.step()
        except StepError as e:  # those requests were removed by the engine; the others were stepped
            outs, failed = e.outputs, e.failed
        now = time.perf_counter()
        self.decode_seconds += now - t0
        for rid, err in failed.items():
            t = self._running.get(rid)
            if t is not None:
                self.counters["failed_in_step"] += 1
                self._end(t, "error", error=f"{type(err).__name__}: {err}")
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(outs)
        for o in outs:
            t = self._running.get(o.request_id)
            if t is None:
                continue
            eos_end = o.finished and o.generation is not None and o.generation.finish_reason == "eos"
            if not eos_end:  # an ending EOS is not part of the output
                t.tokens.append(o.token_id)
                if o.logprob is not None:
                    t.token_logprobs.append((o.logprob, o.top_logprobs))
                if t.t_first is None:
                    t.t_first = now
                if t.on_token is not None:
                    t.on_token(t, o.token_id)
            if o.finished:
                if t.t_first is None:
                    t.t_first = now
                self._end(t, "done", result=o.generation)
        self._drop_unused_contexts()
        return len(outs)

    def run_until_idle(self, max_steps: int | None = None) -> None:
        """Step until no request is queued or active (or ``max_steps`` steps)."""
        n = 0
        while not self.idle() and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    def start(self) -> None:
        """Run the loop in a daemon thread (``stop`` ends it)."""
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ccft-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._queue and not self._running:
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the loop
                self._fail_all(f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ internals
    def _reap_cancelled(self) -> None:
        for rid, t in list(self._running.items()):
            if t._cancel:
                self.engine.abort(rid)
                self._end(t, "cancelled")
        if any(t._cancel for t in self._queue):
            with self._lock:
                dropped = [t for t in self._queue if t._cancel]
                self._queue = collections.deque(t for t in self._queue if not t._cancel)
            for t in dropped:
                self._end(t, "cancelled")

    def _context_key(self, r: ServeRequest, ctx_tokens: int) -> tuple:
        """(producer, its key, k, context tokens): a decoder's key follows its weights, so a context
        prefilled before an in-place edit of them is not reused (``SharedPrefillEngine.producer_key``)."""
        producer = BASE if self.share else r.decoder
        k = self._handoff(r.decoder)
        try:
            pkey = self.engine.producer_key(producer)
        except CCFTError:  # e.g. a packed decoder edited in place: add_request refuses it, with the message
            pkey = None
        return (producer, pkey, k, tuple(r.prompt_ids[: ctx_tokens + k]))

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                t = self._queue[0]
            r = t.request
            if r.max_new_tokens == 0:  # score the prompt only (echo): no KV, no lane slot
                with self._lock:
                    self._queue.popleft()
                self._score_only(t)
                continue
            if self.engine.free_slots(r.decoder) <= 0:
                return  # head of line waits for its lane
            ctx_tokens, tail = self._split(r)
            key = self._context_key(r, ctx_tokens)
            ctx = self._contexts.get(key)
            need = (tail + r.max_new_tokens) * self.bytes_per_token
            if ctx is None:
                need += ctx_tokens * self.bytes_per_token
                if self.store is not None:  # the prefill may copy up to its context's full blocks into the store
                    need += ctx_tokens // self.store.block_tokens * self.store.block_tokens * self.bytes_per_token
            if not self._make_room(need):
                self.counters["admission_waits"] += 1
                return
            with self._lock:
                self._queue.popleft()
            try:
                if r.prompt_logprobs is not None:
                    t.prompt_logprobs = self._prompt_logprobs(r)
                if ctx is None:
                    ctx = self._prefill(key, r, ctx_tokens, t)
                else:  # a live context: its whole prefix is reused
                    self.counters["context_reuse_tokens"] += ctx_tokens
                    t.prefix_hit_tokens = ctx_tokens
                prompt = list(r.prompt_ids)
                rid = self.engine.add_request(ctx.handle, 0, decoder=r.decoder, max_new_tokens=int(r.max_new_tokens),
                                              stop=r.stop, sampling=r.sampling, ignore_eos=r.ignore_eos,
                                              suffix_ids=prompt[ctx_tokens + self._handoff(r.decoder):],
                                              logprobs=r.logprobs)
            except Exception as e:  # noqa: BLE001 - the request fails, the scheduler goes on
                self._end(t, "error", error=f"{type(e).__name__}: {e}")
                continue
            ctx.users += 1
            t._ctx, t._rid, t.state, t.t_admit = ctx, rid, "running", time.perf_counter()
            t._reserved = (tail + r.max_new_tokens) * self.bytes_per_token
            self.live_bytes += t._reserved
            self._running[rid] = t
            self.counters["admitted"] += 1
            self.counters["prompt_tokens"] += len(r.prompt_ids)
            self._note_peak()

    def _prompt_logprobs(self, r: ServeRequest) -> list:
        t0 = time.perf_counter()
        out = prompt_logprobs(self.engine, r.decoder, r.prompt_ids, top=int(r.prompt_logprobs),
                              context_tokens=r.prompt_context_tokens)
        self.prefill_seconds += time.perf_counter() - t0
        self.counters["prompt_scorings"] += 1
        return out

    def _score_only(self, t: Ticket) -> None:
        """A request with ``max_new_tokens=0``: its prompt logprobs, then done with an empty generation."""
        t.state, t.t_admit = "running", time.perf_counter()
        self.counters["admitted"] += 1
        self.counters["prompt_tokens"] += len(t.request.prompt_ids)
        try:
            t.prompt_logprobs = self._prompt_logprobs(t.request)
        except Exception as e:  # noqa: BLE001 - the request fails, the scheduler goes on
            self._end(t, "error", error=f"{type(e).__name__}: {e}")
            return
        t.t_first = time.perf_counter()
        self._end(t, "done", result=Generation(text="", token_ids=[], finish_reason="length"))

    def _make_room(self, need: int) -> bool:
        if self.kv_budget_bytes is None:
            return True
        over = self.live_bytes + self.store_bytes + need - self.kv_budget_bytes
        if over > 0 and self.store is not None:
            self.store.evict(over)
        return self.live_bytes + self.store_bytes + need <= self.kv_budget_bytes

    def _prefill(self, key: tuple, r: ServeRequest, ctx_tokens: int, t: Ticket) -> _Context:
        k = self._handoff(r.decoder)
        prompt = list(r.prompt_ids[: ctx_tokens + k])
        producer = None if self.share else r.decoder
        t0 = time.perf_counter()
        if self.store is not None:
            handle, hit = self.engine.prefill_cached(prompt, self.store, producer=producer, handoff_tokens=k)
        else:
            handle, hit = self.engine.prefill([prompt], producer=producer, handoff_tokens=k), 0
        self.prefill_seconds += time.perf_counter() - t0
        self.counters["prefills"] += 1
        self.counters["prefill_tokens"] += ctx_tokens - hit
        self.counters["prefix_hit_tokens"] += hit
        t.prefix_hit_tokens = hit
        ctx = _Context(key, handle, ctx_tokens)
        self._contexts[key] = ctx
        self.live_bytes += ctx_tokens * self.bytes_per_token
        return ctx

    def _end(self, t: Ticket, state: str, *, result: Generation | None = None, error: str | None = None) -> None:
        t.state, t.result, t.error, t.t_done = state, result, error, time.perf_counter()
        if t._rid is not None:
            self._running.pop(t._rid, None)
            self.live_bytes -= t._reserved
            t._reserved = 0
            if t._ctx is not None:
                t._ctx.users -= 1
        self.counters[state] += 1
        t.done.set()
        if t.on_done is not None:
            t.on_done(t)

    def _drop_unused_contexts(self) -> None:
        """Release handles no active request reads, unless a queued request is about to use it."""
        if not self._contexts:
            return
        with self._lock:
            head = self._queue[0] if self._queue else None
        keep = None
        if head is not None and head.request.decoder in self.engine.decoders:
            keep = self._context_key(head.request, self._split(head.request)[0])
        for key, ctx in list(self._contexts.items()):
            if ctx.users == 0 and key != keep:
                ctx.handle.release()
                del self._contexts[key]
                self.live_bytes -= ctx.tokens * self.bytes_per_token

    def _note_peak(self) -> None:
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        self.peak_total_bytes = max(self.peak_total_bytes, self.live_bytes + self.store_bytes)

    def _fail_all(self, message: str) -> None:
        for rid, t in list(self._running.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                pass
            self._end(t, "error", error=message)
        self._drop_unused_contexts()

    def stats(self) -> dict:
        """Counters and gauges (bytes, queue depth, prefix reuse) for metrics and benchmarks."""
        out = dict(self.counters)
        out.update(queue_depth=self.queue_depth, active=self.active, live_kv_bytes=self.live_bytes,
                   store_bytes=self.store_bytes, peak_live_kv_bytes=self.peak_live_bytes,
                   peak_total_kv_bytes=self.peak_total_bytes, kv_budget_bytes=self.kv_budget_bytes,
                   prefill_seconds=self.prefill_seconds, decode_seconds=self.decode_seconds,
                   share=self.share)
        # prompt tokens whose KV was reused (a live shared context, or prefix-store blocks) / all prompt tokens
        reused = out.get("prefix_hit_tokens", 0) + out.get("context_reuse_tokens", 0)
        out["prefix_hit_ratio"] = reused / out["prompt_tokens"] if out.get("prompt_tokens") else 0.0
        return out
