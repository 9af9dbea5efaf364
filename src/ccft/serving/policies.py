"""Request-queue policies of the ``Scheduler``: which queued request is admitted next and which active rows
decode in a step. The scheduler owns the mechanism (KV ledger, contexts, prefill, the engine); a policy owns
only its ordering and its per-request state (docs/serving.md, "Policies").

``FCFS``: arrival order, head of line; ``max_running`` caps admitted requests.
``MLFQ``: a preemptive multi-level feedback queue after FastServe's skip-join MLFQ (Wu et al. 2023, arXiv
2305.05920): a request enters at the level its prompt length selects (level i holds prompts up to
``entry_tokens·2^i``: long prompts skip the top levels), is demoted one level after decoding that level's
quantum (``quantum·2^i`` tokens), and is promoted to the top after ``aging_steps`` steps without being stepped
(no starvation). With ``max_running`` only that many active rows, best first, decode per step; the others
stay paused in their engine slots.

A policy never changes outputs: greedy tokens equal the offline reference under every policy (tested).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

from ccft.core.errors import ConfigError

__all__ = ["FCFS", "LAST", "MLFQ", "POLICIES", "Queued", "RequestQueuePolicy", "make_policy"]


class Queued(Protocol):
    """What a policy reads of a ``ccft.serving.scheduler.Ticket``."""

    id: int  # arrival order
    request: Any  # a ``ServeRequest`` (``prompt_ids``)


#: the order of a context nobody waits for: after every request's (level, arrival)
LAST = (float("inf"), 0)


class RequestQueuePolicy:
    """The interface the scheduler calls; the defaults are first come, first served with no cap."""

    name = "fcfs"

    def __init__(self, max_running: int | None = None):
        if max_running is not None and int(max_running) < 1:
            raise ConfigError(f"max_running={max_running}; it must be ≥ 1 (or None)")
        self.max_running = None if max_running is None else int(max_running)
        self.counters: collections.Counter = collections.Counter()

    def on_submit(self, ticket: Queued) -> None:
        """A ticket entered the queue."""

    def forget(self, ticket: Queued) -> None:
        """A ticket ended (done, error, cancelled): drop its state."""

    def order(self, ticket: Queued) -> tuple:
        """Sort key: smaller is served first."""
        return (0, ticket.id)

    def next_to_admit(self, queue: Sequence[Queued]) -> Queued | None:
        """The queued ticket admission considers next (it may still wait for room)."""
        return min(queue, key=self.order) if queue else None

    def may_admit(self, in_flight: int) -> bool:
        """Whether one more request may be admitted with ``in_flight`` admitted, unfinished ones."""
        return True

    def rows_to_step(self, running: Mapping[int, Queued]) -> list[int] | None:
        """Keys of ``running`` (engine request ids) to decode this step; None: all of them."""
        return None

    def after_step(self, tickets: Iterable[Queued], stepped: set[int]) -> None:
        """Bookkeeping after a step over every live ticket; ``stepped``: ids of tickets decoded in it."""


class FCFS(RequestQueuePolicy):
    """Arrival order; the head of the queue waits for room (head of line); ``max_running`` caps admission."""

    name = "fcfs"

    def next_to_admit(self, queue: Sequence[Queued]) -> Queued | None:
        return queue[0] if queue else None

    def may_admit(self, in_flight: int) -> bool:
        return self.max_running is None or in_flight < self.max_running


@dataclass
class _Level:
    level: int
    used: int = 0  # decode tokens at this level
    waited: int = 0  # steps since last stepped


class MLFQ(RequestQueuePolicy):
    """Skip-join multi-level feedback queue with aging (see the module docstring).

    Args:
        max_running: rows decoded per step (the best ones; None: every active row).
        levels, quantum, entry_tokens, aging_steps: see the module docstring; each ≥ 1.
    Raises:
        ConfigError: a knob out of range (the message names it).
    """

    name = "mlfq"

    def __init__(
        self,
        max_running: int | None = None,
        *,
        levels: int = 4,
        quantum: int = 8,
        entry_tokens: int = 512,
        aging_steps: int = 64,
    ):
        super().__init__(max_running)
        for key, value in (
            ("mlfq_levels", levels),
            ("mlfq_quantum", quantum),
            ("mlfq_entry_tokens", entry_tokens),
            ("mlfq_aging_steps", aging_steps),
        ):
            if int(value) < 1:
                raise ConfigError(f"{key}={value}; it must be ≥ 1")
        self.levels, self.quantum = int(levels), int(quantum)
        self.entry_tokens, self.aging_steps = int(entry_tokens), int(aging_steps)
        self._state: dict[int, _Level] = {}

    def entry_level(self, request: Any) -> int:
        """Skip-join: the first level whose prompt limit (``entry_tokens·2^i``) holds the prompt."""
        level, limit = 0, self.entry_tokens
        while len(request.prompt_ids) > limit and level < self.levels - 1:
            level, limit = level + 1, limit * 2
        return level

    def level(self, ticket: Queued) -> int:
        """The ticket's current level (0 = highest)."""
        return self._state[ticket.id].level

    def on_submit(self, ticket: Queued) -> None:
        self._state[ticket.id] = _Level(self.entry_level(ticket.request))

    def forget(self, ticket: Queued) -> None:
        self._state.pop(ticket.id, None)

    def order(self, ticket: Queued) -> tuple:
        s = self._state.get(ticket.id)
        return (s.level if s is not None else 0, ticket.id)

    def rows_to_step(self, running: Mapping[int, Queued]) -> list[int] | None:
        if self.max_running is None or len(running) <= self.max_running:
            return None
        best = sorted(running.items(), key=lambda kv: self.order(kv[1]))[: self.max_running]
        return [rid for rid, _ in best]

    def after_step(self, tickets: Iterable[Queued], stepped: set[int]) -> None:
        """Demote a ticket that used its level's quantum; promote one that waited ``aging_steps``
        unstepped."""
        for t in tickets:
            s = self._state.get(t.id)
            if s is None:
                continue
            if t.id in stepped:
                s.waited = 0
                s.used += 1
                if s.used >= self.quantum * 2**s.level and s.level < self.levels - 1:
                    s.level, s.used = s.level + 1, 0
                    self.counters["mlfq_demotions"] += 1
            else:
                s.waited += 1
                if s.waited >= self.aging_steps:
                    if s.level > 0:
                        self.counters["mlfq_promotions"] += 1
                    s.level, s.used, s.waited = 0, 0, 0


