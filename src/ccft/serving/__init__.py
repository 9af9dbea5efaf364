"""Serving: multi-agent workloads on one shared prefill (DESIGN.md §3).

Building blocks for serving many specialist decoders behind one base model: a prefix K/V store
that reuses the prefill of token blocks earlier prompts already computed (keyed by the model that
wrote them, K5), and — alongside it — the scheduler, router, workload generators and HTTP server
built on ``ccft.SharedPrefillEngine``'s step API.
"""

from ccft.serving.prefix_store import Block, PrefixKVStore  # noqa: F401
from ccft.serving.router import ROUTERS, Router, SessionAffinityRouter, WorkerState, make_router  # noqa: F401
from ccft.serving.scheduler import (  # noqa: F401
    PromptTooLongError,
    QueueFullError,
    Scheduler,
    ServeRequest,
    Ticket,
)
from ccft.serving.workloads import KVTokens, Request, Trace, TraceReplay, kv_tokens  # noqa: F401
