"""Replay client for ``ccft serve``: send a workload's requests on its clock, measure TTFT and latency.

Each request is POSTed to ``/v1/completions`` (prompt token ids, ``model`` = decoder name,
``max_tokens``, the ``shared_prefix_tokens`` extension) once it is *released*: its arrival offset
has passed (seconds from the replay's start, times ``time_scale``) and every request it depends on
has finished (a session's next turn waits for the previous one). Per request it records the HTTP
status, the time to the first streamed chunk (TTFT, client side) and the end-to-end latency from
sending to the last byte.

Inputs: a ``ccft.serving.workloads.Trace`` (``requests_from_trace``), or plain dicts
(``requests_from_dicts``) with ``prompt`` (token ids or a string) or ``prompt_ids``, ``model``
(or ``agent`` / ``decoder``), ``max_tokens`` (or ``max_new_tokens``), ``shared_prefix_tokens``
(or ``shared_len``), ``arrival``, ``request_id``, ``session`` and ``depends_on``; a dict that names a
``session`` but no ``depends_on`` waits for the previous request of its session. ``load_requests``
reads either kind of JSONL file. Dependencies must name earlier requests.

Example::

    records = asyncio.run(replay("http://127.0.0.1:8000", requests_from_trace(trace)))
    print(summarize(records))
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ccft.core.errors import ConfigError

__all__ = [
    "ReplayRequest",
    "ReplayRecord",
    "requests_from_dicts",
    "requests_from_trace",
    "load_requests",
    "check_requests",
    "replay",
    "run_replay",
    "summarize",
    "quantile",
]


@dataclass
class ReplayRequest:
    """One request to replay. ``prompt``: token ids (or a string); ``arrival``: seconds from the start."""

    request_id: str
    model: str
    prompt: list[int] | str
    max_tokens: int = 16
    shared_prefix_tokens: int | None = None
    arrival: float = 0.0
    depends_on: tuple[str, ...] = ()
    session: Any = None
    extra: dict = field(default_factory=dict)  # more request fields (stop, temperature, ignore_eos, ...)


@dataclass
class ReplayRecord:
    """What happened to one request. Times in seconds; ``sent``: from the replay's start.

    ``status``: the HTTP status (0: no response, see ``error``). ``ttft``: sending → first streamed
    chunk (None without streaming). ``latency``: sending → end of the response.
    """

    request_id: str
    model: str
    session: Any
    arrival: float
    sent: float | None = None
    status: int = 0
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    token_ids: list[int] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


# ---------------------------------------------------------------------------------------- inputs
def requests_from_dicts(rows: Iterable[dict]) -> list[ReplayRequest]:
    """``ReplayRequest`` s from plain dicts (see the module docstring for the keys)."""
    out: list[ReplayRequest] = []
    last_of_session: dict[Any, str] = {}
    known = {
        "request_id",
        "prompt",
        "prompt_ids",
        "model",
        "agent",
        "decoder",
        "max_tokens",
        "max_new_tokens",
        "shared_prefix_tokens",
        "shared_len",
        "arrival",
        "depends_on",
        "session",
    }
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"request {i}: expected a dict, got {type(row).__name__}")
        prompt = row.get("prompt", row.get("prompt_ids"))
        model = row.get("model", row.get("agent", row.get("decoder")))
        if prompt is None or model is None:
            raise ConfigError(
                f"request {i}: needs 'prompt' (or 'prompt_ids') and 'model' (or 'agent'/'decoder')"
            )
        rid = str(row.get("request_id", i))
        session = row.get("session")
        if "depends_on" in row:
            deps = tuple(str(d) for d in (row["depends_on"] or ()))
        elif session is not None and session in last_of_session:
            deps = (last_of_session[session],)
        else:
            deps = ()
        if session is not None:
            last_of_session[session] = rid
        out.append(
            ReplayRequest(
                request_id=rid,
                model=str(model),
                prompt=prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                max_tokens=int(row.get("max_tokens", row.get("max_new_tokens", 16))),
                shared_prefix_tokens=row.get("shared_prefix_tokens", row.get("shared_len")),
                arrival=float(row.get("arrival", 0.0)),
                depends_on=deps,
                session=session,
                extra={k: v for k, v in row.items() if k not in known},
            )
        )
    return out


def requests_from_trace(trace) -> list[ReplayRequest]:
    """``ReplayRequest`` s of a ``ccft.serving.workloads.Trace`` (agent → model, shared_len →
    shared_prefix_tokens)."""
    return [
        ReplayRequest(
            request_id=r.request_id,
            model=r.agent,
            prompt=list(r.prompt_ids),
            max_tokens=int(r.max_new_tokens),
            shared_prefix_tokens=int(r.shared_len),
            arrival=float(r.arrival),
            depends_on=tuple(r.depends_on),
            session=r.session,
        )
        for r in trace.requests
    ]


def load_requests(path: str | Path, *, tokenizer=None) -> list[ReplayRequest]:
    """Requests of a JSONL file: a ccft trace (``workloads.Trace.save``) or one request dict per line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--trace: {path} does not exist")
    with path.open(encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    if not first:
        raise ConfigError(f"--trace: {path} is empty")
    head = json.loads(first)
    if isinstance(head, dict) and head.get("type") == "meta":
        from ccft.serving.workloads import Trace

        return requests_from_trace(Trace.load(path, tokenizer=tokenizer))
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return requests_from_dicts(rows)


# ---------------------------------------------------------------------------------------- replay
def check_requests(requests: Sequence[ReplayRequest]) -> None:
    """Raise ``ConfigError`` for a duplicate request id or a dependency that is not an earlier request."""
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen:
            raise ConfigError(f"request_id {r.request_id!r} appears twice; request ids must be unique")
        missing = [d for d in r.depends_on if d not in seen]
        if missing:
            raise ConfigError(
                f"request {r.request_id!r} depends on {missing}, which are not earlier requests"
            )
        seen.add(r.request_id)


async def _send(
    client, r: ReplayRequest, rec: ReplayRecord, *, stream: bool, return_token_ids: bool, extra: dict
) -> None:
    import httpx

    body: dict[str, Any] = {
        "model": r.model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "stream": stream,
        **extra,
        **r.extra,
    }
    if r.shared_prefix_tokens is not None:
        body["shared_prefix_tokens"] = int(r.shared_prefix_tokens)
    if return_token_ids:
        body["return_token_ids"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    try:
        if not stream:
            resp = await client.post("/v1/completions", json=body)
            rec.latency = time.perf_counter() - t0
            rec.status = resp.status_code
            data = resp.json()
            if resp.status_code != 200:
                rec.error = (data.get("error") or {}).get("message") if isinstance(data, dict) else str(data)
                return
            choice = data["choices"][0]
            rec.text, rec.finish_reason = choice["text"], choice["finish_reason"]
            rec.token_ids = choice.get("token_ids")
            rec.prompt_tokens = data["usage"]["prompt_tokens"]
            rec.completion_tokens = data["usage"]["completion_tokens"]
            return
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.latency = time.perf_counter() - t0
                try:
                    rec.error = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    rec.error = raw.decode(errors="replace")[:500]
                return
            texts, ids = [], []
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    rec.error = data["error"].get("message")
                    continue
                for choice in data.get("choices") or ():
                    if rec.ttft is None:
                        rec.ttft = time.perf_counter() - t0
                    texts.append(choice.get("text") or "")
                    ids += choice.get("token_ids") or []
                    if choice.get("finish_reason") is not None:
                        rec.finish_reason = choice["finish_reason"]
                if data.get("usage"):
                    rec.prompt_tokens = data["usage"]["prompt_tokens"]
                    rec.completion_tokens = data["usage"]["completion_tokens"]
            rec.latency = time.perf_counter() - t0
            rec.text = "".join(texts)
            rec.token_ids = ids if return_token_ids else None
            if rec.finish_reason is None and rec.error is None:
                rec.error = "the stream ended without a finish_reason"
    except httpx.HTTPError as e:
        rec.latency = time.perf_counter() - t0
        rec.error = f"{type(e).__name__}: {e}"


async def replay(
    url: str,
    requests: Sequence[ReplayRequest],
    *,
    stream: bool = True,
    time_scale: float = 1.0,
    timeout: float = 600.0,
    return_token_ids: bool = False,
    extra: dict | None = None,
    client=None,
) -> list[ReplayRecord]:
    """Replay ``requests`` against the server at ``url``; one ``ReplayRecord`` per request, in input order.

    Args:
        url: the server's base URL (``http://127.0.0.1:8000``).
        stream: stream responses (TTFT = first chunk); False: plain JSON responses (no TTFT).
        time_scale: multiply arrival offsets (0: send every released request at once).
        timeout: per-request HTTP timeout in seconds.
        return_token_ids: ask for the generated ids (ccft extension) and record them.
        extra: request fields added to every request (``ignore_eos``, ``temperature``, ...).
        client: an ``httpx.AsyncClient`` to use (its ``base_url`` must be ``url``); default: a new one
            with unlimited connections.
    Raises:
        ConfigError: duplicate request ids, or a dependency that is not an earlier request.
    """
    import httpx

    requests = list(requests)
    check_requests(requests)
    finished = {r.request_id: asyncio.Event() for r in requests}
    own = client is None
    if own:
        client = httpx.AsyncClient(
            base_url=url,
            timeout=timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
    start = time.perf_counter()

    async def one(r: ReplayRequest) -> ReplayRecord:
        rec = ReplayRecord(r.request_id, r.model, r.session, r.arrival)
        try:
            for d in r.depends_on:
                await finished[d].wait()
            delay = r.arrival * time_scale - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            rec.sent = time.perf_counter() - start
            await _send(
                client, r, rec, stream=stream, return_token_ids=return_token_ids, extra=dict(extra or {})
            )
        finally:
            finished[r.request_id].set()  # a failed turn still releases the next one
        return rec

    try:
        return list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        if own:
            await client.aclose()


def run_replay(url: str, requests: Sequence[ReplayRequest], **kwargs) -> list[ReplayRecord]:
    """``replay`` from synchronous code (``asyncio.run``)."""
    return asyncio.run(replay(url, requests, **kwargs))


def quantile(xs: Sequence[float], p: float) -> float | None:
    """The ``p``-quantile (0..1) of ``xs`` by the nearest rank of the sorted values; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p * (len(xs) - 1))))]


def _quantiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "p50": quantile(xs, 0.5),
        "p90": quantile(xs, 0.9),
        "p99": quantile(xs, 0.99),
        "max": max(xs),
    }


def summarize(records: Sequence[ReplayRecord]) -> dict:
    """Counts, TTFT and latency quantiles (seconds), tokens and throughput of a replay."""
    ok = [r for r in records if r.ok]
    by_status: dict[str, int] = {}
    for r in records:
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    ends = [r.sent + r.latency for r in records if r.sent is not None and r.latency is not None]
    duration = max(ends, default=0.0)
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "requests": len(records),
        "ok": len(ok),
        "by_status": by_status,
        "ttft_s": _quantiles([r.ttft for r in ok if r.ttft is not None]),
        "latency_s": _quantiles([r.latency for r in ok if r.latency is not None]),
        "completion_tokens": tokens,
        "duration_s": duration,
        "tokens_per_s": tokens / duration if duration else 0.0,
        "requests_per_s": len(ok) / duration if duration else 0.0,
    }
