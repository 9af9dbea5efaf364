"""Request routing across serving workers (pure Python; no model code).

A *worker* is one engine (one device, or one vLLM decode instance) with its own prefix KV store.
A multi-agent session's turns share a growing context, so sending every turn of a session to the
worker that already holds its prefix saves the prefix's prefill there; spreading the turns
recomputes it on every worker they visit.

Interface: ``router.place(session_id, prompt_ids, workers_state) -> worker index`` before a
request is queued, ``router.on_finish(session_id, worker, session_done=...)`` after it ends.
``workers_state`` is a sequence with one entry per worker: a :class:`WorkerState`, any object
with ``queued`` and ``active`` attributes, a mapping with those keys, or a plain int (the load).
A worker's *load* is ``queued + active`` requests.

Routers (``ROUTERS`` / :func:`make_router`):

``session`` (:class:`SessionAffinityRouter`)
    A new session goes to the least-loaded worker (ties: lowest index); later requests of the
    session go where it was placed before, unless that worker is overloaded relative to the
    least-loaded one (``load_home - load_min >= min_load_gap`` **and**
    ``load_home > max_load_ratio * load_min``), in which case the request goes to the
    least-loaded worker and the session is re-pinned there (its prefix is prefilled there now).
``prefix`` (:class:`PrefixRouter`)
    Places a request where the blocks of its prompt are: it remembers, per worker, the chain keys
    (``ccft.serving.block_keys.chain_keys``, the prefix store's block identity) of the prompts it
    placed there, in an LRU of at most ``max_keys_per_worker`` keys, and sends a request to the
    worker holding the longest prefix of its chain among the workers that are not overloaded (the
    ``session`` rule against the least-loaded worker); no match: the least-loaded worker. A known
    session still goes home unless its home is overloaded, as with ``session``.
``least-loaded`` (:class:`LeastLoadedRouter`)
    Every request to the least-loaded worker (ties: lowest index); sessions are ignored.
``round-robin`` (:class:`RoundRobinRouter`)
    Workers in turn, ignoring load and sessions.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ccft.core.errors import ConfigError
from ccft.serving.block_keys import chain_keys

__all__ = [
    "ROUTERS",
    "LeastLoadedRouter",
    "PrefixRouter",
    "RoundRobinRouter",
    "Router",
    "SessionAffinityRouter",
    "WorkerState",
    "make_router",
    "worker_loads",
]


@dataclass(frozen=True)
class WorkerState:
    """What a router sees of one worker: requests waiting in its queue and requests decoding."""

    queued: int = 0
    active: int = 0

    @property
    def load(self) -> int:
        return self.queued + self.active


def _load(state: Any) -> int:
    if isinstance(state, bool):
        raise ConfigError(
            f"workers_state: a worker's state must be a WorkerState, a mapping with queued/active, "
            f"or an int load; got {state!r}"
        )
    if isinstance(state, int):
        return state
    if isinstance(state, Mapping):
        return int(state.get("queued", 0)) + int(state.get("active", 0))
    if hasattr(state, "queued") and hasattr(state, "active"):
        return int(state.queued) + int(state.active)
    raise ConfigError(
        f"workers_state: a worker's state must be a WorkerState, a mapping with queued/active, or "
        f"an int load; got {type(state).__name__}"
    )


def worker_loads(workers_state: Sequence[Any]) -> list[int]:
    """The load (queued + active requests) of every worker; ConfigError when there is no worker."""
    loads = [_load(s) for s in workers_state]
    if not loads:
        raise ConfigError("workers_state: empty; a router needs at least one worker")
    return loads


def _check_count(option: str, value: Any, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{option}: must be an int >= 1 ({meaning}), got {value!r}")


def _least_loaded(loads: Sequence[int]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i], i))


class Router(abc.ABC):
    """Chooses the worker for each request. Subclasses implement :meth:`place`."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def place(self, session_id: Hashable, prompt_ids: Sequence[int], workers_state: Sequence[Any]) -> int:
        """Index of the worker that serves this request (``0 <= index < len(workers_state)``)."""

    def on_finish(self, session_id: Hashable, worker: int, *, session_done: bool = False) -> None:
        """A request of ``session_id`` finished on ``worker``; ``session_done``: it was the session's last."""
        return None

    def stats(self) -> dict[str, int]:
        """Counters for reports (empty for stateless routers)."""
        return {}


