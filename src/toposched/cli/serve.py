"""``toposched serve``: the scheduler as an HTTP service (one replica; several share state through etcd)."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from pydantic import ValidationError

from toposched.cli._common import (
    CLUSTER,
    LIVE,
    P2P,
    PRESET,
    READ_TOKEN_ENV,
    REPORT_TOKEN_ENV,
    SMI,
    STATE,
    TOKEN_ENV,
    err_console,
    ledger_url,
    read_token,
    source_ref,
)
from toposched.cli.calibrate import PROFILE, profile_option
from toposched.errors import InputError, first_problem
from toposched.perf.profile import use_profile
from toposched.service.config import ServiceConfig

if TYPE_CHECKING:
    from toposched.service.guards import ConnectionLimits

FD_RESERVE = 128
"""Open files kept for other than client connections: the state (SQLite, etcd sockets), logs, the listener."""


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback unless told otherwise)."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    state: str | None = STATE,
    smi: str | None = SMI,
    preset: str | None = PRESET,
    cluster: str | None = CLUSTER,
    live: bool = LIVE,
    p2p: str | None = P2P,
    gpu: str | None = typer.Option(None, "--gpu", help="GPU type when the topology does not say (e.g. H100-SXM)."),
    token_file: Path | None = typer.Option(
        None, "--token-file", help=f"File holding the API token [default: ${TOKEN_ENV}].", metavar="FILE"
    ),
    report_token_file: Path | None = typer.Option(
        None,
        "--report-token-file",
        help=f"File holding a token that may only POST /v1/reports, for sidecars [default: ${REPORT_TOKEN_ENV}].",
        metavar="FILE",
    ),
    read_token_file: Path | None = typer.Option(
        None,
        "--read-token-file",
        help=f"File holding a token that may only read (GET: /metrics, placements...) [default: ${READ_TOKEN_ENV}].",
        metavar="FILE",
    ),
    policy: str = typer.Option(
        "slo",
        "--policy",
        help="Default placement policy: slo|latency|index-order|random|exact (exact: clusters of at most 128 GPUs).",
    ),
    budget_gbps: float = typer.Option(256.0, "--budget-gbps", help="Cross-domain traffic budget (GB/s)."),
    replica: str = typer.Option("", "--replica", help="Name of this replica in ledger owners [default: host-pid]."),
    open_extender: bool = typer.Option(
        False, "--open-extender", help="Serve /v1/extender/* without the token (kube-scheduler sends none)."
    ),
    max_connections: int = typer.Option(
        1024, "--max-connections", help="Most open client connections (beyond: close the longest waiting)."
    ),
    header_timeout: float = typer.Option(
        10.0, "--header-timeout", help="Seconds a client has to send a request's headers (then 408, closed)."
    ),
    body_timeout: float = typer.Option(
        30.0, "--body-timeout", help="Seconds a client has to send a request body after its headers."
    ),
    keep_whole_domains: int = typer.Option(
        0,
        "--keep-whole-domains",
        help="Headroom: a waiting request (wait_s > 0) does not break one of the last N wholly free NVLink "
        "domains for up to --keep-whole-wait seconds (0: off).",
    ),
    keep_whole_wait: float = typer.Option(
        30.0, "--keep-whole-wait", help="Longest a waiting request is held by --keep-whole-domains (seconds)."
    ),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
    profile: Path | None = PROFILE,
) -> None:
    """Serve the placement API, the Kubernetes extender, /metrics and the web page (/ui/)."""
    token = read_token(token_file)
    if token is None:
        raise InputError(
            "no API token: the service needs one",
            fix=f"export {TOKEN_ENV}=... or pass --token-file FILE",
        )
    report_token = read_token(report_token_file, env=REPORT_TOKEN_ENV, flag="--report-token-file")
    read_only_token = read_token(read_token_file, env=READ_TOKEN_ENV, flag="--read-token-file")

    def source(flag: str, path: Path | None, env: str) -> str:
        """Where a token came from, as the user gave it (issue 38: the file was named as the variable)."""
        return f"{flag} {path}" if path is not None else f"${env}"

    named = {
        source("--token-file", token_file, TOKEN_ENV): token,
        source("--report-token-file", report_token_file, REPORT_TOKEN_ENV): report_token,
        source("--read-token-file", read_token_file, READ_TOKEN_ENV): read_only_token,
    }
    for what, value in named.items():
        if value is not None and len(value) < 16:
            err_console.print(f"warning: the token of {what} is shorter than 16 characters", markup=False)
    same = [what for what, value in named.items() if value is not None and list(named.values()).count(value) > 1]
    if same:  # a token's scope is decided by which one it is
        raise InputError(f"{' and '.join(same)} hold the same token", fix="give each a value of its own")
    try:
        config = ServiceConfig.model_validate(
            {
                "host": host,
                "port": port,
                "state": ledger_url(state),
                "source": source_ref(smi, preset, cluster, live, p2p),
                "gpu": gpu,
                "profile": profile_option(profile),
                "token": token,
                "report_token": report_token,
                "read_token": read_only_token,
                "policy": policy,
                "budget_gbps": budget_gbps,
                "replica": replica,
                "open_extender": open_extender,
                "max_connections": max_connections,
                "header_timeout_s": header_timeout,
                "body_timeout_s": body_timeout,
                "keep_whole_domains": keep_whole_domains,
                "keep_whole_wait_s": keep_whole_wait,
            }
        )
    except ValidationError as exc:
        problem = first_problem(exc)
        name = problem.field or "token"
        flags = {
            "token": f"${TOKEN_ENV}",
            "report_token": f"--report-token-file (${REPORT_TOKEN_ENV})",
            "read_token": f"--read-token-file (${READ_TOKEN_ENV})",
        }
        flag = flags.get(name) or "--" + name.removesuffix("_s").replace("_", "-")
        raise InputError(f"{flag}: {problem.msg}") from exc
    run(config, log_level=log_level)


def open_file_limit(wanted: int) -> int:
    """Raise this process's soft open-file limit toward ``wanted`` (at most the hard limit); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def connection_limits(config: ServiceConfig, open_files: int) -> ConnectionLimits:
    """The guard's limits; ``max_connections`` shrunk to fit ``open_files`` less the files the state needs."""
    from toposched.service.guards import ConnectionLimits

    cap = max(8, min(config.max_connections, open_files - FD_RESERVE))
    if cap < config.max_connections:
        err_console.print(
            f"warning: the open-file limit ({open_files}) allows {cap} connections, not {config.max_connections}: "
            "raise it (ulimit -n, LimitNOFILE=) or lower --max-connections",
            markup=False,
        )
    return ConnectionLimits(
        max_connections=cap,
        header_timeout_s=config.header_timeout_s,
        body_timeout_s=config.body_timeout_s,
        max_header_bytes=config.max_header_bytes,
    )


