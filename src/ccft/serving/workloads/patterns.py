"""Generators of multi-agent serving workloads (ReAct, Reflexion) as replayable request traces.

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

Output lengths: every agent call generates up to ``max_new_tokens`` (one int, or one per agent);
with ``new_tokens_spread=s > 0`` each call's budget is drawn instead around it, log-normally
(``round(n·exp(N(0, s)))``, at least 1; its own seeded generator, so every other byte of the trace
is unchanged): real agents' outputs are not all the same length, and a scheduler's policy (FCFS
vs MLFQ) matters only when they differ.

Eight agents: ``EIGHT_AGENTS`` = the default four + ``MORE_AGENTS`` (critic, search, writer,
verifier), each with its own role text.

Arrivals: sessions arrive as a Poisson process of ``rate`` sessions per second (session 0 at
t=0; ``rate=None`` puts every session at t=0). Every request carries its session's arrival
offset and ``depends_on``: a request is released at ``max(arrival, finish of its
dependencies)`` (:class:`TraceReplay` does the book-keeping). Everything is deterministic in
``seed`` (and the tokenizer).

The file format is described in ``ccft.serving.workloads.trace``; an example is in the package docstring.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from ccft.core.errors import ConfigError
from ccft.serving.workloads.pools import DOMAINS, TokenPieces, tokenizer_info
from ccft.serving.workloads.trace import FORMAT, FORMAT_VERSION, Request, Trace

__all__ = [
    "KINDS",
    "DEFAULT_AGENTS",
    "MORE_AGENTS",
    "EIGHT_AGENTS",
    "SYSTEM_TEXT",
    "ROLE_TEXT",
    "REFLECT_TEXT",
    "AGENT_DOMAIN",
    "generate",
    "describe",
]

KINDS = ("react", "reflexion")
DEFAULT_AGENTS = ("planner", "math", "code", "tools")
MORE_AGENTS = ("critic", "search", "writer", "verifier")  #: four more roles for 8-agent traces
EIGHT_AGENTS = DEFAULT_AGENTS + MORE_AGENTS

SYSTEM_TEXT = (
    "You are one agent of a team that solves a task together: a planner, a math agent, a code "
    "agent and a tools agent. Everyone reads the same shared trajectory below: the task, then "
    "each turn's thoughts, actions and observations, and reflections on earlier trials. Answer "
    "only your own part, concisely."
)
ROLE_TEXT = {
    "planner": "Planner: read the trajectory so far, then write the next Thought and the Action to take.",
    "math": "Math agent: solve the arithmetic sub-problem below step by step.",
    "code": "Code agent: write a Python function for the sub-task below.",
    "tools": "Tools agent: pick a function and its JSON arguments for the request below.",
    "critic": "Critic: check the latest step of the trajectory for mistakes and say what to fix.",
    "search": "Search agent: write the query that finds the missing fact for the step below.",
    "writer": "Writer: turn the results so far into a short answer for the user.",
    "verifier": "Verifier: test the proposed answer below against the task and say pass or fail.",
}
REFLECT_TEXT = (
    "Reflect: the last trial did not solve the task. Say what went wrong and write a short plan "
    "for the next trial."
)
AGENT_DOMAIN = {
    "planner": "mixed",
    "math": "math",
    "code": "code",
    "tools": "tools",
    "critic": "mixed",
    "search": "tools",
    "writer": "mixed",
    "verifier": "math",
}


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
            raise ConfigError(
                f"max_new_tokens: no value for agents {missing}; give an int or one value per agent"
            )
        out = {a: int(max_new_tokens[a]) for a in agents}
    else:
        out = {a: int(max_new_tokens) for a in agents}
    bad = {a: n for a, n in out.items() if n < 1}
    if bad:
        raise ConfigError(f"max_new_tokens: must be >= 1, got {bad}")
    return out


def _draw(n: int, spread: float, rng: random.Random) -> int:
    """One call's output budget: ``n``, or with ``spread > 0`` ``max(1, round(n·exp(N(0, spread))))``."""
    if not spread:
        return n
    return max(1, round(n * math.exp(rng.gauss(0.0, float(spread)))))


