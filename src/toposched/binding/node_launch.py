"""What runs on one node for one placement (``NodeLaunch``), the engines it can be, the ports one plan's
launches take on each node (``PortBook``) and the names of the files a launch writes beside its script."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from toposched.errors import InputError
from toposched.names import NodeName, PlacementId

Engine = Literal["vllm", "sglang", "trtllm"]

MAX_FILE_NAME = 255
"""Longest file name (bytes) most file systems take (NAME_MAX)."""
MAX_PORT = 65535


class NodeLaunch(BaseModel):
    """What runs on one node for one placement; the placement id and node name are checked names."""

    model_config = ConfigDict(frozen=True)

    placement: PlacementId
    node: NodeName
    engine: Engine
    role: Literal["prefill", "decode", "router", "store"] | None = Field(
        default=None, description="part of a prefill/decode disaggregated deployment (None: a plain instance)"
    )
    node_rank: int
    nnodes: int
    env: dict[str, str]
    argv: list[str] = Field(description="the full command, including any numactl prefix")
    gpus: list[int] = Field(description="GPU indices on this node, in rank order")
    gpu_ids: list[str] = Field(description="what CUDA_VISIBLE_DEVICES lists (indices or UUIDs)")
    numa_nodes: list[int | None]
    port: int = Field(description="the server's --port (bound on the head node)")
    dist_port: int | None = Field(
        default=None, description="the multi-node rendezvous port (vLLM --master-port, SGLang --dist-init-addr)"
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="files the command reads, written next to its script (name -> text); the argv names them",
    )
    hosts: list[str] = Field(
        default_factory=list, description="nodes whose ranks this command starts with mpirun, in rank order"
    )
    srun_argv: list[str] | None = Field(
        default=None, description="the same ranks started by Slurm's srun (multi-node TensorRT-LLM on alike nodes)"
    )
    bootstrap_port: int | None = Field(
        default=None, description="a prefill instance's KV bootstrap server port (SGLang, vLLM's Mooncake)"
    )


def plain_file_name(stem: str, suffix: str) -> str:
    """``stem + suffix`` as one file name, hashed short past 255 bytes; ``stem`` is made of checked names."""
    name = stem + suffix
    if len(name.encode()) > MAX_FILE_NAME:
        name = f"{stem[:200]}-{hashlib.sha256(stem.encode()).hexdigest()[:12]}{suffix}"
    if name != Path(name).name or name.startswith(".") or not name.isprintable():
        raise InputError(f"file name {name[:80]!r} is not a plain file name")
    return name


class PortBook:
    """Ports taken on each node by the launches of one plan: each new port is free on all its nodes.

    A port is booked on every node of the instance that takes it, not only the head that binds it: a
    LeaderWorkerSet pod on the host network (or an engine that starts its server on another rank) then
    still finds it free.
    """

    def __init__(self) -> None:
        self._used: dict[str, set[int]] = {}

    def take(self, nodes: Sequence[str], first: int, what: str) -> int:
        port = first
        while any(port in self._used.get(n, ()) for n in nodes):
            port += 1
        if not 1 <= port <= MAX_PORT:
            raise InputError(
                f"no free {what} port from {first} to {MAX_PORT} on {', '.join(nodes[:3])}",
                fix="pass a lower --port" if what == "server" else "launch fewer instances on these nodes",
            )
        for n in nodes:
            self._used.setdefault(n, set()).add(port)
        return port
