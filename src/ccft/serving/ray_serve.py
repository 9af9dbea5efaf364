"""Scale-out on Ray Serve: N engine replicas behind ccft's session/prefix-affinity router.

``ccft serve --replicas N`` (or ``serve.run(build_app(factory, replicas=N))``) deploys one Ray
Serve application of two deployments (docs/deploy.md, "Scale-out with Ray Serve"):

``Engine`` (N replicas; :class:`EngineReplica`)
    Each replica builds its own scheduler with ``factory()`` (base + decoders, a ``Scheduler``
    with its own prefix K/V store) and serves the unchanged OpenAI-compatible app of
    ``ccft.serving.app.create_app`` in-process: a forwarded request is run through the app's ASGI
    interface (:class:`ForwardedRequest` in, response start + body chunks out, streamed), so every
    route, error and stream is the single-engine server's. Every response carries the header
    ``x-ccft-replica`` (:data:`REPLICA_HEADER`): the replica's Ray Serve id.
``Ingress`` (one replica, no model; :class:`Ingress`)
    The HTTP entry (Ray Serve's proxy → a FastAPI app with the same paths: ``/v1/completions``,
    ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``). It reads ``session_id``
    from a JSON body and forwards the request to the ``Engine`` deployment's handle, whose request
    router is :class:`SessionRequestRouter` (a request without a body ``session_id`` may name its
    session in the ``x-ccft-session`` header). ``GET /ray/stats``: the ingress counters.

Routing (:class:`SessionRequestRouter`, Ray Serve's ``RequestRouter`` extension point): the
policy is a ``ccft.serving.router`` router (``session`` by default), fed with the current
replicas in a stable order (by replica id) and their loads (Ray's per-replica count of ongoing
requests: queued + decoding in the replica's scheduler, plus in flight). A session's requests go
to the replica the policy placed it on, and fall back to the least-loaded replica on the policy's
overload rule; a request without ``session_id`` goes to the least-loaded replica. Under the
``prefix`` policy (``--router prefix``) every request that is not sent home by its session goes to
the replica the router placed the longest prefix of its prompt's blocks on (unless overloaded): the
ingress hands the router the prompt's token ids when the body carries them, else the prompt's text
(:func:`prompt_of`; the ingress has no tokenizer), and the blocks are remembered per replica id.
When the session's replica is gone (died, scaled down) the session is placed as new. Only the chosen
replica is offered to Ray: when it cannot take the request now (at ``max_ongoing_requests``, or
its queue-length probe times out) Ray backs off and asks the router again, which then sees the
new loads (and falls back by the policy's rule, or places the session anew when the replica died).

Failures: a replica that dies (``ray.exceptions.RayActorError``) before the ingress has sent any
byte of the response to the client is retried on another replica (``retries`` times at most;
greedy outputs are the same on every replica); after that the client gets a 502 (JSON) or, on a
stream already under way, a final ``data: {"error": ...}`` event with code ``replica_failed``.
Both are counted (``/ray/stats``: ``retried``, ``failed``). Ray Serve replaces the dead replica.

Scope: one ingress replica holds the session placements (more ingress replicas would each keep
their own). Needs the ``serve`` and ``ray`` extras (``pip install 'ccft[serve,ray]'``; ``ray[serve]``).
"""

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Union

from ccft.core.errors import ConfigError
from ccft.serving.extra import serve_extra_missing
from ccft.serving.router import ROUTERS, LeastLoadedRouter, PrefixRouter, SessionAffinityRouter, make_router

try:
    import ray
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"ccft serve --replicas needs the `ray` extra ({e.name} is missing): pip install 'ccft[serve,ray]'"
    ) from e
try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
except ImportError as e:  # pragma: no cover - depends on the installation
    raise serve_extra_missing(e) from e

log = logging.getLogger(__name__)

__all__ = [
    "REPLICA_HEADER",
    "SESSION_HEADER",
    "ATTEMPTS_HEADER",
    "ForwardedRequest",
    "SessionRequestRouter",
    "EngineReplica",
    "Ingress",
    "build_app",
    "session_of",
    "request_hints",
    "prompt_of",
    "replica_actor",
]

