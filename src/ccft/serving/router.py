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
``least-loaded`` (:class:`LeastLoadedRouter`)
    Every request to the least-loaded worker (ties: lowest index); sessions are ignored.
``round-robin`` (:class:`RoundRobinRouter`)
    Workers in turn, ignoring load and sessions.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ccft.core.errors import ConfigError

__all__ = [
    "ROUTERS",
    "LeastLoadedRouter",
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


class _Registry(dict):
    """``ROUTERS[name]``; an unknown name is a ConfigError that lists the choices."""

    def __missing__(self, name):
        raise ConfigError(f"router: unknown router {name!r}; choices: {', '.join(sorted(self))}")


ROUTERS: dict[str, type[Router]] = _Registry(
    {
        SessionAffinityRouter.name: SessionAffinityRouter,
        RoundRobinRouter.name: RoundRobinRouter,
        LeastLoadedRouter.name: LeastLoadedRouter,
    }
)


def make_router(name: str, **kwargs: Any) -> Router:
    """A router by registry name (``session``, ``round-robin``, ``least-loaded``) with its options."""
    cls = ROUTERS[name]
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"router: {name!r} does not take options {sorted(kwargs)} ({exc})") from None
