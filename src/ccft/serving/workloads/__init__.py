"""Multi-agent serving workloads (ReAct, Reflexion) as replayable request traces.

Split along its concepts; every public name is importable from ``ccft.serving.workloads``:

* ``patterns``: ``generate`` (ReAct / Reflexion traces; the patterns, lengths and arrivals are
  described there), ``generate_from_options`` (the same from a benchmark's parsed options), ``describe``,
  ``KINDS``, ``DEFAULT_AGENTS``, ``EIGHT_AGENTS``;
* ``trace``: ``Request``, ``Trace`` (the JSONL file format, ``save`` / ``load``), ``TraceReplay``;
* ``kv``: Eq. 9 of PrefillShare, ``KVTokens`` and ``kv_tokens``;
* ``pools``: the bundled text pools and exact-length token pieces (tokenizer helpers).

Example::

    from ccft.serving import workloads
    trace = workloads.generate("react", sessions=32, turns=4, shared_tokens=1024, unique_tokens=64,
                               growth_tokens=128, max_new_tokens=64, rate=2.0, seed=0,
                               tokenizer=tokenizer)
    trace.save("react.jsonl");  trace = workloads.Trace.load("react.jsonl")
    print(trace.kv_tokens())    # Eq. 9: KV tokens with and without a shared prefill
"""

from ccft.serving.workloads.kv import KVTokens, kv_tokens
from ccft.serving.workloads.patterns import (  # noqa: F401 - the constants are public names of ccft 0.1's module
    AGENT_DOMAIN,
    DEFAULT_AGENTS,
    EIGHT_AGENTS,
    KINDS,
    LONG_CONTEXT_TRACE,
    MORE_AGENTS,
    REFLECT_TEXT,
    ROLE_TEXT,
    SYSTEM_TEXT,
    add_trace_options,
    describe,
    generate,
    generate_from_options,
    trace_options,
)
from ccft.serving.workloads.pools import DOMAINS, RESOURCES  # noqa: F401
from ccft.serving.workloads.trace import FORMAT, FORMAT_VERSION, Request, Trace, TraceReplay  # noqa: F401

__all__ = [
    "DEFAULT_AGENTS",
    "EIGHT_AGENTS",
    "KINDS",
    "MORE_AGENTS",
    "KVTokens",
    "Request",
    "Trace",
    "TraceReplay",
    "describe",
    "generate",
    "generate_from_options",
    "add_trace_options",
    "trace_options",
    "LONG_CONTEXT_TRACE",
    "kv_tokens",
]
