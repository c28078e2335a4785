"""Prometheus metrics of one server (prometheus_client, in a registry of its own).

Two families: the original ``tapllm_*`` series, and vLLM's metric names under a ``tapllm:``
prefix (``vllm:time_to_first_token_seconds`` is ``tapllm:time_to_first_token_seconds``), so a
vLLM dashboard works after replacing the prefix. Every vLLM 0.32 family with a meaning here is
served (``VLLM_FAMILIES``); docs/serving.md lists the others and why they are not. Latencies are
measured from the engine thread's own timestamps (``Request.times``): arrival is when the HTTP
request came in, queue time ends when a step first runs the request, a token's time is the end
of the step that sampled it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from tapllm.server.records import FinishedRecord
from tapllm.server.runner import EngineRunner, LoopStats

VLLM = "tapllm:"  # the prefix of the series named after vLLM's

# vLLM's families served under the prefix (the rest of vLLM 0.32's are in docs/serving.md, with why not).
VLLM_FAMILIES = (
    "num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason", "engine_sleep_state",
    "kv_cache_usage_perc", "prefix_cache_hits", "prefix_cache_queries", "cache_config_info",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
    "request_prefill_kv_computed_tokens", "request_num_preemptions", "iteration_tokens_total", "request_success",
    "prompt_tokens", "prompt_tokens_by_source", "prompt_tokens_cached", "prompt_tokens_cached_by_source",
    "generation_tokens", "num_preemptions",
)
# vLLM's label values (v1/metrics): where prompt tokens came from, and which cache tier held the cached ones.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_TIERS = ("device", "host", "disk", "p2p", "external_unspecified")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
_N_BUCKETS = (1, 2, 5, 10, 20)

# Seconds: from 1 ms (a cached one-token prompt on a GPU) to 40 minutes (a long queue on a CPU).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


def length_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_len`` (and ``max_len`` itself): token-count buckets."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= max_len:
                return (*out, max_len)
            out.append(m * scale)
        scale *= 10


class _EngineCollector(Collector):
    """Reads the engine thread's live numbers at scrape time (its latest ``LLMEngine.stats``)."""

    def __init__(self, stats: LoopStats, cache_info: dict[str, str]) -> None:
        self.stats = stats
        self.cache_info = cache_info

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
        # the same numbers under vLLM's names
        yield CounterMetricFamily("tapllm_graph_steps", "decode steps replayed from a CUDA graph", value=e.graph_steps)
        fallbacks = CounterMetricFamily("tapllm_graph_fallback_steps", "steps run eagerly while CUDA graphs are on, "
                                        "by why a graph could not run them", labels=["reason"])
        for reason, count in sorted(e.graph_fallbacks.items()):
            fallbacks.add_metric([reason], count)
        yield fallbacks
        yield GaugeMetricFamily(VLLM + "num_requests_running", "requests being computed", value=e.running)
        yield GaugeMetricFamily(VLLM + "num_requests_waiting", "requests queued", value=e.waiting)
        yield GaugeMetricFamily(VLLM + "kv_cache_usage_perc", "fraction of KV cache blocks in use (1 = full)",
                                value=e.kv_cache_usage)
        yield CounterMetricFamily(VLLM + "prefix_cache_hits", "prompt tokens served from the prefix cache",
                                  value=e.prefix_cache_hit_tokens)
        yield CounterMetricFamily(VLLM + "prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  value=e.prefix_cache_queried_tokens)
        by_reason = GaugeMetricFamily(VLLM + "num_requests_waiting_by_reason", "requests queued, by why: capacity "
                                      "(KV cache or token budget); tapllm defers none", labels=["reason"])
        by_reason.add_metric(["capacity"], e.waiting)
        by_reason.add_metric(["deferred"], 0)
        yield by_reason
        sleep = GaugeMetricFamily(VLLM + "engine_sleep_state", "1 for the engine's state: tapllm has no sleep mode, "
                                  "so always awake", labels=["sleep_state"])
        for state in SLEEP_STATES:
            sleep.add_metric([state], 1 if state == "awake" else 0)
        yield sleep
        yield InfoMetricFamily(VLLM + "cache_config", "the KV cache's configuration", value=self.cache_info)


class _ReplicaCollector(Collector):
    """Per data-parallel replica: requests routed there (and by prefix affinity), its prefix-cache figures."""

    def __init__(self, replicas: Callable[[], list[tuple[int, int, int, int]]]) -> None:
        self.replicas = replicas  # (routed, affinity_routed, prefix hit tokens, prefix queried tokens) each

    def collect(self) -> Iterator[Metric]:
        rows = self.replicas()
        fams = [CounterMetricFamily("tapllm_dp_requests_routed", "requests this API server sent to each replica",
                                    labels=["replica"]),
                CounterMetricFamily("tapllm_dp_affinity_routed", "of them, sent there because it held their "
                                    "prompt's prefix", labels=["replica"]),
                CounterMetricFamily("tapllm_dp_prefix_cache_hits", "prompt tokens served from each replica's "
                                    "prefix cache", labels=["replica"]),
                CounterMetricFamily("tapllm_dp_prefix_cache_queries", "prompt tokens looked up in each replica's "
                                    "prefix cache", labels=["replica"])]
        for i, row in enumerate(rows):
            for fam, value in zip(fams, row, strict=True):
                fam.add_metric([str(i)], value)
        yield from fams


class _Latency:
    """vLLM's per-request histograms and counters, fed by the engine thread (``RequestObserver``)."""

    def __init__(self, registry: CollectorRegistry, max_len: int, max_batched: int) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(VLLM + name, doc, buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "from arrival to the first generated token", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "between consecutive generated tokens of a request",
                        _TOKEN_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "a request's mean time per generated token after "
                         "the first", _TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "from arrival to the request's end", _REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "from the engine taking the request to its first step",
                          _REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "from the first step to the first token",
                            _REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "from the first token to the last", _REQUEST_BUCKETS)
        lengths = length_buckets(max_len)
        self.prompt_len = hist("request_prompt_tokens", "prompt tokens of a finished request", lengths)
        self.generation_len = hist("request_generation_tokens", "tokens a finished request generated", lengths)
        self.success = Counter(VLLM + "request_success", "finished requests, by finish reason", ["finished_reason"],
                               registry=registry)
        self.prompt_tokens = Counter(VLLM + "prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter(VLLM + "generation_tokens", "generated tokens of finished requests",
                                         registry=registry)
        self.preemptions = Counter(VLLM + "num_preemptions", "preemptions of finished requests", registry=registry)
        self.inference = hist("request_inference_time_seconds", "from the first step to the request's end",
                              _REQUEST_BUCKETS)
        self.max_generation = hist("request_max_num_generation_tokens", "the most tokens one sample of a finished "
                                   "request generated", lengths)
        self.params_n = hist("request_params_n", "n of finished requests", _N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "max_tokens of finished requests (the rest of "
                                      "the context when not given)", lengths)
        self.computed = hist("request_prefill_kv_computed_tokens", "prompt tokens a finished request computed (not "
                             "read from the prefix cache)", lengths)
        self.request_preemptions = hist("request_num_preemptions", "preemptions of a finished request", _N_BUCKETS)
        self.iteration = hist("iteration_tokens_total", "tokens one engine step ran (prompt chunks and decodes)",
                              length_buckets(max_batched))
        self.by_source = Counter(VLLM + "prompt_tokens_by_source", "prompt tokens of finished requests, by where "
                                 "their KV came from", ["source"], registry=registry)
        self.cached = Counter(VLLM + "prompt_tokens_cached", "prompt tokens of finished requests read from the prefix "
                              "cache", registry=registry)
        self.cached_by_source = Counter(VLLM + "prompt_tokens_cached_by_source", "cached prompt tokens of finished "
                                        "requests, by cache tier (tapllm's cache is on the device)", ["source"],
                                        registry=registry)
        for source in PROMPT_SOURCES:
            self.by_source.labels(source)
        for tier in CACHE_TIERS:
            self.cached_by_source.labels(tier)

    def step(self, tokens: int) -> None:
        self.iteration.observe(tokens)

    def inter_token(self, seconds: float, count: int) -> None:
        for _ in range(count):
            self.itl.observe(seconds)

    def finished(self, r: FinishedRecord) -> None:
        generated = r.generated
        if r.arrival is not None and r.finished is not None:
            self.e2e.observe(r.finished - r.arrival)
        if r.queued is not None and r.scheduled is not None:
            self.queue.observe(r.scheduled - r.queued)
        if r.first_token is not None:
            if r.arrival is not None:
                self.ttft.observe(r.first_token - r.arrival)
            if r.scheduled is not None:
                self.prefill.observe(r.first_token - r.scheduled)
            if r.last_token is not None:
                self.decode.observe(r.last_token - r.first_token)
                if generated > 1:
                    self.tpot.observe((r.last_token - r.first_token) / (generated - 1))
        self.prompt_len.observe(r.num_prompt_tokens)
        self.prompt_tokens.inc(r.num_prompt_tokens)
        if not r.encode_only:
            self.generation_len.observe(generated)
            self.generation_tokens.inc(generated)
        self.success.labels(r.finish_reason or "stop").inc()
        if r.num_preemptions:
            self.preemptions.inc(r.num_preemptions)
        self._finished_vllm(r)

    def _finished_vllm(self, r: FinishedRecord) -> None:
        """The families vLLM added beside the latencies: parameters, cache use, inference time."""
        if r.scheduled is not None and r.finished is not None:
            self.inference.observe(r.finished - r.scheduled)
        cached = min(r.num_cached_tokens, r.num_prompt_tokens)
        computed = r.num_prompt_tokens - cached
        self.computed.observe(computed)
        self.cached.inc(cached)
        self.by_source.labels("local_compute").inc(computed)
        self.by_source.labels("local_cache_hit").inc(cached)
        self.cached_by_source.labels("device").inc(cached)
        self.request_preemptions.observe(r.group_preemptions)
        if not r.encode_only:
            self.params_n.observe(r.n)
            self.params_max_tokens.observe(r.max_tokens)
            self.max_generation.observe(r.max_generated)


class ServerMetrics:
    """Request, token and hidden-state counters, latency histograms, and live gauges read from the engine."""

    def __init__(self, engine: EngineRunner) -> None:
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
        config = engine.engine.config
        r.register(_EngineCollector(engine.stats, {
            "block_size": str(config.block_size), "num_gpu_blocks": str(engine.num_kv_blocks),
            "enable_prefix_caching": str(config.enable_prefix_caching), "cache_dtype": "auto"}))
        replicas = getattr(engine, "replica_figures", None)
        if replicas is not None:
            r.register(_ReplicaCollector(replicas))
        engine.observer = _Latency(r, engine.engine.model_config.max_model_len, config.max_num_batched_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