def _check_listen(host: str, port: int) -> None:
    """``InputError`` when ``host:port`` cannot be listened on (taken, or not an address of this machine),
    before the state is opened and "serving on" is printed; uvicorn would say so only after both."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _name, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        raise InputError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc})",
            fix="choose another --port, or a --host this machine has",
        ) from None


def run(config: ServiceConfig, *, log_level: str = "warning") -> None:
    """Open the state (errors are one line), then run uvicorn until interrupted."""
    import uvicorn

    from toposched.service.app import create_app
    from toposched.service.guards import guarded_protocol
    from toposched.service.state import ServiceState

    if config.host not in ("127.0.0.1", "::1", "localhost"):
        err_console.print(f"warning: listening on {config.host}, not loopback", markup=False)
    _check_listen(config.host, config.port)
    state = ServiceState(config)
    with use_profile(config.profile):  # uvicorn's event loop (inline state work) copies this context
        try:
            state.call(state.open)
        except BaseException:
            state.worker.shutdown(wait=False)
            raise
        app = create_app(config, state)  # its lifespan closes the state
        err_console.print(f"toposched serving on http://{config.host}:{config.port} ({config.state})", markup=False)
        limits = connection_limits(config, open_file_limit(config.max_connections + FD_RESERVE))
        uvicorn.run(
            app,
            host=config.host,
            port=config.port,
            log_level=log_level,
            access_log=False,
            http=guarded_protocol(limits),
            ws="none",
            timeout_keep_alive=config.keepalive_timeout_s,
        )
