"""``ccft serve``'s OpenAI-compatible HTTP server: the public names in one place.

The server is split along its concepts (docs/design.md, "Layers": ``ccft.serving``):

* ``ccft.serving.schemas``: request bodies as pydantic models (``CompletionRequest``,
  ``ChatCompletionRequest``), the OpenAI error object (``APIError``) and the response shapes;
* ``ccft.serving.metrics``: ``ServerMetrics`` (Prometheus, ``GET /metrics``);
* ``ccft.serving.streaming``: token hand-off from the scheduler thread, streaming detokenisation
  with stop-string hold-back (``StreamText``) and server-sent events;
* ``ccft.serving.app``: ``create_app`` (the routes and the per-app state; endpoints, errors and
  threading are described there);
* ``ccft.serving.background``: ``BackgroundServer`` (uvicorn in a thread).

Example::

    from ccft.serving.server import BackgroundServer, create_app
    app = create_app(Scheduler(engine, store=PrefixKVStore()), base.tokenizer)
    with BackgroundServer(app, port=8000) as srv:   # or: uvicorn.run(app, port=8000)
        ...                                         # POST srv.url + "/v1/completions"
"""

from __future__ import annotations

from ccft.serving.app import create_app
from ccft.serving.background import BackgroundServer
from ccft.serving.metrics import ServerMetrics
from ccft.serving.schemas import FINISH_REASONS, APIError

__all__ = ["create_app", "BackgroundServer", "ServerMetrics", "APIError", "FINISH_REASONS"]
