"""``Scheduler``: continuous batching of multi-agent requests on one ``SharedPrefillEngine``.

A request is one agent call: a decoder name, a prompt of ``shared_len`` context tokens (the part
several agents / turns have in common) followed by the agent's own tokens, and decoding settings.
Each ``step()`` reads in four parts:

1. **admit** (``_admit``): the request-queue policy (``ccft.serving.policies``: FCFS or MLFQ) names the
   next queued request; it is admitted while its decoder's lane has a free slot (``max_batch``) and
   the ``KVLedger`` (``ccft.serving.kv_ledger``) makes room for its bytes; admission finds or starts
   its context's prefill and reserves its tail. Rows join between decode steps;
2. **prefill** (``_prefill_pieces``, chunked prefill only): pieces of the contexts still being prefilled;
3. **decode** (``_decode``): one engine step for the rows the policy picks (all of them, or the best
   ``max_running`` under MLFQ; the engine batches each lane's rows across sessions: LoRA decoders on
   the base share one lane);
4. **deliver** (``_deliver``): the new tokens (``Ticket.on_token``); requests that ended finish. Then the
   policy's bookkeeping (MLFQ demotion and aging) and the release of contexts nobody reads.

A request's public state is ``Ticket.state``: queued → prefilling (chunked prefill: admitted, its
context not complete) → running → done | error | cancelled.

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
``layers × 2 × kv_heads × head_dim × dtype bytes`` per token, + what a context's readers keep beside it:
a decoder at sharing depth m its own K/V in m layers, a decoder on the compact C_base the int8 codes and
scales of the context; ``SharedPrefillEngine.reader_extras``) plus the store's blocks never exceed it.
Admission first evicts unreferenced store blocks (LRU); a request that still does not fit waits in the
queue (head of line: arrival order is kept), and one that could never fit alone is refused at ``submit``
(``PromptTooLongError``). A full queue refuses new requests (``QueueFullError``). An engine whose prefix
arena has a fixed size (``max_prefix_tokens``) holds a new context only where the arena has a free range
that long: the request waits the same way while live contexts hold the room (``counters["arena_waits"]``);
one longer than the whole arena fails at its prefill (``CapacityError``).

Chunked prefill (``prefill_chunk_tokens=B``; as vLLM's chunked prefill / Sarathi-Serve): each step
has a token budget of B shared by the decode rows and pending prefills. The decode rows come first
(one token each, every step: a running request is never starved, so TPOT is bounded by one
step's work); what is left goes to the prompt contexts being prefilled, in pieces
(``SharedPrefillEngine.begin_prefill`` / ``PrefillJob.advance``) whose boundaries fall on prefix-store
block multiples (a block is never split), at least one block per step so a prefill always
progresses. A request whose context is being prefilled holds its lane slot and KV reservation and
joins the decode batch at the step its context is complete; requests reading a context still
being prefilled wait for the same pieces (one prefill per context, as without chunking). An
admitted request's own tokens (its tail) are computed at once when it joins and counted against
the step's budget. None (default): each context is prefilled whole at admission, between steps.

Policies (``policy=``, objects in ``ccft.serving.policies``; the scheduler only asks them which request
to admit, whether one more may be admitted and which rows to step): ``"fcfs"`` admits in arrival
order (head of line) and steps every active row. ``"mlfq"`` is a preemptive multi-level feedback
queue in the spirit of FastServe's skip-join MLFQ: a request enters at a priority level set by its
prompt length (level i holds prompts up to ``mlfq_entry_tokens·2^i``; skip-join: long prompts skip
the top levels), is demoted one level after it decoded its level's quantum (``mlfq_quantum·2^i``
tokens), and any request that waited ``mlfq_aging_steps`` steps without being stepped (queued or paused) is
promoted to the top level (no starvation). Admission picks the best (level, arrival) queued request; with
``max_running`` only that many of the active rows, best first, are decoded per step: the others are paused in
their engine slots (their KV kept; ``SharedPrefillEngine.step(request_ids=...)``) and resume
later with the same tokens. Under ``"fcfs"``, ``max_running`` caps admitted requests instead.
Outputs never depend on the policy or on chunking (greedy equality with the offline reference is
tested for every request).

Hot reload (``reload_decoder``): a LoRA decoder's new weights are read and validated in the caller's
thread, then copied in by the loop at its next step boundary (``SharedPrefillEngine.reload_decoder``).

Threading: ``submit``, ``reload_decoder`` and ``Ticket.cancel`` may be called from any thread; ``step`` /
``run_until_idle`` / the background loop (``start``) run the engine in one thread. Callbacks run
on the scheduler thread and must not block.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ccft.core.decoder import resolve_handoff
from ccft.core.errors import CCFTError, ConfigError
from ccft.core.generation import Generation
from ccft.core.sampling import DecodeParams
from ccft.inference import BASE, SamplingParams, SharedPrefillEngine, StepError
from ccft.inference.scoring import prompt_logprobs
from ccft.serving.kv_ledger import KVLedger
from ccft.serving.policies import LAST, RequestQueuePolicy, make_policy
from ccft.serving.prefix_match import DEFAULT_BLOCK_TOKENS, block_hashes, shared_prefix_tokens


class QueueFullError(CCFTError, RuntimeError):
    """The scheduler's queue holds ``max_queue`` requests; retry later (HTTP 503)."""