class RoundRobinRouter(Router):
    """Workers in turn: request k goes to worker ``k mod n`` (load and sessions ignored)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def place(self, session_id, prompt_ids, workers_state) -> int:
        n = len(worker_loads(workers_state))
        index = self._next % n
        self._next = index + 1
        return index


class LeastLoadedRouter(Router):
    """The worker with the fewest queued + active requests (ties: lowest index)."""

    name = "least-loaded"

    def place(self, session_id, prompt_ids, workers_state) -> int:
        return _least_loaded(worker_loads(workers_state))


class SessionAffinityRouter(Router):
    """Keeps a session on the worker that holds its prefix, with a load-aware fallback.

    Args:
        max_load_ratio: fall back only when the home worker's load exceeds this multiple of the
            least-loaded worker's load ...
        min_load_gap: ... and exceeds it by at least this many requests. Both must hold, so a
            session moves (and pays one prefix prefill on the new worker) only on a large
            imbalance, absolute and relative. Defaults: 2.0 and 4.
    Counters (:meth:`stats`): ``new`` sessions placed, ``affinity`` requests sent home,
    ``fallback`` requests moved off an overloaded home, ``sessions`` currently pinned.
    """

    name = "session"

    def __init__(self, *, max_load_ratio: float = 2.0, min_load_gap: int = 4) -> None:
        if max_load_ratio < 1.0:
            raise ConfigError(
                f"max_load_ratio: must be >= 1.0 (a home worker at most that many times busier than "
                f"the least-loaded one keeps its sessions), got {max_load_ratio}"
            )
        if min_load_gap < 1:
            raise ConfigError(f"min_load_gap: must be >= 1 request, got {min_load_gap}")
        self.max_load_ratio = float(max_load_ratio)
        self.min_load_gap = int(min_load_gap)
        self.placement: dict[Hashable, int] = {}
        self._counts = {"new": 0, "affinity": 0, "fallback": 0}

    def overloaded(self, home_load: int, least_load: int) -> bool:
        """Does a home worker at ``home_load`` give its session up to one at ``least_load``?"""
        return home_load - least_load >= self.min_load_gap and home_load > self.max_load_ratio * least_load

    def place(self, session_id, prompt_ids, workers_state) -> int:
        loads = worker_loads(workers_state)
        least = _least_loaded(loads)
        home = self.placement.get(session_id)
        if home is None or home >= len(loads):
            self._counts["new"] += 1
            choice = least
        elif self.overloaded(loads[home], loads[least]):
            self._counts["fallback"] += 1
            choice = least
        else:
            self._counts["affinity"] += 1
            choice = home
        self.placement[session_id] = choice
        return choice

    def on_finish(self, session_id, worker, *, session_done=False) -> None:
        if session_done:
            self.forget(session_id)

    def forget(self, session_id: Hashable) -> None:
        """Drop a session's placement (its next request is placed as a new session)."""
        self.placement.pop(session_id, None)

    def stats(self) -> dict[str, int]:
        return {**self._counts, "sessions": len(self.placement)}


#: the producer under which the ``prefix`` router keys prompts (it never reads K/V, see PrefixRouter)
ROUTE_PRODUCER = "ccft-route"


