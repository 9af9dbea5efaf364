"""Multi-agent serving workloads (ReAct, Reflexion) as replayable request traces.

A *session* is one multi-agent task. Its agents (decoder names; default ``planner``, ``math``,
``code``, ``tools``) all read one **shared context** that grows every turn, each followed by a
short **agent-unique** instruction. This is the PrefillShare setting (arXiv 2602.12029): with a
shared prefill the base model computes the shared context's K/V once per turn for all agents;
per-model serving computes it once per agent.

Patterns (``kind``)
-------------------
``react``  ``turns`` turns. In every turn all N agents are called concurrently (fan-out) on
    ``shared context + unique_i``: the planner writes the next Thought/Action, each specialist
    its action. The turn's record (thoughts, actions, observations: ``growth_tokens`` tokens)
    is then appended to the shared context. Turn t+1 depends on every request of turn t.
``reflexion``  ``turns`` *trials*. A trial is ``steps_per_trial`` act turns exactly like ReAct
    (each appends ``growth_tokens``), then, except after the last trial, one reflect turn: the
    planner (``"planner"`` if present, else the first agent) alone reads the shared memory plus a
    reflection instruction and its reflection (``reflection_tokens``) is appended to the shared
    memory. Turn indices count act and reflect turns: a trace has
    ``turns * steps_per_trial + turns - 1`` turns per session.

The appended records are fixed-length stand-ins built from real text, not the agents' actual
outputs: a replay never needs the generated tokens, and every length is known up front.

Lengths are exact in tokens: ``shared_tokens`` is the initial context (system + task),
``shared_len`` of turn t is ``shared_tokens`` plus every record appended before t, and every
agent prompt is ``shared_len + unique_tokens`` long. Each piece is tokenized on its own and the
ids are concatenated, so the ids are authoritative (decoding and re-tokenizing the text need not
give the same ids). Text comes from the bundled GSM8K (math), MBPP (code) and glaive (tools)
rows under ``ccft/resources``, cut or extended with further rows to the exact length; with a
ChatML tokenizer (``<|im_start|>``, e.g. SmolLM2) the pieces carry chat markup and every prompt
ends with the assistant header, otherwise plain ``System:``/``User:``/``Assistant:`` labels. The
system text is the same in every session, so the first tokens of every session's context are
identical (a cross-session prefix); the task differs per session.

Arrivals: sessions arrive as a Poisson process of ``rate`` sessions per second (session 0 at
t=0; ``rate=None`` puts every session at t=0). Every request carries its session's arrival
offset and ``depends_on``: a request is released at ``max(arrival, finish of its
dependencies)`` (:class:`TraceReplay` does the book-keeping). Everything is deterministic in
``seed`` (and the tokenizer).

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

Example::

    from ccft.serving import workloads
    trace = workloads.generate("react", sessions=32, turns=4, shared_tokens=1024, unique_tokens=64,
                               growth_tokens=128, max_new_tokens=64, rate=2.0, seed=0,
                               tokenizer=tokenizer)
    trace.save("react.jsonl");  trace = workloads.Trace.load("react.jsonl")
    print(trace.kv_tokens())    # Eq. 9: KV tokens with and without a shared prefill
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccft.core.errors import ConfigError, DataError

__all__ = [
    "DEFAULT_AGENTS", "KINDS", "KVTokens", "Request", "Trace", "TraceReplay", "describe", "generate", "kv_tokens",
]

FORMAT = "ccft-trace"
FORMAT_VERSION = 1
KINDS = ("react", "reflexion")
DEFAULT_AGENTS = ("planner", "math", "code", "tools")
RESOURCES = Path(__file__).resolve().parents[1] / "resources"

SYSTEM_TEXT = ("You are one agent of a team that solves a task together: a planner, a math agent, a code "
               "agent and a tools agent. Everyone reads the same shared trajectory below: the task, then "
               "each turn's thoughts, actions and observations, and reflections on earlier trials. Answer "
               "only your own part, concisely.")
ROLE_TEXT = {
    "planner": "Planner: read the trajectory so far, then write the next Thought and the Action to take.",
    "math": "Math agent: solve the arithmetic sub-problem below step by step.",
    "code": "Code agent: write a Python function for the sub-task below.",
    "tools": "Tools agent: pick a function and its JSON arguments for the request below.",
}
REFLECT_TEXT = ("Reflect: the last trial did not solve the task. Say what went wrong and write a short plan "
                "for the next trial.")
AGENT_DOMAIN = {"planner": "mixed", "math": "math", "code": "code", "tools": "tools"}
DOMAINS = ("math", "code", "tools")


# ---------------------------------------------------------------- Eq. 9

@dataclass(frozen=True)
class KVTokens:
    """Prompt KV tokens computed and held (Eq. 9 of PrefillShare), summed over session-turns.

    ``shared``: one shared prefill per session-turn, ``L_shared + N·L_unique``; ``no_share``:
    every agent prefills its own prompt, ``N·(L_shared + L_unique)``.
    """

    shared: int
    no_share: int

    @property
    def ratio(self) -> float:
        """``no_share / shared`` (how many times more prompt KV without sharing)."""
        return self.no_share / self.shared if self.shared else 1.0

    @property
    def saving(self) -> float:
        """``1 - shared / no_share``: the fraction of prompt KV a shared prefill saves."""
        return 1.0 - self.shared / self.no_share if self.no_share else 0.0

    def __add__(self, other: KVTokens) -> KVTokens:
        return KVTokens(self.shared + other.shared, self.no_share + other.no_share)


def kv_tokens(n_agents: int, shared_len: int, unique_len: int) -> KVTokens:
    """Eq. 9 for one session-turn of ``n_agents`` agents: ``(L_s + N·L_u, N·(L_s + L_u))``."""
    if n_agents < 1 or shared_len < 0 or unique_len < 0:
        raise ConfigError(f"kv_tokens: need n_agents >= 1 and lengths >= 0, got n_agents={n_agents}, "
                          f"shared_len={shared_len}, unique_len={unique_len}")
    return KVTokens(shared_len + n_agents * unique_len, n_agents * (shared_len + unique_len))


# ---------------------------------------------------------------- trace records

@dataclass
class Request:
    """One agent call of a trace. ``prompt_ids[:shared_len]`` is the session's shared context."""

    request_id: str
    session: int
    turn: int
    phase: str                      # "act" or "reflect"
    agent: str                      # = decoder name
    arrival: float                  # seconds from the trace start (the session's arrival)
    depends_on: tuple[str, ...]     # request ids that must finish before this one is released
    segments: tuple[str, ...]       # segment ids; prompt_ids is their concatenation
    shared_len: int
    unique_len: int
    max_new_tokens: int
    prompt_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def prompt_len(self) -> int:
        return self.shared_len + self.unique_len

    @property
    def shared_ids(self) -> list[int]:
        return self.prompt_ids[:self.shared_len]

    @property
    def unique_ids(self) -> list[int]:
        return self.prompt_ids[self.shared_len:]

    def record(self) -> dict:
        return {"type": "request", "request_id": self.request_id, "session": self.session, "turn": self.turn,
                "phase": self.phase, "agent": self.agent, "arrival": self.arrival,
                "depends_on": list(self.depends_on), "segments": list(self.segments),
                "shared_len": self.shared_len, "unique_len": self.unique_len, "prompt_len": self.prompt_len,
                "max_new_tokens": self.max_new_tokens}


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
        """Eq. 9 summed over every session-turn: ``Σ L_shared + Σ_i L_unique_i`` vs ``Σ_i (L_shared + L_unique_i)``."""
        total = KVTokens(0, 0)
        for group in self.groups():
            shared = {r.shared_len for r in group}
            if len(shared) != 1:  # pragma: no cover - generate() never writes this; a hand-edited file might
                raise DataError(f"session {group[0].session} turn {group[0].turn}: requests disagree on shared_len "
                                f"{sorted(shared)}; one session-turn reads one shared context")
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
        """Write the trace as JSONL (same trace, same bytes). Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8", newline="\n") as f:
            for line in self.lines():
                f.write(line + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path, *, tokenizer=None) -> Trace:
        """Read a trace written by :meth:`save`; with ``tokenizer``, check it is the one the trace was built with.

        Raises:
            DataError: missing file, not a ccft trace, unknown version, a request naming a missing
                segment or dependency, or lengths that do not add up.
            ConfigError: ``tokenizer`` is not the tokenizer the trace was built with.
        """
        path = Path(path)
        if not path.is_file():
            raise DataError(f"trace file {path} does not exist; write one with ccft.serving.workloads.generate(...).save()")
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
                        raise DataError(f"{where}: not a ccft trace (first line must be a meta record with "
                                        f"format={FORMAT!r})")
                    if rec.get("version") != FORMAT_VERSION:
                        raise DataError(f"{where}: trace format version {rec.get('version')!r} is not supported "
                                        f"(this ccft reads version {FORMAT_VERSION}); regenerate the trace")
                    meta = rec
                elif kind == "segment":
                    segments[rec["id"]] = list(rec["ids"])
                elif kind == "request":
                    missing = [s for s in rec["segments"] if s not in segments]
                    if missing:
                        raise DataError(f"{where}: request {rec['request_id']} names missing segments {missing}")
                    unknown = [d for d in rec["depends_on"] if d not in seen]
                    if unknown:
                        raise DataError(f"{where}: request {rec['request_id']} depends on {unknown}, which are "
                                        "not earlier requests of the trace")
                    req = Request(request_id=rec["request_id"], session=rec["session"], turn=rec["turn"],
                                  phase=rec["phase"], agent=rec["agent"], arrival=rec["arrival"],
                                  depends_on=tuple(rec["depends_on"]), segments=tuple(rec["segments"]),
                                  shared_len=rec["shared_len"], unique_len=rec["unique_len"],
                                  max_new_tokens=rec["max_new_tokens"])
                    length = sum(len(segments[s]) for s in req.segments)
                    if length != rec["prompt_len"] or length != req.prompt_len:
                        raise DataError(f"{where}: request {req.request_id}: segments hold {length} tokens but "
                                        f"prompt_len={rec['prompt_len']}, shared_len + unique_len={req.prompt_len}")
                    seen.add(req.request_id)
                    requests.append(req)
                else:
                    raise DataError(f"{where}: unknown record type {kind!r} (meta, segment or request)")
        if meta is None:
            raise DataError(f"{path} is empty; expected a ccft trace")
        if tokenizer is not None:
            digest = _tokenizer_info(tokenizer)["digest"]
            if digest != meta["tokenizer"]["digest"]:
                raise ConfigError(f"tokenizer: the trace {path} was built with tokenizer "
                                  f"{meta['tokenizer']['name']!r} (digest {meta['tokenizer']['digest'][:12]}), not "
                                  f"{getattr(tokenizer, 'name_or_path', '?')!r} ({digest[:12]}); regenerate the trace "
                                  "with this tokenizer")
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


# ---------------------------------------------------------------- text pools

@functools.lru_cache(maxsize=None)
def _pool(domain: str, part: str) -> tuple[str, ...]:
    """Texts of a bundled data set. ``part``: "task" (questions, requests) or "record" (answers, solutions)."""
    def rows(rel: str) -> list[dict]:
        path = RESOURCES / rel
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    if domain == "math":
        data = rows("gsm8k/train.jsonl")
        return tuple(r["question"] if part == "task" else r["answer"] for r in data)
    if domain == "code":
        data = rows("mbpp/train.jsonl")
        return tuple(r["prompt"].strip() if part == "task" else r["response"] for r in data)
    if domain == "tools":
        out = []
        for r in rows("glaive_tools/train.jsonl"):
            msgs = r["messages"]
            if part == "task":
                user = next((m["content"] for m in msgs if m["role"] == "user"), "")
                tools = " ".join(t["function"]["name"] + ": " + t["function"].get("description", "")
                                 for t in r.get("tools", []))
                out.append(f"{user}\nAvailable functions: {tools}" if tools else user)
            else:
                out.append(msgs[-1]["content"])
        return tuple(dict.fromkeys(t for t in out if t.strip()))  # dedupe, keep order
    raise ConfigError(f"unknown text domain {domain!r}; choices: {', '.join(DOMAINS)}")


class _Tokens:
    """Tokenizes pool rows once and cuts/extends token streams to exact lengths."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[tuple[str, str, int], list[int]] = {}
        self._text: dict[str, list[int]] = {}
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.chatml = "<|im_start|>" in vocab and "<|im_end|>" in vocab
        plain = _ids(tokenizer("a", add_special_tokens=False))
        special = _ids(tokenizer("a", add_special_tokens=True))
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = [bos] if (not self.chatml and bos is not None and special[:1] == [bos]
                             and plain[:1] != [bos]) else []

    def encode(self, text: str) -> list[int]:
        if text not in self._text:
            self._text[text] = _ids(self.tok(text, add_special_tokens=False))
        return list(self._text[text])

    def row(self, domain: str, part: str, index: int) -> list[int]:
        key = (domain, part, index)
        if key not in self._cache:
            self._cache[key] = _ids(self.tok(_pool(domain, part)[index] + "\n", add_special_tokens=False))
        return self._cache[key]

    def body(self, rng: random.Random, domains: Sequence[str], part: str, length: int) -> list[int]:
        """At least ``length`` tokens: whole rows drawn from ``domains`` (in turn) until long enough."""
        out: list[int] = []
        i = rng.randrange(len(domains))  # which domain opens the text
        while len(out) < length:
            domain = domains[i % len(domains)]
            out += self.row(domain, part, rng.randrange(len(_pool(domain, part))))
            i += 1
        return out

    def turn(self, role: str, header: str = "") -> tuple[list[int], list[int]]:
        """(head, tail) ids of one chat turn of ``role`` whose content starts with ``header``."""
        if self.chatml:
            return self.encode(f"<|im_start|>{role}\n{header}"), self.encode("<|im_end|>\n")
        return self.encode(f"{role.capitalize()}: {header}"), self.encode("\n\n")

    def fit(self, head: list[int], body: list[int], tail: list[int], length: int) -> list[int]:
        """Exactly ``length`` ids: head + body (cut) + tail; when too short for head and tail, the tail
        (the part that opens the next turn) is kept and the head cut first."""
        room = length - len(head) - len(tail)
        if room >= 0:
            return head + body[:room] + tail
        if length >= len(tail):
            return head[:length - len(tail)] + tail
        return tail[len(tail) - length:]