def _check_int(name: str, value: int, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


#: the trace options of the long-context benchmarks (benchmarks/prefix_pool.py, benchmarks/prefix_routing.py):
#: option name -> default (ints; ``block_tokens`` is the prefix store's block size, recorded with the trace)
LONG_CONTEXT_TRACE = {
    "sessions": 4,
    "turns": 3,
    "agents": 4,
    "shared_tokens": 1024,
    "growth_tokens": 128,
    "unique_tokens": 32,
    "max_new_tokens": 16,
    "block_tokens": 16,
}


def add_trace_options(parser, defaults: Mapping[str, int] = LONG_CONTEXT_TRACE) -> None:
    """Add ``--NAME`` (``_`` as ``-``, type int) for each of ``defaults`` to an ``argparse`` parser."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def trace_options(options, names=LONG_CONTEXT_TRACE) -> dict:
    """``{name: value}`` of the trace options in ``names`` (a benchmark's result records them)."""
    return {name: getattr(options, name) for name in names}


def generate_from_options(options, *, sessions: int, agents, tokenizer, seed: int | None = None) -> Trace:
    """``generate`` with the trace fields of a benchmark's parsed options (``ccft bench serve``'s flags and
    the scripts under benchmarks/ use the same names): ``turns``, ``shared_tokens``, ``unique_tokens``,
    ``growth_tokens``, ``max_new_tokens``, and when present ``workload`` (default ``"react"``), ``seed``
    (default 0) and ``new_tokens_spread`` (default 0). Every session arrives at t = 0 (``rate=None``).

    Args:
        options: an ``argparse.Namespace`` (or any object with those attributes).
        sessions, agents, tokenizer: as for ``generate``.
        seed: overrides ``options.seed`` (a benchmark giving each use of a trace its own prompts).
    Raises:
        ConfigError: as ``generate``.
    """
    return generate(
        getattr(options, "workload", "react"),
        sessions=sessions,
        turns=options.turns,
        agents=agents,
        shared_tokens=options.shared_tokens,
        unique_tokens=options.unique_tokens,
        growth_tokens=options.growth_tokens,
        max_new_tokens=options.max_new_tokens,
        rate=None,
        seed=getattr(options, "seed", 0) if seed is None else seed,
        tokenizer=tokenizer,
        new_tokens_spread=getattr(options, "new_tokens_spread", 0.0),
    )


def generate(
    kind: str,
    *,
    sessions: int = 16,
    turns: int = 4,
    agents: int | Sequence[str] = DEFAULT_AGENTS,
    shared_tokens: int = 512,
    unique_tokens: int = 32,
    growth_tokens: int = 64,
    max_new_tokens: int | Mapping[str, int] = 64,
    rate: float | None = 1.0,
    seed: int = 0,
    tokenizer,
    reflection_tokens: int | None = None,
    steps_per_trial: int = 1,
    new_tokens_spread: float = 0.0,
) -> Trace:
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
        new_tokens_spread: s ≥ 0; s > 0 draws each call's ``max_new_tokens`` log-normally around its
            agent's value (``round(n·exp(N(0, s)))``, at least 1; see the module docstring). 0: fixed.
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
    if not isinstance(new_tokens_spread, (int, float)) or new_tokens_spread < 0:
        raise ConfigError(
            f"new_tokens_spread: must be a number >= 0 (0: fixed lengths), got {new_tokens_spread!r}"
        )
    if rate is not None and (not isinstance(rate, (int, float)) or rate < 0):
        raise ConfigError(f"rate: sessions per second must be >= 0 or None, got {rate!r}")
    if tokenizer is None:
        raise ConfigError("tokenizer: a tokenizer is needed to build token ids (the base model's tokenizer)")
    names = _agents(agents)
    budget = _max_new(max_new_tokens, names)
    reflector = "planner" if "planner" in names else names[0]
    toks = TokenPieces(tokenizer)

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
        lrng = random.Random(f"ccft-trace:{seed}:lengths:{s}")  # its own stream: other bytes do not change
        domain = DOMAINS[rng.randrange(len(DOMAINS))]
        # initial context: system turn + user task turn, exactly shared_tokens
        ctx_id = f"s{s}.ctx"
        segments[ctx_id] = toks.fit(
            ctx_head, toks.body(rng, [domain], "task", shared_tokens), user_tail, shared_tokens
        )
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
                segments[rid] = toks.fit(
                    uhead, toks.body(rng, udomains, "task", unique_tokens), utail + ahead, unique_tokens
                )
                requests.append(
                    Request(
                        request_id=rid,
                        session=s,
                        turn=t,
                        phase=phase,
                        agent=agent,
                        arrival=arrivals[s],
                        depends_on=tuple(prev),
                        segments=(*context, rid),
                        shared_len=shared_len,
                        unique_len=unique_tokens,
                        max_new_tokens=_draw(budget[agent], new_tokens_spread, lrng),
                    )
                )
                ids.append(rid)
            prev = ids
            if t == len(plan) - 1 or record_len == 0:
                continue
            # the turn's record, appended to the shared context of the next turn
            if phase == "act":
                rhead, rtail = toks.turn("user", f"Turn {t}: thoughts, actions and observations\n")
                rdomains = [d for d in (AGENT_DOMAIN.get(a) for a in callers) if d in DOMAINS] or list(
                    DOMAINS
                )
            else:
                rhead, rtail = toks.turn("assistant", f"Reflection on trial {trial}:\n")
                rdomains = [domain]
                trial += 1
            rec_id = f"s{s}.t{t}.{'obs' if phase == 'act' else 'refl'}"
            segments[rec_id] = toks.fit(
                rhead, toks.body(rng, rdomains, "record", record_len), rtail, record_len
            )
            context.append(rec_id)
            shared_len += record_len

    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "kind": kind,
        "seed": seed,
        "sessions": sessions,
        "turns": turns,
        "agents": names,
        "shared_tokens": shared_tokens,
        "unique_tokens": unique_tokens,
        "growth_tokens": growth_tokens,
        "reflection_tokens": reflection_tokens if kind == "reflexion" else 0,
        "steps_per_trial": steps_per_trial,
        "max_new_tokens": budget,
        "new_tokens_spread": new_tokens_spread,
        "rate": rate,
        "markup": "chatml" if toks.chatml else "plain",
        "tokenizer": tokenizer_info(tokenizer),
        "num_segments": len(segments),
        "num_requests": len(requests),
    }
    return Trace(meta, segments, requests)


def describe(trace: Trace) -> dict[str, Any]:
    """Counts for logs and reports: sessions, requests, turns, prompt tokens and the Eq. 9 totals."""
    kv = trace.kv_tokens()
    return {
        "kind": trace.kind,
        "sessions": len(trace.sessions()),
        "requests": len(trace),
        "session_turns": len(trace.groups()),
        "agents": trace.agents,
        "prompt_tokens": sum(r.prompt_len for r in trace),
        "kv_shared": kv.shared,
        "kv_no_share": kv.no_share,
        "kv_ratio": round(kv.ratio, 4),
    }
