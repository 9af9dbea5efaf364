"""Workload traces: ``Request`` records, the ``Trace`` (JSONL file format) and ``TraceReplay``.

File format (JSONL, ``Trace.save`` / ``Trace.load``), one JSON object per line, ``type`` first:

* line 1, ``{"type": "meta", "format": "ccft-trace", "version": 1, "kind", "seed", "sessions",
  "turns", "agents", "shared_tokens", "unique_tokens", "growth_tokens", "reflection_tokens",
  "steps_per_trial", "max_new_tokens": {agent: n}, "rate", "markup", "tokenizer": {"name",
  "vocab_size", "digest"}, "num_segments", "num_requests"}``;
* ``{"type": "segment", "id", "ids": [...]}``: a token-id chunk (a session's initial context,
  one turn's record, one request's unique instruction), stored once;
* ``{"type": "request", "request_id", "session", "turn", "phase" ("act"|"reflect"), "agent",
  "arrival" (s), "depends_on": [request ids], "segments": [segment ids], "shared_len",
  "unique_len", "prompt_len", "max_new_tokens"}``: ``prompt_ids`` = the concatenation of its
  segments; the first ``shared_len`` of them are the shared context.

A request is released at ``max(arrival, finish of its dependencies)`` (``TraceReplay``). Traces
are written atomically (``ccft.core.io``; docs/design.md, "Atomic writes"): the same trace gives
the same bytes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ccft.core.errors import ConfigError, DataError
from ccft.core.io import atomic_write_file
from ccft.serving.workloads.kv import KVTokens
from ccft.serving.workloads.pools import tokenizer_info

__all__ = ["FORMAT", "FORMAT_VERSION", "Request", "Trace", "TraceReplay"]

FORMAT = "ccft-trace"
FORMAT_VERSION = 1


@dataclass
class Request:
    """One agent call of a trace. ``prompt_ids[:shared_len]`` is the session's shared context."""

    request_id: str
    session: int
    turn: int
    phase: str  # "act" or "reflect"
    agent: str  # = decoder name
    arrival: float  # seconds from the trace start (the session's arrival)
    depends_on: tuple[str, ...]  # request ids that must finish before this one is released
    segments: tuple[str, ...]  # segment ids; prompt_ids is their concatenation
    shared_len: int
    unique_len: int
    max_new_tokens: int
    prompt_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def prompt_len(self) -> int:
        return self.shared_len + self.unique_len

    @property
    def shared_ids(self) -> list[int]:
        return self.prompt_ids[: self.shared_len]

    @property
    def unique_ids(self) -> list[int]:
        return self.prompt_ids[self.shared_len :]

    def record(self) -> dict:
        return {
            "type": "request",
            "request_id": self.request_id,
            "session": self.session,
            "turn": self.turn,
            "phase": self.phase,
            "agent": self.agent,
            "arrival": self.arrival,
            "depends_on": list(self.depends_on),
            "segments": list(self.segments),
            "shared_len": self.shared_len,
            "unique_len": self.unique_len,
            "prompt_len": self.prompt_len,
            "max_new_tokens": self.max_new_tokens,
        }