def _ids(out) -> list[int]:
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return list(out)


def _tokenizer_info(tokenizer) -> dict:
    from ccft.core.fingerprint import tokenizer_digest

    name = str(getattr(tokenizer, "name_or_path", "") or "")
    return {"name": Path(name).name if name else "", "vocab_size": len(tokenizer),
            "digest": tokenizer_digest(tokenizer)}


# ---------------------------------------------------------------- generation

def _agents(agents: int | Sequence[str]) -> list[str]:
    if isinstance(agents, int):
        if agents < 1:
            raise ConfigError(f"agents: need at least 1 agent, got {agents}")
        names = list(DEFAULT_AGENTS[:agents]) + [f"agent{i}" for i in range(len(DEFAULT_AGENTS), agents)]
        return names
    names = [str(a) for a in agents]
    if not names or len(set(names)) != len(names) or any(not a or "." in a for a in names):
        raise ConfigError(f"agents: need distinct, non-empty decoder names without '.', got {names}")
    return names


def _max_new(max_new_tokens: int | Mapping[str, int], agents: list[str]) -> dict[str, int]:
    if isinstance(max_new_tokens, Mapping):
        missing = [a for a in agents if a not in max_new_tokens]
        if missing:
            raise ConfigError(f"max_new_tokens: no value for agents {missing}; give an int or one value per agent")
        out = {a: int(max_new_tokens[a]) for a in agents}
    else:
        out = {a: int(max_new_tokens) for a in agents}
    bad = {a: n for a, n in out.items() if n < 1}
    if bad:
        raise ConfigError(f"max_new_tokens: must be >= 1, got {bad}")
    return out