#: Response header naming the engine replica that answered (its full Ray Serve replica id).
REPLICA_HEADER = "x-ccft-replica"
#: Request header that names the session when the body does not (any route, GET included).
SESSION_HEADER = "x-ccft-session"
#: Response header: how many times the ingress sent the request (2 or more: a replica died and it was
#: retried).
ATTEMPTS_HEADER = "x-ccft-attempts"
#: Ray Serve's actor namespace (replica actors are named by their full replica id there).
SERVE_NAMESPACE = "serve"
#: Request headers not forwarded to a replica (hop-by-hop, or recomputed for the forwarded body).
_DROP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class ForwardedRequest:
    """One HTTP request as the ingress hands it to an engine replica (and the router sees it).

    ``headers``: (name, value) pairs, lower-case names; ``body``: the raw request body;
    ``session_id``: the body's ``session_id`` (``None`` when absent or the body is not JSON);
    ``prompt``: the routing hint of the ``prefix`` policy (:func:`prompt_of`; ``None`` under the
    other policies, which do not read it). It travels to the replica with the request (a second copy
    of the prompt's ids or text; the replica reads the body).
    """

    method: str
    path: str
    query: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    session_id: Optional[str] = None
    stream: bool = False
    prompt: Union[str, list[int], None] = None


def request_hints(body: bytes, *, with_prompt: bool = True) -> tuple[Optional[str], bool, Any]:
    """(``session_id``, ``stream``, prompt hint) of a JSON request body; ``(None, False, None)`` for
    anything else (one parse of the body).

    Only routing hints: the engine replica validates the body (and answers 400 for a bad one).
    A non-string ``session_id`` is used as its JSON text. The prompt hint is :func:`prompt_of` of the
    body (``None`` when ``with_prompt`` is false).
    """
    try:
        obj = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None, False, None
    if not isinstance(obj, dict):
        return None, False, None
    sid = obj.get("session_id")
    if sid is not None and not isinstance(sid, str):
        sid = json.dumps(sid, sort_keys=True)
    return sid, obj.get("stream") is True, prompt_of(obj) if with_prompt else None


def session_of(body: bytes) -> tuple[Optional[str], bool]:
    """(``session_id``, ``stream``) of a JSON request body; ``(None, False)`` for anything else."""
    sid, stream, _ = request_hints(body, with_prompt=False)
    return sid, stream


def prompt_of(obj: dict) -> Union[str, list[int], None]:
    """What the ``prefix`` router keys a request by, read from its parsed JSON body without a tokenizer.

    Returns:
        the token ids of a completion whose ``prompt`` is token ids (or a batch of one such list):
        exactly the ids the replica prefills; the text of a completion whose ``prompt`` is a string
        (or a batch of one); for a chat request, a canonical text of its ``tools`` and ``messages``
        (each message's JSON with sorted keys, concatenated), which grows by appending as a
        conversation does; ``None`` for anything else (the router then sees no blocks). Text is
        keyed by character blocks (``ccft.serving.router.PrefixRouter.keys``): the ingress holds no
        tokenizer, and tokenizing here would repeat every replica's work for a routing hint.
    """
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    messages = obj.get("messages")
    if isinstance(messages, list) and messages:
        tools = obj.get("tools")
        parts = [json.dumps(tools, sort_keys=True, ensure_ascii=False)] if tools else []
        parts += [json.dumps(m, sort_keys=True, ensure_ascii=False) for m in messages]
        return "".join(parts)
    return None