class Trace:
    """A replayable multi-agent workload: ``meta``, token ``segments`` and ``requests``.

    Requests are ordered by (session, turn, agent order); ``prompt_ids`` are rebuilt from the
    segments. See the module docstring for the file format.
    """

    def __init__(self, meta: dict, segments: dict[str, list[int]], requests: list[Request]):
        self.meta = meta
        self.segments = segments
        self.requests = requests
        for r in requests:
            if not r.prompt_ids:
                r.prompt_ids = [t for s in r.segments for t in segments[s]]
        self._by_id = {r.request_id: r for r in requests}

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __getitem__(self, request_id: str) -> Request:
        return self._by_id[request_id]

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def agents(self) -> list[str]:
        return list(self.meta["agents"])

    def sessions(self) -> dict[int, list[Request]]:
        """Requests by session id (in trace order)."""
        out: dict[int, list[Request]] = {}
        for r in self.requests:
            out.setdefault(r.session, []).append(r)
        return out

    def groups(self) -> list[list[Request]]:
        """The session-turns: requests grouped by (session, turn); all of a group share one context."""
        out: dict[tuple[int, int], list[Request]] = {}
        for r in self.requests:
            out.setdefault((r.session, r.turn), []).append(r)
        return list(out.values())

    def kv_tokens(self) -> KVTokens:
        """Eq. 9 summed over every session-turn: ``Σ L_shared + Σ_i L_unique_i`` vs
        ``Σ_i (L_shared + L_unique_i)``."""
        total = KVTokens(0, 0)
        for group in self.groups():
            shared = {r.shared_len for r in group}
            if len(shared) != 1:  # pragma: no cover - generate() never writes this; a hand-edited file might
                raise DataError(
                    f"session {group[0].session} turn {group[0].turn}: requests disagree on shared_len "
                    f"{sorted(shared)}; one session-turn reads one shared context"
                )
            ls = shared.pop()
            total += KVTokens(ls + sum(r.unique_len for r in group), sum(ls + r.unique_len for r in group))
        return total

    def replay(self) -> TraceReplay:
        return TraceReplay(self)

    # ------------------------------------------------------------ JSONL

    def lines(self) -> Iterator[str]:
        dump = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"))
        yield dump({"type": "meta", **self.meta})
        for sid, ids in self.segments.items():
            yield dump({"type": "segment", "id": sid, "ids": ids})
        for r in self.requests:
            yield dump(r.record())

    def save(self, path: str | Path) -> Path:
        """Write the trace as JSONL (same trace, same bytes), atomically. Returns the path."""

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8", newline="\n") as f:
                for line in self.lines():
                    f.write(line + "\n")

        return atomic_write_file(Path(path), write)

    @classmethod
    def load(cls, path: str | Path, *, tokenizer=None) -> Trace:
        """Read a trace written by :meth:`save`; with ``tokenizer``, check it is the one the trace was built
        with.

        Raises:
            DataError: missing file, not a ccft trace, unknown version, a request naming a missing
                segment or dependency, or lengths that do not add up.
            ConfigError: ``tokenizer`` is not the tokenizer the trace was built with.
        """
        path = Path(path)
        if not path.is_file():
            raise DataError(
                f"trace file {path} does not exist; write one with "
                "ccft.serving.workloads.generate(...).save()"
            )
        meta: dict | None = None
        segments: dict[str, list[int]] = {}
        requests: list[Request] = []
        seen: set[str] = set()
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                kind = rec.pop("type", None)
                where = f"{path}:{n}"
                if meta is None:
                    if kind != "meta" or rec.get("format") != FORMAT:
                        raise DataError(
                            f"{where}: not a ccft trace (first line must be a meta record with "
                            f"format={FORMAT!r})"
                        )
                    if rec.get("version") != FORMAT_VERSION:
                        raise DataError(
                            f"{where}: trace format version {rec.get('version')!r} is not supported "
                            f"(this ccft reads version {FORMAT_VERSION}); regenerate the trace"
                        )
                    meta = rec
                elif kind == "segment":
                    segments[rec["id"]] = list(rec["ids"])
                elif kind == "request":
                    missing = [s for s in rec["segments"] if s not in segments]
                    if missing:
                        raise DataError(
                            f"{where}: request {rec['request_id']} names missing segments {missing}"
                        )
                    unknown = [d for d in rec["depends_on"] if d not in seen]
                    if unknown:
                        raise DataError(
                            f"{where}: request {rec['request_id']} depends on {unknown}, which are "
                            "not earlier requests of the trace"
                        )
                    req = Request(
                        request_id=rec["request_id"],
                        session=rec["session"],
                        turn=rec["turn"],
                        phase=rec["phase"],
                        agent=rec["agent"],
                        arrival=rec["arrival"],
                        depends_on=tuple(rec["depends_on"]),
                        segments=tuple(rec["segments"]),
                        shared_len=rec["shared_len"],
                        unique_len=rec["unique_len"],
                        max_new_tokens=rec["max_new_tokens"],
                    )
                    length = sum(len(segments[s]) for s in req.segments)
                    if length != rec["prompt_len"] or length != req.prompt_len:
                        raise DataError(
                            f"{where}: request {req.request_id}: segments hold {length} tokens but "
                            f"prompt_len={rec['prompt_len']}, shared_len + unique_len={req.prompt_len}"
                        )
                    seen.add(req.request_id)
                    requests.append(req)
                else:
                    raise DataError(f"{where}: unknown record type {kind!r} (meta, segment or request)")
        if meta is None:
            raise DataError(f"{path} is empty; expected a ccft trace")
        if tokenizer is not None:
            digest = tokenizer_info(tokenizer)["digest"]
            if digest != meta["tokenizer"]["digest"]:
                raise ConfigError(
                    f"tokenizer: the trace {path} was built with tokenizer "
                    f"{meta['tokenizer']['name']!r} (digest {meta['tokenizer']['digest'][:12]}), not "
                    f"{getattr(tokenizer, 'name_or_path', '?')!r} ({digest[:12]}); regenerate the trace "
                    "with this tokenizer"
                )
        return cls(meta, segments, requests)


class TraceReplay:
    """Dependency and arrival book-keeping for replaying a trace on a clock (seconds from its start).

    A request is *released* once ``now >= arrival`` and every request it depends on finished.
    ``ready(now)`` returns each released request once; ``finish(request_id, now)`` records a
    completion; ``next_arrival()`` is the earliest arrival of a request whose dependencies are
    done but which is not released yet (None when there is none: wait for a finish).
    """

    def __init__(self, trace: Trace):
        self.trace = trace
        self._waiting = {r.request_id: set(r.depends_on) for r in trace.requests}
        self._dependents: dict[str, list[str]] = {}
        for r in trace.requests:
            for d in r.depends_on:
                self._dependents.setdefault(d, []).append(r.request_id)
        self._unblocked = [r.request_id for r in trace.requests if not r.depends_on]
        self.released: dict[str, float] = {}
        self.finished: dict[str, float] = {}

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.trace.requests)

    def ready(self, now: float) -> list[Request]:
        out = [rid for rid in self._unblocked if self.trace[rid].arrival <= now]
        if out:
            keep = set(out)
            self._unblocked = [rid for rid in self._unblocked if rid not in keep]
        for rid in out:
            self.released[rid] = now
        return [self.trace[rid] for rid in out]

    def next_arrival(self) -> float | None:
        return min((self.trace[rid].arrival for rid in self._unblocked), default=None)

    def finish(self, request_id: str, now: float) -> None:
        if request_id not in self.released:
            raise ConfigError(f"request_id: {request_id!r} was never released by ready(); cannot finish it")
        if request_id in self.finished:
            raise ConfigError(f"request_id: {request_id!r} already finished")
        self.finished[request_id] = now
        for rid in self._dependents.get(request_id, ()):
            waiting = self._waiting[rid]
            waiting.discard(request_id)
            if not waiting:
                self._unblocked.append(rid)