POLICIES = {"fcfs": FCFS, "mlfq": MLFQ}


def make_policy(
    policy: str | RequestQueuePolicy,
    *,
    max_running: int | None = None,
    mlfq_levels: int = 4,
    mlfq_quantum: int = 8,
    mlfq_entry_tokens: int = 512,
    mlfq_aging_steps: int = 64,
) -> RequestQueuePolicy:
    """A policy object from the scheduler's arguments (a ``RequestQueuePolicy`` is returned as it is).

    Raises:
        ConfigError: an unknown policy name or a knob out of range.
    """
    if isinstance(policy, RequestQueuePolicy):
        return policy
    if policy not in POLICIES:
        raise ConfigError(f"policy={policy!r}; use one of {', '.join(POLICIES)}")
    if policy == "mlfq":
        return MLFQ(
            max_running,
            levels=mlfq_levels,
            quantum=mlfq_quantum,
            entry_tokens=mlfq_entry_tokens,
            aging_steps=mlfq_aging_steps,
        )
    # the MLFQ knobs are validated whatever the policy (a typo fails at start, not when the policy is
    # switched)
    MLFQ(
        None,
        levels=mlfq_levels,
        quantum=mlfq_quantum,
        entry_tokens=mlfq_entry_tokens,
        aging_steps=mlfq_aging_steps,
    )
    return FCFS(max_running)