# ---------------------------------------------------------------------------------------- routing
class SessionRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router that places requests with a ``ccft.serving.router`` policy.

    ``request_router_kwargs``: ``policy`` (a ``ccft.serving.router.ROUTERS`` name; default
    ``"session"``) and that router's options (``max_load_ratio``, ``min_load_gap``; ``prefix`` also
    ``block_tokens``, ``max_keys_per_worker``). See the module
    docstring; :meth:`place` is the pure decision (testable without Ray). When Ray backs off and asks
    again for the same request, it is placed again (the policy's counters count each placement).
    """

    def initialize_state(self, policy: str = "session", **options: Any) -> None:
        self.policy = make_router(policy, **options)
        self.spread = LeastLoadedRouter()
        #: session id -> replica id of its home (the policy itself keeps indices into the current list)
        self.homes: dict[Hashable, Any] = {}

    def place(
        self,
        session_id: Optional[Hashable],
        replica_ids: list[Any],
        loads: list[int],
        prompt: Union[str, list[int], None] = None,
    ) -> int:
        """Index into ``replica_ids`` (stable order) of the replica for a request of ``session_id``.

        The session's home (if still among ``replica_ids``) is handed to the policy as its index;
        a session whose home is gone is placed as new. ``session_id=None``: least-loaded, except
        under the ``prefix`` policy, which places every request by its ``prompt`` (token ids, or
        text: :func:`prompt_of`; ``None``: no blocks) over the replica ids.
        """
        prefix = isinstance(self.policy, PrefixRouter)
        if not isinstance(self.policy, SessionAffinityRouter) or (session_id is None and not prefix):
            router = self.spread if session_id is None else self.policy
            return router.place(session_id, (), loads)
        if session_id is not None:
            home = self.homes.get(session_id)
            if home in replica_ids:
                self.policy.placement[session_id] = replica_ids.index(home)
            else:
                self.policy.forget(session_id)
        if prefix:
            choice = self.policy.place(session_id, prompt or (), loads, worker_ids=replica_ids)
        else:
            choice = self.policy.place(session_id, (), loads)
        if session_id is not None:
            self.homes[session_id] = replica_ids[choice]
        return choice

    def load(self, replica: RunningReplica) -> int:
        """Ray's count of ongoing requests on ``replica`` (0 while unknown: Ray probes it)."""
        return int(self.replica_queue_len_cache.get(replica.replica_id) or 0)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # no busy retry loop when all are full
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        loads = [self.load(r) for r in ordered]
        sid, prompt = _hints_of_pending(pending_request)
        choice = self.place(sid, [r.replica_id for r in ordered], loads, prompt)
        return [[ordered[choice]]]

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        for sid in [s for s, h in self.homes.items() if h == replica_id]:
            self.homes.pop(sid)
        if isinstance(self.policy, PrefixRouter):
            self.policy.forget_worker(replica_id)


def _hints_of_pending(pending_request: Optional[PendingRequest]) -> tuple[Optional[str], Any]:
    """(session id, prompt hint) of the ForwardedRequest among the pending request's arguments."""
    if pending_request is None:
        return None, None
    # by its fields, not isinstance: Ray Serve pickles the ingress by value (serve.ingress), so the
    # ingress's ForwardedRequest may be a copy of this module's class
    for arg in pending_request.args:
        if hasattr(arg, "session_id") and hasattr(arg, "body"):
            return arg.session_id, getattr(arg, "prompt", None)
    return None, None


# ---------------------------------------------------------------------------------------- engine replica
class EngineReplica:
    """One engine replica: ``factory()`` → a ``Scheduler`` (or ``(scheduler, tokenizer)``) and its app.

    Args:
        factory: builds the replica's scheduler (called once per replica, in the replica process;
            must be picklable, e.g. ``functools.partial(ccft.cli.serve.build_scheduler, args)``).
        app_kwargs: keyword arguments of ``create_app`` (``default_max_tokens``, ``max_body_bytes``, ...).
    """

    def __init__(self, factory: Callable[[], Any], app_kwargs: Optional[dict] = None):
        from ccft.serving.app import create_app

        built = factory()
        scheduler, tokenizer = built if isinstance(built, tuple) else (built, None)
        self.scheduler = scheduler
        self.app = create_app(scheduler, tokenizer, **(app_kwargs or {}))
        if not scheduler.running:
            scheduler.start()  # the app's lifespan does not run here
        try:
            self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        except Exception:  # noqa: BLE001 - outside a Serve replica (direct use in tests)
            self.replica_id = "local"

    async def handle(self, req: ForwardedRequest):
        """Run ``req`` through the app: yields ``("start", status, headers)`` then ``("body", bytes)`` chunks.

        Closing the generator early (the client went away) reports a disconnect to the app, which
        cancels the request's tickets (the scheduler frees their KV).
        """
        headers = [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in req.headers if k not in _DROP_HEADERS
        ]
        headers.append((b"content-length", str(len(req.body)).encode()))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.path.encode(),
            "query_string": req.query.encode(),
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent_body = False

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await out.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _t: out.put_nowait(None))
        try:
            while True:
                message = await out.get()
                if message is None:
                    break
                if message["type"] == "http.response.start":
                    hs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                    yield ("start", int(message["status"]), hs + [(REPLICA_HEADER, self.replica_id)])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield ("body", bytes(message["body"]))
                    if not message.get("more_body", False):
                        break
            await asyncio.wait([task], timeout=5.0)  # the response is complete: let the app return
        finally:
            gone.set()  # closed early (the client went away): the app sees a disconnect ...
            if not task.done():
                task.cancel()  # ... and its handler, cancelled, cancels the request's tickets

    def stats(self) -> dict:
        """The replica's id and its scheduler's queue / active counts."""
        s = self.scheduler
        return {"replica": self.replica_id, "queued": s.queue_depth, "active": s.active}

    def __del__(self):
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and scheduler.running:
            scheduler.stop()