class PromptTooLongError(CCFTError, ValueError):
    """A request can never be admitted: prompt + max_new_tokens exceed the engine's or the KV budget's
    limits."""


@dataclass
class ServeRequest:
    """One agent call.

    Attributes:
        decoder: registered decoder name (``"base"`` for the base model itself).
        prompt_ids: the whole prompt's token ids (shared context + the agent's own tokens).
        shared_len: how many leading prompt tokens are the shared context (default: the whole
            prompt). Only a hint for placing KV: outputs do not depend on it.
        params: the decoding settings whole (``ccft.core.sampling.DecodeParams``), passed as they are to
            ``SharedPrefillEngine.add_request``. Without it they are built from the separate fields
            ``max_new_tokens, stop, sampling, ignore_eos, logprobs`` (kept for existing callers); with it
            those fields are set from it. ``max_new_tokens`` may be 0 only with ``prompt_logprobs`` (score the
            prompt, generate nothing).
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
    params: DecodeParams | None = None

    def __post_init__(self):
        if self.params is None:
            self.params = DecodeParams(
                max_new_tokens=self.max_new_tokens,
                stop=self.stop,
                sampling=self.sampling,
                ignore_eos=self.ignore_eos,
                logprobs=self.logprobs,
            )
        p = self.params
        self.max_new_tokens, self.stop, self.sampling = p.max_new_tokens, list(p.stop) or None, p.sampling
        self.ignore_eos, self.logprobs = p.ignore_eos, p.logprobs


@dataclass(eq=False)
class Ticket:
    """A submitted request's state. Times are ``time.perf_counter()`` seconds.

    ``state``: queued → (prefilling →) running → done | error | cancelled. ``prefilling``: admitted, its
    context still being prefilled in pieces (chunked prefill); ``running``: in the decode batch (its
    tokens may be paused by the policy). ``tokens``: ids generated so far.
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
    t_first: float | None = None
    t_done: float | None = None
    prefix_hit_tokens: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    _cancel: bool = False
    _rid: int | None = None
    _reserved: int = 0
    _ctx: "_Context | None" = None
    _blocks: list | None = None  # its prompt's block hashes (``prefix_match.block_hashes``), made once

    def cancel(self) -> None:
        """Ask the scheduler to drop this request (thread-safe; takes effect at its next step)."""
        self._cancel = True

    @property
    def cancel_requested(self) -> bool:
        """Whether ``cancel`` was called (the request ends ``"cancelled"`` at the scheduler's next step)."""
        return self._cancel

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
    job: object = None  # a ``PrefillJob`` while the context is being prefilled in pieces (chunked prefill)
    waiting: list = field(default_factory=list)  # tickets admitted onto it before it is complete
    store_reserve: int = 0  # bytes its unfinished job may still insert into the store (chunked prefill)
    extras: dict = field(default_factory=dict)  # reader_extras key -> bytes reserved (own K/V, int8 format)
    extra_kinds: dict = field(default_factory=dict)  # reader_extras key -> its ledger kind (``KVLedger``)
    nbytes: int = (
        0  # bytes of its handle reserved in the ledger (native, or its codes and scales when compact)
    )
    compact: bool = False  # read only by decoders on the compact C_base: held as int8 codes and scales
    blocks: list | None = None  # its context ids' block hashes (``prefix_match``), made once


@dataclass(eq=False)
class _PendingReload:
    """A staged decoder reload waiting for the loop's next step boundary, and its outcome."""

    staged: object
    done: threading.Event = field(default_factory=threading.Event)
    key: str | None = None
    error: BaseException | None = None


