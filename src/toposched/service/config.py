"""The service's one validated config object (every field has a default, a bound and a docstring)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from toposched.perf.profile import Profile
from toposched.topology.sources import SourceRef

PolicyName = Literal["slo", "latency", "index-order", "random", "exact"]
"""The placement policies a request or the service may name; ``exact`` only on clusters of at most
``solver.exact.MAX_GPUS`` GPUs (``ServiceState.open`` checks it once the cluster is known)."""


class ServiceConfig(BaseModel):
    """How ``toposched serve`` runs. Built by the CLI from flags and the environment; no I/O here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = Field(default=8080, ge=1, le=65535)
    """TCP port to listen on."""
    state: str = Field(default="memory", min_length=1)
    """Ledger URL: ``sqlite:PATH``, ``etcd:http://HOST:PORT[/NS]`` or ``memory`` (tests only)."""
    source: SourceRef | None = None
    """Topology source; None takes the newest DomainMap stored in the state (a replica starting cold)."""
    gpu: str | None = None
    """GPU type when the topology does not say (e.g. H100-SXM)."""
    profile: Profile | None = None
    """Cost-model profile predictions use for the service's lifetime (``--profile``); None: the shipped one."""
    token: str | None = Field(default=None, min_length=1, max_length=4096, repr=False)
    """Bearer token every API call but /healthz and /readyz must carry; None only with ``auth=False``."""
    report_token: str | None = Field(default=None, min_length=1, max_length=4096, repr=False)
    """A second token that may only ``POST /v1/reports`` (what sidecars send), so the engine pods that run a
    sidecar need not hold the API token, which may create and delete placements; None: no such token."""
    read_token: str | None = Field(default=None, min_length=1, max_length=4096, repr=False)
    """A token that may only read (``GET``: ``/metrics``, placements, topology, queue, alerts, the OpenAPI
    spec), for Prometheus and dashboards; None: no such token."""
    auth: bool = True
    """Require the bearer token (switching it off is for tests of the open parts only)."""
    open_extender: bool = False
    """Serve /v1/extender/* without the token (kube-scheduler cannot send one; it only reads state)."""
    policy: PolicyName = "slo"
    """Placement policy used when a request names none (``exact``: small clusters only, checked at open)."""
    budget_gbps: float = Field(default=256.0, gt=0, le=1e6)
    """Cross-domain traffic budget (GB/s) shared by all live placements."""
    max_body_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    """Largest request body accepted (413 above it)."""
    max_extender_body_bytes: int = Field(default=1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    """Largest body accepted by /v1/extender/* (kube-scheduler sends the pod and every candidate node)."""
    max_connections: int = Field(default=1024, ge=8, le=1_000_000)
    """Most open client connections; a new one beyond it closes the one that has waited longest for a request."""
    header_timeout_s: float = Field(default=10.0, gt=0, le=600)
    """Seconds a client has, from connecting or from its previous response, to send a request's headers (408)."""
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Seconds a client has, once its headers are in, to send the whole request body (408)."""
    keepalive_timeout_s: int = Field(default=5, ge=1, le=600)
    """Seconds an idle keep-alive connection stays open (at most ``header_timeout_s`` in effect)."""
    max_header_bytes: int = Field(default=32 * 1024, ge=1024, le=1024 * 1024)
    """Largest request line plus headers (431 above it)."""
    max_replicas: int = Field(default=64, ge=1, le=10_000)
    """Most instances one placement request may ask for."""
    max_queue: int = Field(default=1000, ge=0, le=1_000_000)
    """Most requests waiting in the admission queue (429 above it)."""
    max_wait_s: float = Field(default=60.0, ge=0, le=3600)
    """Longest a request may ask to wait in the admission queue (``wait_s``)."""
    commit_retries: int = Field(default=8, ge=1, le=100)
    """How often a decision the ledger refused (another replica took a GPU) is resynced and retried."""
    follow_interval_s: float = Field(default=1.0, gt=0, le=60)
    """Seconds between background ticks: follow the audit log, check the DomainMap version, serve the queue."""
    resync_interval_s: float = Field(default=60.0, gt=0, le=24 * 3600)
    """Seconds between the background's full resyncs (every live reservation re-read and checked: the safety
    net that finds a row damaged in place or a change missing from the audit log); the tick in between only
    follows the log."""
    replica: str = Field(default="", max_length=128)
    """Name of this replica in ledger owners (empty: host and process id)."""
    defrag_max_moves: int = Field(default=4, ge=1, le=16)
    """Most moves one defragmentation plan may use (the queue head's plans; POST /v1/defrag at most this)."""
    defrag_moves_per_window: int = Field(default=8, ge=0, le=10_000)
    """Most moves POST /v1/defrag may book within ``defrag_window_s`` (429 beyond; 0 turns booking off)."""
    defrag_window_s: float = Field(default=3600.0, gt=0, le=7 * 24 * 3600)
    """The sliding window of ``defrag_moves_per_window`` (seconds)."""
    keep_whole_domains: int = Field(default=0, ge=0, le=1024)
    """Headroom for whole-domain instances: a request that waits (``wait_s`` > 0, not disaggregated) is first
    decided without breaking one of the last this-many wholly free NVLink domains, and waits for room elsewhere
    up to ``keep_whole_wait_s``; 0 (default) turns it off. Worth it on clusters of many domains with TP groups
    that fill a domain (the simulator's churn-128: docs/simulator.md); on a one-node cluster it only delays."""
    keep_whole_wait_s: float = Field(default=30.0, ge=0, le=3600)
    """Longest a waiting request is held by ``keep_whole_domains`` (at most half its ``wait_s``)."""
    defrag_plan_interval_s: float = Field(default=10.0, gt=0, le=3600)
    """Seconds before the admission queue's head gets a new defragmentation plan (the plan is shown, never run)."""

    @model_validator(mode="after")
    def _token_when_auth(self) -> ServiceConfig:
        if self.auth and not self.token:
            raise ValueError("auth is on but no token was given (TOPOSCHED_API_TOKEN or --token-file)")
        given = [t for t in (self.token, self.report_token, self.read_token) if t is not None]
        if len(set(given)) != len(given):  # the scope of a token is decided by which one it is
            raise ValueError("the API token, the report token and the read token must all differ")
        return self