# ---------------------------------------------------------------------------------------- ingress
_ingress_api = FastAPI(title="ccft serve (Ray Serve)", openapi_url=None, docs_url=None, redoc_url=None)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}},
        status_code=status,
    )


def _response_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {k: v for k, v in headers if k.lower() not in {"content-length", "transfer-encoding"}}


# serve.ingress pickles the app (and so the helpers its routes use) here: everything they use is defined
# above.
@serve.ingress(_ingress_api)
class Ingress:
    """The HTTP entry: forwards every request to the engine deployment (see the module docstring).

    Args:
        engine: the ``Engine`` deployment's handle (Ray Serve passes it for the bound deployment).
        retries: how many times a request whose replica died before any response byte is re-sent.
        route_by_prompt: read each body's prompt hint (:func:`prompt_of`) for the ``prefix`` policy.
    """

    def __init__(self, engine, retries: int = 2, route_by_prompt: bool = False):
        # one handle for every request: its request router (and so the session placements) lives as long
        # as the handle; a handle made per call by ``options()`` would get a fresh router each time
        self.engine = engine.options(stream=True)
        self.retries = int(retries)
        self.route_by_prompt = bool(route_by_prompt)
        self.counts: Counter = Counter()
        self.by_replica: Counter = Counter()

    @_ingress_api.get("/ray/stats")
    async def ray_stats(self):
        """Ingress counters: ``requests``, ``retried`` (re-sent after a replica died), ``failed``
        (answered with a replica error), and answered requests per replica."""
        return {
            **{k: self.counts[k] for k in ("requests", "retried", "failed")},
            "by_replica": dict(self.by_replica),
        }

    @_ingress_api.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request):
        body = await request.body()
        post = request.method == "POST"
        sid, stream, prompt = (
            request_hints(body, with_prompt=self.route_by_prompt) if post else (None, False, None)
        )
        sid = sid if sid is not None else request.headers.get(SESSION_HEADER)
        fwd = ForwardedRequest(
            request.method,
            request.url.path,
            request.url.query,
            [(k.lower(), v) for k, v in request.headers.items()],
            body,
            sid,
            stream,
            prompt,
        )
        self.counts["requests"] += 1
        for attempt in range(self.retries + 1):
            gen = self.engine.handle.remote(fwd)
            try:
                _, status, headers = await gen.__anext__()
                head = []
                if stream and status == 200:  # keep the first chunk back: a failure before it is retried
                    async for item in gen:
                        head.append(item[1])
                        break
                else:
                    async for item in gen:
                        head.append(item[1])
            except asyncio.CancelledError:  # the client went away: cancel the request on its replica
                gen.cancel()
                raise
            except RayActorError as exc:
                gen.cancel()
                if attempt < self.retries:
                    self.counts["retried"] += 1
                    log.warning("engine replica died before answering (%s); retrying", exc)
                    continue
                self.counts["failed"] += 1
                return _error(
                    502,
                    f"the engine replica serving this request died and {self.retries} retries "
                    f"failed too ({type(exc).__name__}); send the request again",
                    "replica_failed",
                )
            replica = dict(headers).get(REPLICA_HEADER, "")
            self.by_replica[replica] += 1
            headers = [*headers, (ATTEMPTS_HEADER, str(attempt + 1))]
            if not (stream and status == 200):
                return Response(b"".join(head), status_code=status, headers=_response_headers(headers))
            return StreamingResponse(
                self._rest(gen, head), status_code=status, headers=_response_headers(headers)
            )
        raise AssertionError("unreachable")  # pragma: no cover

    async def _rest(self, gen, head: list[bytes]):
        for chunk in head:
            yield chunk
        try:
            async for item in gen:
                yield item[1]
        except RayActorError as exc:
            self.counts["failed"] += 1
            err = {
                "error": {
                    "message": f"the engine replica serving this stream died ({type(exc).__name__}); "
                    "the stream ends here: send the request again",
                    "type": "server_error",
                    "param": None,
                    "code": "replica_failed",
                }
            }
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            gen.cancel()


