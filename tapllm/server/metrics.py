"""Prometheus metrics of one server (prometheus_client, in a registry of its own)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tapllm.server.async_engine import AsyncEngine, LoopStats


class _EngineCollector(Collector):
    """Reads the engine thread's live numbers at scrape time (its latest ``LLMEngine.stats``)."""

    def __init__(self, stats: LoopStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s, e = self.stats, self.stats.engine
        yield CounterMetricFamily("tapllm_requests_aborted", "requests aborted (client gone, or shutdown)",
                                  value=s.requests_aborted)
        yield CounterMetricFamily("tapllm_engine_step_errors", "engine steps that raised", value=s.step_errors)
        yield GaugeMetricFamily("tapllm_requests_running", "requests being computed", value=e.running)
        yield GaugeMetricFamily("tapllm_requests_waiting", "requests queued (queue depth)", value=e.waiting)
        yield GaugeMetricFamily("tapllm_kv_cache_usage_ratio", "fraction of KV cache blocks in use",
                                value=e.kv_cache_usage)
        yield CounterMetricFamily("tapllm_prefix_cache_hits", "prompt tokens served from the prefix cache",
                                  value=e.prefix_cache_hit_tokens)
        yield CounterMetricFamily("tapllm_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  value=e.prefix_cache_queried_tokens)
        yield GaugeMetricFamily("tapllm_prefix_cache_hit_rate", "share of looked-up prompt tokens found in the "
                                "prefix cache, since start", value=e.prefix_cache_hit_rate)


class ServerMetrics:
    """Request, token and hidden-state counters, plus live gauges read from the engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Labelled by route template ("/v1/completions"; "unmatched" for unknown paths): bounded series.
        self.requests = Counter("tapllm_requests", "HTTP requests answered, by route and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("tapllm_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("tapllm_generation_tokens", "generated tokens of finished requests",
                                         registry=r)
        self.hidden_states_bytes = Counter("tapllm_hidden_states_bytes", "bytes of hidden states served "
                                           "(tensor bytes, before encoding)", registry=r)
        r.register(_EngineCollector(engine.stats))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
