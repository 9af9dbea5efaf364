"""Serving: multi-agent workloads on one shared prefill (docs/design.md, "Layers"; docs/serving.md).

Building blocks for serving many specialist decoders behind one base model: a prefix K/V store
that reuses the prefill of token blocks earlier prompts already computed (keyed by the model that
wrote them, fault class K5), the scheduler, router and workload generators (``workloads``), and the
OpenAI-compatible HTTP server (``server``: ``schemas``, ``metrics``, ``streaming``, ``app``,
``background``; needs the ``serve`` extra, loaded only when imported), all built on
``ccft.SharedPrefillEngine``'s step API.
"""

from ccft.serving.prefix_store import Block, PrefixKVStore  # noqa: F401
from ccft.serving.router import (  # noqa: F401
    ROUTERS,
    PrefixRouter,
    Router,
    SessionAffinityRouter,
    WorkerState,
    make_router,
)
from ccft.serving.scheduler import (  # noqa: F401
    PromptTooLongError,
    QueueFullError,
    Scheduler,
    ServeRequest,
    Ticket,
)
from ccft.serving.workloads import KVTokens, Request, Trace, TraceReplay, kv_tokens  # noqa: F401