class Scheduler:
    """Continuous batching over one engine with a KV byte budget (see the module docstring).

    Args:
        engine: the ``SharedPrefillEngine`` (its decoders are the servable models).
        share: PrefillShare (True) or the per-model baseline (False).
        store: a ``PrefixKVStore`` for prompt-prefix reuse across requests (None: no reuse).
        kv_budget_bytes: cap on live KV + store bytes (None: unbounded).
        max_queue: queued requests beyond which ``submit`` raises ``QueueFullError``.
        max_prompt_tokens: longest accepted prompt (None: the engine's limits only).
        prefill_chunk_tokens: per-step token budget shared by decode rows and prefill pieces
            (chunked prefill; None: whole prefills at admission, between steps).
        policy: ``"fcfs"``, ``"mlfq"`` (see the module docstring) or a ``RequestQueuePolicy`` object
            (``ccft.serving.policies``; then ``max_running`` and the ``mlfq_*`` knobs are its own).
        max_running: rows decoded per step (``"mlfq"``: the best ones, the others paused; ``"fcfs"``:
            a cap on admitted requests). None: every active row.
        mlfq_levels, mlfq_quantum, mlfq_entry_tokens, mlfq_aging_steps: MLFQ levels, the top level's
            quantum (decode tokens; doubled per level), the top level's longest prompt (tokens;
            doubled per level) and the steps a request may wait unstepped before it is promoted.
        auto_shared_prefix: a request without ``shared_len`` shares, as its context, the longest
            whole-block prefix its prompt has in common with another request or live context
            (``ccft.serving.prefix_match``; as vLLM's and llama.cpp's prefix reuse, no hint needed).
            False: such a request's whole prompt is its context (reused only by an equal prompt).
    Raises:
        ConfigError: an unknown policy, or a knob out of range (the message names it).
    """

    POLICIES = ("fcfs", "mlfq")

    def __init__(
        self,
        engine: SharedPrefillEngine,
        *,
        share: bool = True,
        store=None,
        kv_budget_bytes: int | None = None,
        max_queue: int = 4096,
        max_prompt_tokens: int | None = None,
        prefill_chunk_tokens: int | None = None,
        policy: str | RequestQueuePolicy = "fcfs",
        max_running: int | None = None,
        mlfq_levels: int = 4,
        mlfq_quantum: int = 8,
        mlfq_entry_tokens: int = 512,
        mlfq_aging_steps: int = 64,
        auto_shared_prefix: bool = True,
    ):
        if prefill_chunk_tokens is not None and int(prefill_chunk_tokens) < 1:
            raise ConfigError(f"prefill_chunk_tokens={prefill_chunk_tokens}; it must be ≥ 1 (or None)")
        self.queue_policy = make_policy(
            policy,
            max_running=max_running,
            mlfq_levels=mlfq_levels,
            mlfq_quantum=mlfq_quantum,
            mlfq_entry_tokens=mlfq_entry_tokens,
            mlfq_aging_steps=mlfq_aging_steps,
        )
        self.policy, self.max_running = self.queue_policy.name, self.queue_policy.max_running
        self._policy_observes_steps = type(self.queue_policy).after_step is not RequestQueuePolicy.after_step
        self.prefill_chunk_tokens = None if prefill_chunk_tokens is None else int(prefill_chunk_tokens)
        self.engine, self.share, self.store = engine, bool(share), store
        self.auto_shared_prefix = bool(auto_shared_prefix)
        self.kv_budget_bytes = None if kv_budget_bytes is None else int(kv_budget_bytes)
        self.kv = KVLedger(engine.kv_bytes_per_token, self.kv_budget_bytes, store)
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
        self.counters = collections.Counter()
        self.queue_policy.counters = self.counters  # its events (MLFQ demotions, promotions) count here
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self._budget: int | None = None  # chunked prefill: tokens left in this step's budget
        self._reloads: list[_PendingReload] = []  # decoder reloads the loop applies at its next step boundary

    # KV bytes (``KVLedger``): live = handles + reserved tail slots; pending = store blocks unfinished chunked
    # prefills will insert; the peaks since start
    @property
    def live_bytes(self) -> int:
        return self.kv.live_bytes

    @property
    def pending_store_bytes(self) -> int:
        return self.kv.pending_store_bytes

    @property
    def peak_live_bytes(self) -> int:
        return self.kv.peak_live_bytes

    @property
    def peak_total_bytes(self) -> int:
        return self.kv.peak_total_bytes

    # ------------------------------------------------------------------ submission (any thread)
    def submit(self, request: ServeRequest, *, on_token=None, on_done=None) -> Ticket:
        """Queue a request; returns its ``Ticket``.

        Raises:
            ConfigError: unknown decoder, empty prompt, bad ``shared_len`` or ``max_new_tokens``.
            PromptTooLongError: the request could never be admitted (prompt / tail / budget limits).
            QueueFullError: ``max_queue`` requests are waiting.
        """
        return self.submit_many([request], on_token=[on_token], on_done=[on_done])[0]

    def submit_many(
        self,
        requests: Sequence[ServeRequest],
        *,
        on_token: Sequence | None = None,
        on_done: Sequence | None = None,
    ) -> list[Ticket]:
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
                raise QueueFullError(
                    f"{len(self._queue)} requests are queued (max_queue={self.max_queue}); "
                    "retry later or raise max_queue"
                )
            tickets = [
                Ticket(next(self._ids), r, on_token=tok, on_done=done, t_submit=now)
                for r, tok, done in zip(requests, on_token, on_done, strict=True)
            ]
            for t in tickets:
                self.queue_policy.on_submit(t)
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
        if int(r.params.max_new_tokens) < (0 if r.prompt_logprobs is not None else 1):
            raise ConfigError(
                f"max_new_tokens={r.params.max_new_tokens}; it must be ≥ 1 (0 only with prompt_logprobs)"
            )
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise PromptTooLongError(
                f"the prompt has {n} tokens but max_prompt_tokens={self.max_prompt_tokens}; shorten it"
            )
        ctx, tail = self._split(r)
        if tail + r.params.max_new_tokens > self.engine.max_tail_tokens:
            raise PromptTooLongError(
                f"the agent's own {tail} prompt tokens + max_new_tokens={r.params.max_new_tokens} exceed the "
                f"engine's max_tail_tokens={self.engine.max_tail_tokens}; lower max_new_tokens or mark more "
                "of the prompt as shared (shared_len)"
            )
        extra = sum(b for _, b in self._reader_extras(r, None, ctx))
        need = self.kv.never_fits(ctx, tail, r.params.max_new_tokens, extra)
        if need is not None:
            raise PromptTooLongError(
                f"the request needs {need} bytes of KV (its context, tail and generated tokens, and the "
                f"prefix-store blocks its prefill inserts) but kv_budget_bytes={self.kv_budget_bytes}; "
                "shorten the prompt or raise the budget"
            )

    def _reader_extras(self, r: ServeRequest, ctx: _Context | None, ctx_tokens: int) -> list[tuple[str, int]]:
        """``(key, bytes)`` the request's decoder will keep beside its context that ``ctx`` (None: a new
        context) does not hold yet: its own K/V below its sharing depth, the C_base's int8 format
        (``SharedPrefillEngine.reader_extras``); none without sharing (the decoder prefills itself)."""
        extras = getattr(self.engine, "reader_extras", None)
        if not self.share or extras is None:
            return []
        try:
            wanted = extras(r.decoder, ctx_tokens)
        except CCFTError:  # e.g. a packed decoder edited in place: add_request refuses it, with the message
            return []
        held = ctx.extras if ctx is not None else {}
        # a compact reader's context is itself the int8 copy (``_compact_context``): no format beside it
        compact = self._reads_compact(r)
        return [(k, b) for k, b in wanted if k not in held and not (compact and k.startswith("format:"))]

    def _reads_compact(self, r: ServeRequest) -> bool:
        """Whether the request's decoder reads the compact C_base on a shared context (its context is then
        held only as int8 codes and scales)."""
        return self.share and getattr(self.engine.decoders[r.decoder], "cache_format", "native") != "native"

    def _compact_context(self, ctx: _Context) -> None:
        """Replace a complete context's native handle by its compact copy (``SharedPrefillEngine.compact``)
        when only decoders on the compact C_base read it: the native K/V are freed, the ledger then holds
        the codes' and scales' bytes instead."""
        if not ctx.compact or ctx.handle.cache_format != "native":
            return
        compact = self.engine.compact(ctx.handle)
        ctx.handle.release()
        ctx.handle = compact
        self.kv.release(ctx.nbytes)
        ctx.nbytes = self.kv.reserve(compact.nbytes)

    def _release_context(self, ctx: _Context) -> None:
        """Count a released context's bytes (its prefix and what its readers kept beside it) as free."""
        self.kv.release(ctx.nbytes)
        for key, nbytes in ctx.extras.items():
            self.kv.release(nbytes, ctx.extra_kinds[key])
        ctx.extras, ctx.extra_kinds = {}, {}

    def _handoff(self, decoder: str) -> int:
        """The k this decoder's requests recompute (``resolve_handoff``: its own; the base's is 1)."""
        d = self.engine.decoders[decoder].decoder
        return resolve_handoff([d.handoff_tokens] if d is not None else [], what=f"decoder {decoder!r}")

    def _split(self, r: ServeRequest) -> tuple[int, int]:
        """(tokens in the context handle's prefix, tokens in the request's tail before generation). A decoder
        reading the compact C_base (``cache_format`` int8) takes its whole prompt as the context: a key
        channel's scale covers the prefix it quantises, so the cache of a context cannot be extended by an
        agent's own tokens (``SharedPrefillEngine.add_request`` refuses ``suffix_ids`` for it)."""
        n, k = len(r.prompt_ids), self._handoff(r.decoder)
        whole = r.shared_len is None or self._reads_compact(r)
        s = n if whole else max(int(r.shared_len), k + 1)
        s = min(s, n)
        return s - k, n - s + k

    def reload_decoder(self, name: str, path, *, timeout: float | None = None) -> str:
        """Swap LoRA decoder ``name``'s weights for those of decoder folder ``path``, at a step boundary.

        The folder is read and validated in the calling thread (``SharedPrefillEngine.stage_reload``), so
        the scheduler loop is not held up and nothing changes when it is refused; the loop then copies
        the weights in before its next step (at once when the loop is not running). Requests of that
        decoder already decoding go on with the new weights; every request admitted after this returns
        reads only them. Any thread may call it.

        Args:
            timeout: seconds to wait for the loop (None: no limit).
        Returns:
            the decoder's new producer key.
        Raises:
            ConfigError, FingerprintMismatchError, IncompatibleModelError: the folder is refused (as
                ``SharedPrefillEngine.stage_reload``; the message names the field and the fix).
            TimeoutError: the loop did not reach a step boundary within ``timeout`` (nothing changed).
            RuntimeError: the scheduler stopped before applying it (nothing changed).
        """
        staged = self.engine.stage_reload(name, path)
        if not self.running:
            return self._apply_reload(staged)
        pending = _PendingReload(staged)
        with self._lock:
            self._reloads.append(pending)
            self._wake.notify_all()
        if not pending.done.wait(timeout):
            with self._lock:
                if pending in self._reloads:  # not started: withdraw it
                    self._reloads.remove(pending)
                    raise TimeoutError(
                        f"reload of decoder {name!r}: the scheduler did not reach a step boundary in "
                        f"{timeout} s; nothing was changed, retry"
                    )
            pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.key

    def _apply_reload(self, staged) -> str:
        key = self.engine.reload_decoder(staged.name, staged)
        self.counters["reloads"] += 1
        return key

    def _run_reloads(self) -> None:
        """Apply the pending reloads (scheduler thread, between steps)."""
        if not self._reloads:
            return
        with self._lock:
            pending, self._reloads = self._reloads, []
        for p in pending:
            try:
                p.key = self._apply_reload(p.staged)
            except Exception as e:  # noqa: BLE001 - handed to the caller of reload_decoder
                p.error = e
            p.done.set()

    # ------------------------------------------------------------------ the loop (one thread)
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._running)

    @property
    def store_bytes(self) -> int:
        return self.kv.store_bytes

    @property
    def arena_bytes(self) -> int:
        """Bytes the engine's prefix arena holds (its whole capacity: it grows, it is not given back)."""
        arena = getattr(self.engine, "arena", None)
        return int(arena.nbytes) if arena is not None else 0

    @property
    def live_contexts(self) -> int:
        """Prefilled (or being prefilled) contexts held: one handle each."""
        return len(self._contexts)

    def prefill_progress(self) -> list[tuple[int, int]]:
        """``(positions computed, positions in all)`` of each context being prefilled in pieces (chunked
        prefill)."""
        return [
            (c.job.total - c.job.remaining, c.job.total) for c in self._contexts.values() if c.job is not None
        ]

    @property
    def running(self) -> bool:
        """True while the background loop (``start``) is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt positions of contexts still being prefilled in pieces (chunked prefill), not computed
        yet."""
        return sum(c.job.remaining for c in self._contexts.values() if c.job is not None)

    def _waiting_tickets(self) -> list[Ticket]:
        return [t for c in self._contexts.values() for t in c.waiting]

    def idle(self) -> bool:
        return not self._queue and not self._running and not any(c.waiting for c in self._contexts.values())

    def step(self) -> int:
        """One scheduling iteration: (pending decoder reloads →) admit → prefill (pieces) → decode → deliver;
        returns the rows decoded. A prefix pool publishes the blocks the step computed after it
        (``PrefixPool.deferred``), so publishing never delays the step's own first tokens."""
        pool = getattr(self.store, "pool", None)
        if pool is None:
            return self._step()
        with pool.deferred():
            return self._step()

    def _step(self) -> int:
        self._run_reloads()
        self._reap_cancelled()
        self._budget = self._step_token_budget()
        self._admit()
        self._prefill_pieces()
        outs, stepped = self._decode()
        self._deliver(outs)
        if self._policy_observes_steps:  # MLFQ's aging; FCFS keeps no per-step state (no list built per step)
            self.queue_policy.after_step(self._live_tickets(), stepped)
        self._drop_unused_contexts()
        return len(outs)

    def _step_token_budget(self) -> int | None:
        """Chunked prefill: the step's token budget left for prefill pieces after one token per decode row."""
        if self.prefill_chunk_tokens is None:
            return None
        return self.prefill_chunk_tokens - len(self.queue_policy.rows_to_step(self._running) or self._running)

    def _decode(self) -> tuple[list, set[int]]:
        """One engine decode step over the rows the policy picks; (outputs, ids of the tickets stepped).
        Requests the engine could not step fail alone (``StepError``)."""
        if not self._running:
            return [], set()
        chosen = self.queue_policy.rows_to_step(self._running)
        rids = self._running.keys() if chosen is None else chosen
        stepped = {self._running[rid].id for rid in rids}
        t0 = time.perf_counter()
        failed: dict = {}
        try:
            outs = self.engine.step(request_ids=chosen)
        except StepError as e:  # those requests were removed by the engine; the others were stepped
            outs, failed = e.outputs, e.failed
        self.decode_seconds += time.perf_counter() - t0
        for rid, err in failed.items():
            t = self._running.get(rid)
            if t is not None:
                self.counters["failed_in_step"] += 1
                self._end(t, "error", error=f"{type(err).__name__}: {err}")
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(outs)
        return outs, stepped

    def _deliver(self, outs) -> None:
        """Hand each new token to its ticket (``on_token``) and end the requests that finished."""
        now = time.perf_counter()
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

    def _live_tickets(self) -> list[Ticket]:
        """Every ticket not ended: running, waiting for its context's prefill, queued."""
        with self._lock:  # submit may append from another thread
            queued = list(self._queue)
        return list(self._running.values()) + self._waiting_tickets() + queued

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
        with self._lock:
            pending, self._reloads = self._reloads, []
        for p in pending:
            p.error = RuntimeError(f"the scheduler stopped before reloading decoder {p.staged.name!r}")
            p.done.set()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and self.idle() and not self._reloads:
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
        for t in self._waiting_tickets():
            if t._cancel:
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
        compact = ("int8",) if self._reads_compact(r) else ()  # held in another format: another context
        return (producer, pkey, k, tuple(r.prompt_ids[: ctx_tokens + k]), *compact)

    def _next_queued(self) -> Ticket | None:
        """The queued request admission considers next (``RequestQueuePolicy.next_to_admit``)."""
        with self._lock:
            return self.queue_policy.next_to_admit(self._queue)

    def _dequeue(self, t: Ticket) -> None:
        with self._lock:
            self._queue.remove(t)

    def _free_slots(self, decoder: str) -> int:
        """The decoder lane's free slots less those held by tickets waiting for their context's prefill."""
        lane = self.engine.decoders[decoder].lane
        held = sum(1 for t in self._waiting_tickets() if self.engine.decoders[t.request.decoder].lane is lane)
        return self.engine.free_slots(decoder) - held

    def _admit(self) -> None:
        while True:
            t = self._next_queued()
            if t is None:
                return
            r = t.request
            if r.params.max_new_tokens == 0:  # score the prompt only (echo): no KV, no lane slot
                self._dequeue(t)
                self._score_only(t)
                continue
            if self._free_slots(r.decoder) <= 0:
                return  # head of line waits for its lane
            if not self.queue_policy.may_admit(len(self._running) + len(self._waiting_tickets())):
                return
            r = self._detect_shared(t)
            ctx_tokens, tail = self._split(r)
            key = self._context_key(r, ctx_tokens)
            ctx = self._contexts.get(key)
            if ctx is None and self._arena_wait(ctx_tokens):
                self.counters["arena_waits"] += 1
                return
            need = self.kv.admission_bytes(ctx_tokens, tail, r.params.max_new_tokens, new_context=ctx is None)
            extras = self._reader_extras(r, ctx, ctx_tokens)
            need += sum(b for _, b in extras)
            if not self.kv.make_room(need):
                self.counters["admission_waits"] += 1
                return
            self._dequeue(t)
            try:
                if r.prompt_logprobs is not None:
                    t.prompt_logprobs = self._prompt_logprobs(r)
                if ctx is None:
                    ctx = self._prefill(key, r, ctx_tokens, t)
                else:  # a live context (or one being prefilled): its whole prefix is reused
                    self.counters["context_reuse_tokens"] += ctx_tokens
                    t.prefix_hit_tokens = ctx_tokens
            except Exception as e:  # noqa: BLE001 - the request fails, the scheduler goes on
                self._end(t, "error", error=f"{type(e).__name__}: {e}")
                continue
            for key, nbytes in extras:  # held by the context from now on, released with it
                if key not in ctx.extras:
                    # by decoder name in the ledger: its own K/V ("own:NAME"), or the format kept beside
                    kind = f"own:{r.decoder}" if key.startswith("own:") else key
                    ctx.extras[key] = self.kv.reserve(nbytes, kind)
                    ctx.extra_kinds[key] = kind
            ctx.users += 1
            t._ctx = ctx
            t._reserved = self.kv.reserve(self.kv.request_bytes(tail, r.params.max_new_tokens), "tail")
            self.counters["admitted"] += 1
            self.counters["prompt_tokens"] += len(r.prompt_ids)
            self.kv.note_peak()
            if ctx.job is not None:
                t.state = "prefilling"
                ctx.waiting.append(t)  # joins the decode batch when its context is complete
            else:
                self._join(t)

    def _detect_shared(self, t: Ticket) -> ServeRequest:
        """``t.request`` with ``shared_len`` set to the longest whole-block prefix its prompt shares with
        another request held (queued, prefilling, running) or a live context (``prefix_match``), when it
        came without one (``auto_shared_prefix``); a copy, so the caller's request is not changed. Kept as
        it is when nothing is shared, or when the rest of the prompt would not fit the tail pool."""
        r = t.request
        if r.shared_len is not None or not self.auto_shared_prefix or self._reads_compact(r):
            return r
        block = self.store.block_tokens if self.store is not None else DEFAULT_BLOCK_TOKENS
        with self._lock:
            queued = list(self._queue)
        others = [o for o in (*queued, *self._running.values(), *self._waiting_tickets()) if o is not t]
        pairs = [(o.request.prompt_ids, self._blocks_of(o, block)) for o in others]
        for ctx in self._contexts.values():
            if ctx.blocks is None:
                ctx.blocks = block_hashes(ctx.key[3], block)
            pairs.append((ctx.key[3], ctx.blocks))
        shared = shared_prefix_tokens(r.prompt_ids, self._blocks_of(t, block), pairs, block)
        n, k = len(r.prompt_ids), self._handoff(r.decoder)
        if shared == 0 or n - shared + k + r.params.max_new_tokens > self.engine.max_tail_tokens:
            return r
        t.request = dataclasses.replace(r, shared_len=shared)
        self.counters["auto_shared_tokens"] += shared
        return t.request

    @staticmethod
    def _blocks_of(t: Ticket, block: int) -> list:
        if t._blocks is None:
            t._blocks = block_hashes(t.request.prompt_ids, block)
        return t._blocks

    def _arena_wait(self, tokens: int) -> bool:
        """Whether a new context of ``tokens`` waits for the engine's prefix arena: a fixed-size arena
        (``max_prefix_tokens``) with no free range that large now, while live contexts, once released, can
        make one. A context larger than the whole arena does not wait: its prefill raises CapacityError (the
        request fails), as at any full arena."""
        arena = getattr(self.engine, "arena", None)
        if arena is None or arena.max_tokens is None or not self._contexts:
            return False
        return tokens <= arena.max_tokens and not arena.fits(tokens)

    def _join(self, t: Ticket) -> None:
        """Add an admitted ticket (its context complete) to the engine: its tail is computed now."""
        r, ctx = t.request, t._ctx
        ctx_tokens = self._split(r)[0]
        suffix = list(r.prompt_ids)[ctx_tokens + self._handoff(r.decoder) :]
        t0 = time.perf_counter()
        try:
            rid = self.engine.add_request(
                ctx.handle, 0, decoder=r.decoder, params=r.params, suffix_ids=suffix
            )
        except Exception as e:  # noqa: BLE001 - the request fails, the scheduler goes on
            self._end(t, "error", error=f"{type(e).__name__}: {e}")
            return
        self.prefill_seconds += time.perf_counter() - t0
        own = len(suffix) + self._handoff(
            r.decoder
        )  # the request's own prompt tokens, computed on its context
        self.counters["tail_tokens"] += own
        if self._budget is not None:
            self._budget -= own
        t._rid, t.state = rid, "running"
        self._running[rid] = t

    def _prefill_pieces(self) -> None:
        """Chunked prefill: spend what is left of the step's budget on contexts being prefilled (best
        waiting request first), in pieces on block multiples, at least one block per step."""
        pending = [c for c in self._contexts.values() if c.job is not None]
        if self.prefill_chunk_tokens is None or not pending:
            return
        align = self.store.block_tokens if self.store is not None else 1
        # a context no admitted request waits for (kept for the queue's head) comes last
        pending.sort(key=lambda c: min((self.queue_policy.order(t) for t in c.waiting), default=LAST))
        progressed = False
        for ctx in pending:
            left = max(0, self._budget or 0)
            grant = left // align * align
            if grant == 0:
                if progressed:
                    break
                grant = align  # a prefill always progresses
            t0 = time.perf_counter()
            try:
                done = ctx.job.advance(grant)
                if ctx.job.remaining == 0:
                    handle, hit = ctx.job.finish()
                    ctx.handle, ctx.job = handle, None
                    self._release_store_reserve(ctx)  # its blocks are in the store now (store_bytes)
                    self._compact_context(ctx)
            except Exception as e:  # noqa: BLE001 - the context's requests fail, the scheduler goes on
                self._fail_context(ctx, f"{type(e).__name__}: {e}")
                continue
            self.prefill_seconds += time.perf_counter() - t0
            progressed = True
            self._budget = (self._budget or 0) - done
            self.counters["prefill_chunks"] += 1
            self.counters["prefill_tokens"] += done
            if ctx.job is None:
                self.kv.note_peak()
                for t in list(ctx.waiting):
                    ctx.waiting.remove(t)
                    self._join(t)

    def _fail_context(self, ctx: _Context, message: str) -> None:
        for t in list(ctx.waiting):
            self._end(t, "error", error=message)
        if ctx.job is not None:
            ctx.job.cancel()
            ctx.job = None
        self._release_store_reserve(ctx)
        if self._contexts.get(ctx.key) is ctx:
            del self._contexts[ctx.key]
            self._release_context(ctx)

    def _prompt_logprobs(self, r: ServeRequest) -> list:
        t0 = time.perf_counter()
        out = prompt_logprobs(
            self.engine,
            r.decoder,
            r.prompt_ids,
            top=int(r.prompt_logprobs),
            context_tokens=r.prompt_context_tokens,
        )
        self.prefill_seconds += time.perf_counter() - t0
        self.counters["prompt_scorings"] += 1
        return out

    def _score_only(self, t: Ticket) -> None:
        """A request with ``max_new_tokens=0``: its prompt logprobs, then done with an empty generation."""
        t.state = "running"
        self.counters["admitted"] += 1
        self.counters["prompt_tokens"] += len(t.request.prompt_ids)
        try:
            t.prompt_logprobs = self._prompt_logprobs(t.request)
        except Exception as e:  # noqa: BLE001 - the request fails, the scheduler goes on
            self._end(t, "error", error=f"{type(e).__name__}: {e}")
            return
        t.t_first = time.perf_counter()
        self._end(t, "done", result=Generation(text="", token_ids=[], finish_reason="length"))

    def _release_store_reserve(self, ctx: _Context) -> None:
        self.kv.release_store(ctx.store_reserve)
        ctx.store_reserve = 0

    def _prefill(self, key: tuple, r: ServeRequest, ctx_tokens: int, t: Ticket) -> _Context:
        k = self._handoff(r.decoder)
        prompt = list(r.prompt_ids[: ctx_tokens + k])
        producer = None if self.share else r.decoder
        t0 = time.perf_counter()
        if self.prefill_chunk_tokens is not None:  # pieces in the coming steps (``_prefill_pieces``)
            job = self.engine.begin_prefill(prompt, self.store, producer=producer, handoff_tokens=k)
            self.prefill_seconds += time.perf_counter() - t0
            self.counters["prefills"] += 1
            self.counters["prefix_hit_tokens"] += job.hit
            t.prefix_hit_tokens = job.hit
            ctx = _Context(key, job.handle, ctx_tokens, job=job, compact=self._reads_compact(r))
            # the full blocks it does not find in the store are inserted at finish
            blocks = self.kv.store_block_tokens(ctx_tokens)
            ctx.store_reserve = self.kv.reserve_store(self.kv.bytes(max(0, blocks - job.hit)))
            self._contexts[key] = ctx
            ctx.nbytes = self.kv.reserve(self.kv.bytes(ctx_tokens))
            return ctx
        if self.store is not None:
            handle, hit = self.engine.prefill_cached(prompt, self.store, producer=producer, handoff_tokens=k)
        else:
            handle, hit = self.engine.prefill([prompt], producer=producer, handoff_tokens=k), 0
        self.prefill_seconds += time.perf_counter() - t0
        self.counters["prefills"] += 1
        self.counters["prefill_tokens"] += ctx_tokens - hit
        self.counters["prefix_hit_tokens"] += hit
        t.prefix_hit_tokens = hit
        ctx = _Context(key, handle, ctx_tokens, compact=self._reads_compact(r))
        self._contexts[key] = ctx
        ctx.nbytes = self.kv.reserve(self.kv.bytes(ctx_tokens))
        self._compact_context(ctx)
        return ctx

    def _end(
        self, t: Ticket, state: str, *, result: Generation | None = None, error: str | None = None
    ) -> None:
        t.state, t.result, t.error, t.t_done = state, result, error, time.perf_counter()
        if t._rid is not None:
            self._running.pop(t._rid, None)
        if t._ctx is not None:  # admitted: its reservation and its use of the context end
            self.kv.release(t._reserved, "tail")
            t._reserved = 0
            t._ctx.users -= 1
            if t in t._ctx.waiting:
                t._ctx.waiting.remove(t)
            t._ctx = None
        self.counters[state] += 1
        self.queue_policy.forget(t)
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
                if ctx.job is not None:
                    ctx.job.cancel()  # a prefill in pieces nobody waits for any more
                    self._release_store_reserve(ctx)
                else:
                    ctx.handle.release()
                del self._contexts[key]
                self._release_context(ctx)

    def _fail_all(self, message: str) -> None:
        for rid, t in list(self._running.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                pass
            self._end(t, "error", error=message)
        for ctx in list(self._contexts.values()):
            if ctx.waiting:
                self._fail_context(ctx, message)
        self._drop_unused_contexts()

    def stats(self) -> dict:
        """Counters and gauges (bytes, queue depth, prefix reuse) for metrics and benchmarks."""
        out = dict(self.counters)
        out.update(
            queue_depth=self.queue_depth,
            active=self.active,
            live_kv_bytes=self.live_bytes,
            store_bytes=self.store_bytes,
            peak_live_kv_bytes=self.peak_live_bytes,
            peak_total_kv_bytes=self.peak_total_bytes,
            # by kind: "context" (C_base, native or int8), "tail", "own:NAME", "format:FMT" (``KVLedger``)
            peak_kv_bytes_by_kind=dict(self.kv.peak_by_kind),
            kv_budget_bytes=self.kv_budget_bytes,
            prefill_seconds=self.prefill_seconds,
            decode_seconds=self.decode_seconds,
            share=self.share,
            policy=self.policy,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            max_running=self.max_running,
            pending_prefill_tokens=self.pending_prefill_tokens,
        )
        # prompt tokens whose KV was reused (a live shared context, or prefix-store blocks) / all prompt
        # tokens
        reused = out.get("prefix_hit_tokens", 0) + out.get("context_reuse_tokens", 0)
        out["prefix_hit_ratio"] = reused / out["prompt_tokens"] if out.get("prompt_tokens") else 0.0
        return out