# ---------------------------------------------------------------------------------------- the app
def build_app(
    factory: Callable[[], Any],
    *,
    replicas: int = 2,
    policy: str = "session",
    policy_options: Optional[dict] = None,
    max_ongoing_requests: int = 256,
    replica_cpus: float = 1.0,
    retries: int = 2,
    app_kwargs: Optional[dict] = None,
    engine_name: str = "Engine",
):
    """The Ray Serve application: ``replicas`` engine replicas behind the ingress (``serve.run(app)``).

    Args:
        factory: builds one replica's scheduler (see :class:`EngineReplica`); picklable.
        replicas: number of engine replicas (≥ 1).
        policy: the ``ccft.serving.router`` router that places requests (``session``, ``prefix``,
            ``least-loaded``, ``round-robin``); ``policy_options``: its options (``prefix``: set its
            ``block_tokens`` to the replicas' prefix store block size).
        max_ongoing_requests: requests one replica takes at a time (its scheduler queues and batches
            them); beyond, Ray Serve holds them back or sends them to another replica.
        replica_cpus: CPUs Ray reserves for each engine replica (the ingress reserves none).
        retries: re-sends of a request whose replica died before answering.
        app_kwargs: ``create_app`` keyword arguments for every replica.
    Raises:
        ConfigError: ``replicas`` < 1, ``retries`` < 0, an unknown policy or bad policy options
            (checked here, before anything is deployed).
    """
    if int(replicas) < 1:
        raise ConfigError(f"replicas: must be >= 1 engine replica, got {replicas}")
    if int(retries) < 0:
        raise ConfigError(f"retries: must be >= 0, got {retries}")
    if int(max_ongoing_requests) < 1:
        raise ConfigError(f"max_ongoing_requests: must be >= 1, got {max_ongoing_requests}")
    options = dict(policy_options or {})
    ROUTERS[policy]  # noqa: B018 - ConfigError listing the choices for an unknown name
    make_router(policy, **options)  # bad options fail here, not in every replica's router
    router_config = RequestRouterConfig(
        request_router_class=SessionRequestRouter, request_router_kwargs={"policy": policy, **options}
    )
    engine = (
        serve.deployment(EngineReplica, name=engine_name)
        .options(
            num_replicas=int(replicas),
            max_ongoing_requests=int(max_ongoing_requests),
            ray_actor_options={"num_cpus": float(replica_cpus)},
            request_router_config=router_config,
        )
        .bind(factory, app_kwargs or {})
    )
    return (
        serve.deployment(Ingress, name="Ingress")
        .options(
            num_replicas=1,
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=4096,
        )
        .bind(engine, int(retries), policy == PrefixRouter.name)
    )


def replica_actor(replica_id: str):
    """The Ray actor of an engine replica, from the id in a response's ``x-ccft-replica`` header
    (e.g. to ``ray.kill`` it in a fault test). Raises ValueError when no such actor lives."""
    return ray.get_actor(replica_id, namespace=SERVE_NAMESPACE)