def _check_int(name: str, value: int, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


def generate(kind: str, *, sessions: int = 16, turns: int = 4, agents: int | Sequence[str] = DEFAULT_AGENTS,
             shared_tokens: int = 512, unique_tokens: int = 32, growth_tokens: int = 64,
             max_new_tokens: int | Mapping[str, int] = 64, rate: float | None = 1.0, seed: int = 0,
             tokenizer, reflection_tokens: int | None = None, steps_per_trial: int = 1) -> Trace:
    """Build a ReAct or Reflexion multi-agent trace (see the module docstring for the patterns).

    Args:
        kind: ``"react"`` or ``"reflexion"``.
        sessions: number of sessions (tasks).
        turns: ReAct turns per session; for Reflexion, trials per session.
        agents: decoder names, or a count (the first of planner, math, code, tools; then agentN).
        shared_tokens: length of a session's initial shared context (system + task), tokens.
        unique_tokens: length of each agent's unique instruction (ends with the assistant header).
        growth_tokens: tokens appended to the shared context after every act turn.
        max_new_tokens: generation budget per agent call: one int, or ``{agent: n}`` for every agent.
        rate: Poisson session arrival rate (sessions / s); ``None`` or ``0`` puts every session at t=0.
        seed: everything random (rows, arrivals) derives from it; same seed, same bytes.
        tokenizer: the base model's tokenizer (a Hugging Face tokenizer).
        reflection_tokens: Reflexion only, tokens of each reflection appended (default ``growth_tokens``).
        steps_per_trial: Reflexion only, act turns per trial.
    Raises:
        ConfigError: unknown kind, or a field out of range (the message names it).
    """
    if kind not in KINDS:
        raise ConfigError(f"kind: unknown workload {kind!r}; choices: {', '.join(KINDS)}")
    _check_int("sessions", sessions, 1)
    _check_int("turns", turns, 1)
    _check_int("shared_tokens", shared_tokens, 1)
    _check_int("unique_tokens", unique_tokens, 0)
    _check_int("growth_tokens", growth_tokens, 0)
    _check_int("steps_per_trial", steps_per_trial, 1)
    reflection_tokens = growth_tokens if reflection_tokens is None else reflection_tokens
    _check_int("reflection_tokens", reflection_tokens, 0)
    if kind == "react" and steps_per_trial != 1:
        raise ConfigError("steps_per_trial: only used by kind='reflexion'; leave it at 1 for react")
    if rate is not None and (not isinstance(rate, (int, float)) or rate < 0):
        raise ConfigError(f"rate: sessions per second must be >= 0 or None, got {rate!r}")
    if tokenizer is None:
        raise ConfigError("tokenizer: a tokenizer is needed to build token ids (the base model's tokenizer)")
    names = _agents(agents)
    budget = _max_new(max_new_tokens, names)
    reflector = "planner" if "planner" in names else names[0]
    toks = _Tokens(tokenizer)

    # arrivals: session 0 at t=0, then exponential gaps
    arng = random.Random(f"ccft-trace:{seed}:arrivals")
    arrivals, t = [], 0.0
    for s in range(sessions):
        if s and rate:
            t += arng.expovariate(float(rate))
        arrivals.append(round(t, 6))

    # turn plan: (phase, record kind appended after the turn, record length)
    plan: list[tuple[str, int]] = []
    if kind == "react":
        plan = [("act", growth_tokens)] * turns
    else:
        for trial in range(turns):
            plan += [("act", growth_tokens)] * steps_per_trial
            if trial < turns - 1:
                plan.append(("reflect", reflection_tokens))

    sys_head, sys_tail = toks.turn("system", "")
    user_head, user_tail = toks.turn("user", "Task: ")
    ctx_head = toks.bos + sys_head + toks.encode(SYSTEM_TEXT) + sys_tail + user_head
    segments: dict[str, list[int]] = {}
    requests: list[Request] = []
    for s in range(sessions):
        rng = random.Random(f"ccft-trace:{seed}:session:{s}")
        domain = DOMAINS[rng.randrange(len(DOMAINS))]
        # initial context: system turn + user task turn, exactly shared_tokens
        ctx_id = f"s{s}.ctx"
        segments[ctx_id] = toks.fit(ctx_head, toks.body(rng, [domain], "task", shared_tokens), user_tail,
                                    shared_tokens)
        context = [ctx_id]
        shared_len = shared_tokens
        prev: list[str] = []
        trial = 0
        for t, (phase, record_len) in enumerate(plan):
            callers = names if phase == "act" else [reflector]
            ids: list[str] = []
            for agent in callers:
                rid = f"s{s}.t{t}.{agent}"
                if phase == "act":
                    instruction = ROLE_TEXT.get(agent, f"{agent} agent: handle the sub-task below.")
                    dom = AGENT_DOMAIN.get(agent, "mixed")
                    udomains = [dom] if dom in DOMAINS else list(DOMAINS)
                else:
                    instruction, udomains = REFLECT_TEXT, [domain]
                uhead, utail = toks.turn("user", f"[{agent}] {instruction}\n")
                ahead, _ = toks.turn("assistant", "")
                segments[rid] = toks.fit(uhead, toks.body(rng, udomains, "task", unique_tokens),
                                         utail + ahead, unique_tokens)
                requests.append(Request(request_id=rid, session=s, turn=t, phase=phase, agent=agent,
                                        arrival=arrivals[s], depends_on=tuple(prev), segments=(*context, rid),
                                        shared_len=shared_len, unique_len=unique_tokens,
                                        max_new_tokens=budget[agent]))
                ids.append(rid)
            prev = ids
            if t == len(plan) - 1 or record_len == 0:
                continue
            # the turn's record, appended to the shared context of the next turn
            if phase == "act":
                rhead, rtail = toks.turn("user", f"Turn {t}: thoughts, actions and observations\n")
                rdomains = [d for d in (AGENT_DOMAIN.get(a) for a in callers) if d in DOMAINS] or list(DOMAINS)
            else:
                rhead, rtail = toks.turn("assistant", f"Reflection on trial {trial}:\n")
                rdomains = [domain]
                trial += 1
            rec_id = f"s{s}.t{t}.{'obs' if phase == 'act' else 'refl'}"
            segments[rec_id] = toks.fit(rhead, toks.body(rng, rdomains, "record", record_len), rtail, record_len)
            context.append(rec_id)
            shared_len += record_len

    meta = {"format": FORMAT, "version": FORMAT_VERSION, "kind": kind, "seed": seed, "sessions": sessions,
            "turns": turns, "agents": names, "shared_tokens": shared_tokens, "unique_tokens": unique_tokens,
            "growth_tokens": growth_tokens, "reflection_tokens": reflection_tokens if kind == "reflexion" else 0,
            "steps_per_trial": steps_per_trial, "max_new_tokens": budget, "rate": rate,
            "markup": "chatml" if toks.chatml else "plain", "tokenizer": _tokenizer_info(tokenizer),
            "num_segments": len(segments), "num_requests": len(requests)}
    return Trace(meta, segments, requests)


def describe(trace: Trace) -> dict[str, Any]:
    """Counts for logs and reports: sessions, requests, turns, prompt tokens and the Eq. 9 totals."""
    kv = trace.kv_tokens()
    return {"kind": trace.kind, "sessions": len(trace.sessions()), "requests": len(trace),
            "session_turns": len(trace.groups()), "agents": trace.agents,
            "prompt_tokens": sum(r.prompt_len for r in trace), "kv_shared": kv.shared, "kv_no_share": kv.no_share,
            "kv_ratio": round(kv.ratio, 4)}