class PrefixRouter(SessionAffinityRouter):
    """Places a request on the worker that holds the longest prefix of its prompt's blocks.

    A prompt is keyed by the chain hash of its full ``block_tokens``-token blocks
    (``ccft.serving.block_keys.chain_keys``, the function the prefix store keys its K/V with), under
    the fixed producer :data:`ROUTE_PRODUCER`: routing never serves K/V, so a preference that turns
    out wrong (a block the worker's store has evicted, or one written by another decoder in the
    no-share mode) costs a prefill or a pool fetch there, never a wrong answer. The store itself
    checks producer, dtype and tokens on every hit.

    For every request (with or without a session id): a known session whose home worker is not
    overloaded goes home (the ``session`` rule, :meth:`SessionAffinityRouter.overloaded`, against
    the least-loaded worker). Otherwise the request goes to the worker with the longest match of its
    chain (a worker *matches* ``m`` blocks when it holds the key of block ``m-1``: that key covers
    every token before it) among the workers that are not overloaded; ties: least load, then lowest
    index; no match anywhere: the least-loaded worker. Its chain's keys are then recorded on the
    chosen worker, head last (so an LRU trims a chain's tail before its head, as the store does),
    and a session is pinned there.

    A prompt given as text (a ``str``: a request whose token ids the caller does not know) is keyed
    the same way over the text's code points, in blocks of ``CHARS_PER_TOKEN * block_tokens``
    characters and under another producer, so text and token keys never meet.

    Args:
        block_tokens: tokens per block; use the workers' prefix store block size (``ccft serve
            --block-tokens``) so that a match is a run of blocks the store can serve. Default 16.
        max_keys_per_worker: the most chain keys remembered per worker (least recently placed
            dropped first); 16 bytes of key plus the LRU's overhead (about 100 bytes) each. Default
            16384 (262144 tokens of prompt blocks per worker at 16 tokens a block).
        max_load_ratio, min_load_gap: the overload rule of :class:`SessionAffinityRouter`.
    Raises:
        ConfigError: ``block_tokens`` < 1, ``max_keys_per_worker`` < 1, or a bad overload option.

    Counters (:meth:`stats`): those of :class:`SessionAffinityRouter` (``new`` counts requests
    without a session too), ``prefix`` (requests placed on a worker that held at least one of their
    blocks, affinity excluded), ``matched_blocks`` (those requests' matched blocks, summed),
    ``keys`` (chain keys remembered over all workers).
    """

    name = "prefix"
    #: characters of a text prompt per token of ``block_tokens`` (about one token of English text)
    CHARS_PER_TOKEN: ClassVar[int] = 4

    def __init__(
        self,
        *,
        block_tokens: int = 16,
        max_keys_per_worker: int = 16384,
        max_load_ratio: float = 2.0,
        min_load_gap: int = 4,
    ) -> None:
        super().__init__(max_load_ratio=max_load_ratio, min_load_gap=min_load_gap)
        _check_count(
            "block_tokens", block_tokens, "the workers' prefix store block size, ccft serve --block-tokens"
        )
        _check_count(
            "max_keys_per_worker",
            max_keys_per_worker,
            "chain keys remembered per worker, ccft serve --router-keys; e.g. 16384",
        )
        self.block_tokens = block_tokens
        self.max_keys_per_worker = max_keys_per_worker
        #: worker id -> chain keys placed there, least recently placed first
        self.held: dict[Hashable, OrderedDict[bytes, None]] = {}
        self._counts.update(prefix=0, matched_blocks=0)

    def keys(self, prompt: Sequence[int] | str) -> list[bytes]:
        """The chain keys of ``prompt``'s full blocks: token ids, or text (see the class docstring).

        Returns:
            ``len(prompt) // block_tokens`` keys for token ids, ``len(prompt) // (CHARS_PER_TOKEN *
            block_tokens)`` for text.
        """
        if isinstance(prompt, str):
            chars = self.CHARS_PER_TOKEN * self.block_tokens
            return chain_keys(ROUTE_PRODUCER + "-text", "chars", chars, [ord(c) for c in prompt])
        return chain_keys(ROUTE_PRODUCER, "tokens", self.block_tokens, prompt)

    def matched_blocks(self, keys: Sequence[bytes], worker_id: Hashable) -> int:
        """How many leading blocks of the chain ``keys`` the router placed on ``worker_id`` (0: none)."""
        held = self.held.get(worker_id)
        if not held:
            return 0
        for m in range(len(keys), 0, -1):
            if keys[m - 1] in held:
                return m
        return 0

    def place(
        self, session_id, prompt_ids, workers_state, worker_ids: Sequence[Hashable] | None = None
    ) -> int:
        """Index of the worker for this request (class docstring); records its blocks there.

        Args:
            session_id: the session (``None``: a request without one; it is not pinned).
            prompt_ids: the prompt's token ids, or its text (a ``str``) when the ids are not known.
            workers_state: one state per worker (module docstring).
            worker_ids: a stable id per worker (default: the indices), for callers whose worker list
                changes (``ccft.serving.ray_serve``: replica ids); the blocks recorded under an id
                absent from the list are forgotten.
        Raises:
            ConfigError: ``worker_ids`` of another length than ``workers_state``, or a bad state.
        """
        loads = worker_loads(workers_state)
        ids = list(range(len(loads))) if worker_ids is None else list(worker_ids)
        if len(ids) != len(loads):
            raise ConfigError(
                f"worker_ids: {len(ids)} ids for {len(loads)} workers; give one id per workers_state entry"
            )
        for gone in [w for w in self.held if w not in ids]:
            del self.held[gone]
        least = _least_loaded(loads)
        keys = self.keys(prompt_ids)
        home = None if session_id is None else self.placement.get(session_id)
        if home is not None and home < len(loads) and not self.overloaded(loads[home], loads[least]):
            self._counts["affinity"] += 1
            choice = home
        else:
            self._counts["fallback" if home is not None and home < len(loads) else "new"] += 1
            ok = [i for i in range(len(loads)) if not self.overloaded(loads[i], loads[least])]
            match = {i: self.matched_blocks(keys, ids[i]) for i in ok}
            choice = max(ok, key=lambda i: (match[i], -loads[i], -i))
            if match[choice]:
                self._counts["prefix"] += 1
                self._counts["matched_blocks"] += match[choice]
        if session_id is not None:
            self.placement[session_id] = choice
        self._record(ids[choice], keys)
        return choice

    def _record(self, worker_id: Hashable, keys: Sequence[bytes]) -> None:
        held = self.held.setdefault(worker_id, OrderedDict())
        for key in reversed(keys):  # head last: most recently placed
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.max_keys_per_worker:
            held.popitem(last=False)

    def forget_worker(self, worker_id: Hashable) -> None:
        """Drop every chain key recorded on ``worker_id`` (a worker that died or left)."""
        self.held.pop(worker_id, None)

    def stats(self) -> dict[str, int]:
        """The counters of the class docstring, ``sessions`` and ``keys`` included."""
        return {**super().stats(), "keys": sum(len(h) for h in self.held.values())}


class _Registry(dict):
    """``ROUTERS[name]``; an unknown name is a ConfigError that lists the choices."""

    def __missing__(self, name):
        raise ConfigError(f"router: unknown router {name!r}; choices: {', '.join(sorted(self))}")


ROUTERS: dict[str, type[Router]] = _Registry(
    {
        SessionAffinityRouter.name: SessionAffinityRouter,
        RoundRobinRouter.name: RoundRobinRouter,
        LeastLoadedRouter.name: LeastLoadedRouter,
        PrefixRouter.name: PrefixRouter,
    }
)


def make_router(name: str, **kwargs: Any) -> Router:
    """A router by registry name (``session``, ``prefix``, ``round-robin``, ``least-loaded``) and options.

    Raises:
        ConfigError: an unknown name (listing the choices) or options the router does not take.
    """
    cls = ROUTERS[name]
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"router: {name!r} does not take options {sorted(kwargs)} ({exc})") from None
