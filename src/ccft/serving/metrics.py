"""``ServerMetrics``: the Prometheus metrics of one ``ccft serve`` app (``GET /metrics``).

Latencies are measured by the scheduler (``Ticket`` times, ``time.perf_counter()`` seconds from
submit); token counts come from the tickets; queue, KV and prefix-store figures are read from the
scheduler when ``/metrics`` is scraped. See docs/server.md, "Metrics".
"""

from __future__ import annotations

from typing import Sequence

from ccft.serving.extra import serve_extra_missing

try:
    import prometheus_client as prom
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
except ImportError as e:  # pragma: no cover - depends on the installation
    raise serve_extra_missing(e) from e

from ccft.serving.scheduler import Scheduler, Ticket
from ccft.serving.schemas import FINISH_REASONS

__all__ = ["ServerMetrics", "LATENCY_BUCKETS", "TPOT_BUCKETS", "CONTENT_TYPE"]

#: latency histogram buckets (seconds): CPU serving reaches tens of seconds under load
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: the media type of ``ServerMetrics.render()``
CONTENT_TYPE = prom.CONTENT_TYPE_LATEST


class ServerMetrics:
    """Prometheus metrics of one app, in their own ``CollectorRegistry`` (``registry``).

    Histograms by ``model``: ``ccft_time_to_first_token_seconds`` (submit → first token, measured
    by the scheduler), ``ccft_time_per_output_token_seconds`` (mean per token after the first, one
    observation per request), ``ccft_e2e_request_latency_seconds`` (submit → end of a completed
    request). Counters: ``ccft_requests_total{model, outcome}`` with outcome ``stop`` / ``length``
    (completed, by finish reason), ``cancelled`` (client went away), ``error`` (engine failure),
    ``queue_full``, ``prompt_too_long``, ``invalid`` (400), ``too_large`` (413, model ""),
    ``unknown_model`` (404, model "");
    ``ccft_prompt_tokens_total`` and ``ccft_generation_tokens_total`` by model. Read from the
    scheduler at scrape time: gauges ``ccft_queue_depth``, ``ccft_active_requests``,
    ``ccft_live_kv_bytes`` (``Scheduler.live_bytes``), ``ccft_prefix_store_bytes``,
    ``ccft_prefix_arena_bytes`` (``Scheduler.arena_bytes``: the prefix arena's capacity),
    ``ccft_prefix_hit_ratio`` (context tokens copied from the prefix store / context tokens of
    every prefill; a context already live is not prefilled again and is not counted),
    ``ccft_kv_budget_bytes`` (when set) and counters ``ccft_scheduler_<name>_total`` for the
    scheduler's counters (prefills, prefill_tokens, prefix_hit_tokens, decode_steps, ...). With a prefix
    pool (``ccft serve --prefix-pool``; ``ccft.serving.prefix_pool``): counters
    ``ccft_prefix_pool_hit_blocks_total`` (blocks fetched) / ``_miss_blocks_total`` (fetches that ended
    before the chain did),
    ``_fetched_bytes_total``, ``_published_blocks_total``, ``_published_bytes_total``, ``_skipped_total``
    (lookups and publishes not tried while the pool was down), ``ccft_prefix_pool_errors_total{kind}``
    (``unavailable``, ``corrupt``, ``mismatch``), the summary ``ccft_prefix_pool_fetch_seconds`` (count and
    sum over fetches: one per lookup that reached the pool, however many blocks it fetched) and the gauge
    ``ccft_prefix_pool_up`` (0 while the pool is skipped after a failure).
    With a disk spill (``ccft serve --prefix-spill-dir``; ``ccft.serving.prefix_spill``): counters
    ``ccft_prefix_spill_spilled_blocks_total`` / ``_spilled_bytes_total`` (evicted blocks written),
    ``_hit_blocks_total`` / ``_miss_blocks_total`` (blocks looked up on disk), ``_read_bytes_total``,
    ``_evicted_blocks_total`` (files deleted past the capacity), ``ccft_prefix_spill_errors_total{kind}``
    (``corrupt``, ``mismatch``, ``io``), the summaries ``ccft_prefix_spill_write_seconds`` and
    ``_read_seconds`` (count and sum) and the gauges ``ccft_prefix_spill_bytes`` (bytes of block files on
    disk) and ``ccft_prefix_spill_blocks``.
    """

    SCHEDULER_COUNTERS = (
        "submitted",
        "admitted",
        "prefills",
        "prefill_tokens",
        "prefix_hit_tokens",
        "context_reuse_tokens",
        "decode_steps",
        "decode_rows",
        "admission_waits",
        "arena_waits",
        "done",
        "cancelled",
        "error",
        "rejected_queue_full",
        "prefill_chunks",
        "mlfq_demotions",
        "mlfq_promotions",
        "reloads",
    )

    def __init__(self, scheduler: Scheduler):
        self.registry = prom.CollectorRegistry()
        self.scheduler = scheduler
        r = self.registry
        self.ttft = prom.Histogram(
            "ccft_time_to_first_token_seconds",
            "Seconds from submit to the first token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = prom.Histogram(
            "ccft_time_per_output_token_seconds",
            "Mean seconds per output token after the first (one observation per request)",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = prom.Histogram(
            "ccft_e2e_request_latency_seconds",
            "Seconds from submit to the end of a completed request",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = prom.Counter("ccft_requests", "Requests by outcome", ["model", "outcome"], registry=r)
        self.prompt_tokens = prom.Counter(
            "ccft_prompt_tokens", "Prompt tokens of completed requests", ["model"], registry=r
        )
        self.generation_tokens = prom.Counter(
            "ccft_generation_tokens", "Tokens generated (every request)", ["model"], registry=r
        )
        r.register(_SchedulerCollector(scheduler, self.SCHEDULER_COUNTERS))

    def finished(self, model: str, ticket: Ticket, *, count_prompt: bool = True) -> None:
        """Record a ticket that ended (on the asyncio loop). ``count_prompt=False``: a request's choice
        after the first (``n`` > 1): its prompt tokens are counted once, with the first choice."""
        if ticket.ttft is not None:
            self.ttft.labels(model).observe(ticket.ttft)
        self.generation_tokens.labels(model).inc(len(ticket.tokens))
        if ticket.state == "done" and ticket.result is not None:
            if ticket.latency is not None:
                self.e2e.labels(model).observe(ticket.latency)
            if ticket.tpot is not None:
                self.tpot.labels(model).observe(ticket.tpot)
            if count_prompt:
                self.prompt_tokens.labels(model).inc(len(ticket.request.prompt_ids))
            outcome = FINISH_REASONS.get(ticket.result.finish_reason, ticket.result.finish_reason)
        else:
            outcome = ticket.state
        self.requests.labels(model, outcome).inc()

    def rejected(self, model: str, outcome: str) -> None:
        """Count a request answered without reaching the engine (``outcome``: invalid, unknown_model, ...)."""
        self.requests.labels(model, outcome).inc()

    def render(self) -> bytes:
        """The registry in the Prometheus text format (media type ``CONTENT_TYPE``)."""
        return prom.generate_latest(self.registry)


def _pool_metrics(pool):
    """The prefix pool tier's counters (``PrefixPool.stats``) as metric families."""
    st = pool.stats()
    for name, doc in (
        ("hit_blocks", "Blocks found in the prefix pool"),
        ("miss_blocks", "Blocks looked up in the prefix pool and not found (or unusable)"),
        ("fetched_bytes", "Bytes fetched from the prefix pool"),
        ("published_blocks", "Blocks this replica put into the prefix pool"),
        ("published_bytes", "Bytes this replica put into the prefix pool"),
        ("skipped", "Pool lookups and publishes not tried: the pool was down"),
    ):
        c = CounterMetricFamily(f"ccft_prefix_pool_{name}", doc)
        c.add_metric([], float(st[name]))
        yield c
    errors = CounterMetricFamily("ccft_prefix_pool_errors", "Prefix pool errors by kind", labels=["kind"])
    for kind, n in sorted(st["errors"].items()):
        errors.add_metric([kind], float(n))
    yield errors
    yield SummaryMetricFamily(
        "ccft_prefix_pool_fetch_seconds",
        "Seconds per prefix pool fetch (hits and misses)",
        count_value=st["fetches"],
        sum_value=st["fetch_seconds"],
    )
    yield GaugeMetricFamily("ccft_prefix_pool_up", "1 while the prefix pool is used", value=float(st["up"]))


def _spill_metrics(spill):
    """The disk spill tier's counters (``DiskSpill.stats``) as metric families."""
    st = spill.stats()
    for name, doc in (
        ("spilled_blocks", "Blocks evicted from the prefix store and written to disk"),
        ("spilled_bytes", "Bytes of block files written to disk"),
        ("hit_blocks", "Blocks read back from the disk spill"),
        ("miss_blocks", "Blocks looked up on the disk spill and not found (or unusable)"),
        ("read_bytes", "Bytes of block files read from disk"),
        ("evicted_blocks", "Block files deleted past the disk spill's capacity"),
    ):
        c = CounterMetricFamily(f"ccft_prefix_spill_{name}", doc)
        c.add_metric([], float(st[name]))
        yield c
    errors = CounterMetricFamily("ccft_prefix_spill_errors", "Disk spill errors by kind", labels=["kind"])
    for kind, n in sorted(st["errors"].items()):
        errors.add_metric([kind], float(n))
    yield errors
    for op in ("write", "read"):
        yield SummaryMetricFamily(
            f"ccft_prefix_spill_{op}_seconds",
            f"Seconds per disk spill {op}",
            count_value=st[f"{op}s"],
            sum_value=st[f"{op}_seconds"],
        )
    yield GaugeMetricFamily(
        "ccft_prefix_spill_bytes", "Bytes of block files on disk", value=st["bytes_on_disk"]
    )
    yield GaugeMetricFamily("ccft_prefix_spill_blocks", "Block files on disk", value=st["blocks"])


class _SchedulerCollector:
    """Scheduler gauges and counters, read when /metrics is scraped."""

    def __init__(self, scheduler: Scheduler, counter_names: Sequence[str]):
        self.s, self.names = scheduler, counter_names

    def describe(self):
        return []  # collected lazily; nothing to check at registration

    def collect(self):
        s = self.s
        counters = s.counters

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=float(value))

        yield gauge("ccft_queue_depth", "Requests waiting for admission", s.queue_depth)
        yield gauge("ccft_active_requests", "Requests decoding in the engine", s.active)
        yield gauge(
            "ccft_live_kv_bytes",
            "Live KV bytes: context handles + tail slots reserved by active requests",
            s.live_bytes,
        )
        yield gauge("ccft_prefix_store_bytes", "Bytes of K/V blocks in the prefix store", s.store_bytes)
        yield gauge(
            "ccft_prefix_arena_bytes",
            "Bytes of the engine's prefix arena (its whole capacity; it grows and is not given back)",
            s.arena_bytes,
        )
        hit, miss = counters.get("prefix_hit_tokens", 0), counters.get("prefill_tokens", 0)
        yield gauge(
            "ccft_prefix_hit_ratio",
            "Context tokens copied from the prefix store / context tokens prefilled",
            hit / (hit + miss) if hit + miss else 0.0,
        )
        if s.kv_budget_bytes is not None:
            yield gauge("ccft_kv_budget_bytes", "KV byte budget (live KV + prefix store)", s.kv_budget_bytes)
        pool = getattr(s.store, "pool", None) if s.store is not None else None
        if pool is not None:
            yield from _pool_metrics(pool)
        spill = getattr(s.store, "spill", None) if s.store is not None else None
        if spill is not None:
            yield from _spill_metrics(spill)
        for name in self.names:
            c = CounterMetricFamily(f"ccft_scheduler_{name}", f"Scheduler counter {name!r}")
            c.add_metric([], float(counters.get(name, 0)))
            yield c
