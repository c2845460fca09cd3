"""Prometheus metrics of the router: latencies, KV transfer volume, per-worker load."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; fine at the low end, where decode gaps on a CPU sit.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("epdserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("epdserve_inter_token_latency_seconds", "Gap between output chunks", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("epdserve_e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("epdserve_request_queue_time_seconds", "Arrival to prefill start", buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("epdserve_requests_total", "Finished requests by outcome", ["outcome"], registry=r)
        self.class_requests = Counter("epdserve_class_requests_total", "Finished requests by service class and "
                                      "whether they met the class's SLO (met, missed; none: the class has no SLO)",
                                      ["service_class", "slo"], registry=r)
        self.rejected = Counter("epdserve_requests_rejected_total", "Requests refused at admission", ["reason"], registry=r)
        self.kv_bytes = Counter("epdserve_kv_transfer_bytes_total", "KV bytes moved prefill -> decode, by transport "
                                "(shm: same node, tcp: across nodes)", ["transport"], registry=r)
        self.kv_group_bytes = Counter("epdserve_kv_transfer_group_bytes_total", "KV bytes moved prefill -> decode, "
                                      "by KV cache group (full attention; sliding<W>: a sliding window of W "
                                      "tokens, of which only the window's blocks move)", ["group"], registry=r)
        self.kv_bytes_skipped = Counter("epdserve_kv_transfer_skipped_bytes_total", "KV bytes not moved prefill -> "
                                        "decode: the decode worker had them in its prefix cache", registry=r)
        self.prefix_cached_tokens = Counter("epdserve_prefix_cache_hit_tokens_total", "Prompt tokens served from a "
                                            "worker's prefix cache, by the role of the worker", ["role"], registry=r)
        self.kv_tier_tokens = Counter("epdserve_kv_tier_tokens_total", "Prompt tokens found in the KV tiers below a "
                                      "worker's pool (found), chosen by the reload rule to load (chosen), "
                                      "loaded from each tier (host, disk), and copied from the decode "
                                      "worker's pages (peer)", ["kind"], registry=r)
        self.kv_seconds = Counter("epdserve_kv_transfer_seconds_total", "Seconds KV transfers were in flight", registry=r)
        self.kv_exposed = Counter("epdserve_kv_transfer_exposed_seconds_total", "KV transfer time not hidden behind prefill", registry=r)
        self.prompt_tokens = Counter("epdserve_prompt_tokens_total", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("epdserve_generation_tokens_total", "Generated tokens", registry=r)
        self.images = Counter("epdserve_images_total", "Images in admitted requests", registry=r)
        self.embedding_bytes = Counter("epdserve_embedding_transfer_bytes_total", "Embedding bytes moved encode -> prefill", registry=r)
        self.encoder_cache_hits = Counter("epdserve_encoder_cache_hits_total", "Images served from an encoder's cache", registry=r)
        self.encode_time = Histogram("epdserve_image_encode_seconds", "Encode start to end, per image", buckets=_LATENCY_BUCKETS, registry=r)
        self.slab_rows_free = Gauge("epdserve_worker_embedding_slab_rows_free", "Free rows of a consumer's embedding slab", ["worker"], registry=r)
        # The router's own process: a collection stops its event loop (every stream) while it runs.
        self.gc_pause = Histogram("epdserve_router_gc_pause_seconds", "Garbage collections in the router process",
                                  ["generation"], buckets=_GC_PAUSE_BUCKETS, registry=r)
        self.gc_frozen = Gauge("epdserve_router_gc_frozen_objects",
                               "Objects alive at the end of start-up, out of the collector's reach", registry=r)
        # What the router holds: both return to 0 when no request is in the server.
        self.pending = Gauge("epdserve_router_requests_pending", "Admitted requests not yet finished", registry=r)
        self.paths = Gauge("epdserve_router_request_paths", "Sequences the router tracks on workers", registry=r)
        labels = ["worker", "role"]
        self.blocks_used = Gauge("epdserve_worker_kv_blocks_used", "KV blocks in use", labels, registry=r)
        self.blocks_free = Gauge("epdserve_worker_kv_blocks_free", "KV blocks free", labels, registry=r)
        self.running = Gauge("epdserve_worker_requests_running", "Requests running", labels, registry=r)
        self.waiting = Gauge("epdserve_worker_requests_waiting", "Requests waiting", labels, registry=r)
        self.worker_up = Gauge("epdserve_worker_up", "1 while the worker is alive", labels, registry=r)
        self.role_switches = Counter("epdserve_role_switches_total", "Workers that changed role at run time "
                                     "(--role-switching), by the role left and the role taken",
                                     ["from_role", "to_role"], registry=r)
        self.handovers = Counter("epdserve_handovers_total", "Requests a draining decode worker handed to "
                                 "another (moved: running, its KV copied; recomputed: the fallback; retargeted: "
                                 "its prompt still queued, its KV sent to the other's blocks)", ["outcome"],
                                 registry=r)
        self.workers_by_role = Gauge("epdserve_workers", "Workers by role and state (ready; draining: finishing "
                                     "what they hold before a switch of role; switching)", ["role", "state"],
                                     registry=r)

    def observe_load(self, worker: str, role: str, running: int, waiting: int, used: int, free: int) -> None:
        self.running.labels(worker, role).set(running)
        self.waiting.labels(worker, role).set(waiting)
        self.blocks_used.labels(worker, role).set(used)
        self.blocks_free.labels(worker, role).set(free)

    def forget_worker_role(self, worker: str, role: str) -> None:
        """The worker left ``role`` (a switch): its per-worker series under it go."""
        for gauge in (self.running, self.waiting, self.blocks_used, self.blocks_free, self.worker_up):
            try:
                gauge.remove(worker, role)
            except KeyError:
                pass

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(str(generation)).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
