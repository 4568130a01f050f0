"""Every ``python3 -m sglang.launch_server`` argv of the corpus through SGLang 0.5.23's own parsing and checks.

Run by ``run.py`` under the engines venv: ``check_sglang.py CASES.json RESULTS.jsonl WORKDIR``.

What runs is SGLang's code, as ``sglang.launch_server`` runs it before it starts any process:

1. ``load_plugins()`` and ``prepare_server_args(argv)`` (``sglang/launch_server.py`` ``__main__``):
   SGLang's argparse parser built from ``ServerArgs.add_cli_args``, then ``ServerArgs.from_cli_args``;
2. ``server_args.resolve_once()`` (the first thing ``run_server`` does): the resolution pipeline that
   reads the model's ``config.json``, fills defaults from the GPU (memory fraction, attention backend,
   chunked prefill size, CUDA-graph sizes) and validates the result;
3. ``server_args.check_server_args()`` (``Engine._launch_subprocesses`` runs it before spawning):
   parallel sizes against ``--nnodes``, pipeline-parallel compatibility, and the rest.

Stubbed (each needs a GPU): ``sglang-kernel`` (``sgl_kernel``, CUDA kernels only, not installed: its
modules are stand-ins whose functions raise when called), compiled extension modules under
``sglang``, the kernel capability queries, and ``torch.cuda``'s device queries (availability, count,
capability, name, memory, SM count), answered from the case's GPU and ``CUDA_VISIBLE_DEVICES``
(``toposched_gpu_stub``). ``nvidia-smi`` is absent, so SGLang falls back to ``torch.cuda.mem_get_info``
as it does in containers without it.

A prefill/decode command's ``--disaggregation-ib-device`` goes through SGLang's own
``validate_ib_devices``, which lists ``/sys/class/infiniband``: for the case it lists the RDMA devices of
the node the command runs on (``TOPOSCHED_IB_DEVICES``, set by ``run.py``), so a device the node lacks
is refused as it would be there.

The router of a disaggregated plan (``python3 -m sglang_router.launch_router``) goes through
sglang-router 0.3.2's ``parse_router_args`` (its argparse parser and ``RouterArgs.from_cli_args``),
``_validate_router_args`` and ``Router.from_args`` (the Rust router's configuration), all that
``launch_router`` does before it starts serving.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

os.environ.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")

import case_runner
import toposched_gpu_stub  # type: ignore[import-not-found]

CASES, RESULTS = case_runner.prepare()

os.environ[toposched_gpu_stub.ENV] = "stub;9.0;0;1"
toposched_gpu_stub.install(torch_cuda=True)
from sglang.srt.arg_groups.overrides import resolving_view  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.plugins import load_plugins  # type: ignore[import-not-found]  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # type: ignore[import-not-found]  # noqa: E402

load_plugins()

IB_SYSFS = "/sys/class/infiniband"
IB_ENV = "TOPOSCHED_IB_DEVICES"
"""The RDMA devices of the case's node, comma-separated (``run.py``); unset: the machine's own sysfs."""


@contextlib.contextmanager
def infiniband(devices: str | None) -> Iterator[None]:
    """``/sys/class/infiniband`` listing ``devices`` (and every other path as it is)."""
    if not devices:
        yield
        return
    isdir, listdir = os.path.isdir, os.listdir

    def fake_isdir(path: Any) -> bool:
        return True if os.fspath(path) == IB_SYSFS else isdir(path)

    def fake_listdir(path: Any = ".") -> list[str]:
        return devices.split(",") if os.fspath(path) == IB_SYSFS else listdir(path)

    with mock.patch("os.path.isdir", fake_isdir), mock.patch("os.listdir", fake_listdir):
        yield


def check(argv: list[str]) -> dict[str, Any]:
    """``argv`` is what follows ``python3 -m sglang.launch_server``. Returns what SGLang resolved."""
    with infiniband(os.environ.get(IB_ENV)):
        server_args = prepare_server_args(argv)
        server_args.resolve_once()
        server_args.check_server_args()
    cfg = resolving_view(server_args)
    resolved = {
        "tp": cfg.tp_size,
        "pp": cfg.pp_size,
        "ep": cfg.ep_size,
        "redundant_experts": cfg.ep_num_redundant_experts if cfg.enable_eplb else 0,
        "nnodes": cfg.nnodes,
        "max_len": cfg.context_length,
        "quantization": cfg.quantization,
        "kv_dtype": cfg.kv_cache_dtype,
        "disaggregation_mode": cfg.disaggregation_mode,
        "ib_device": cfg.disaggregation_ib_device,
    }
    summary = (
        f"tp {cfg.tp_size} x pp {cfg.pp_size}, ep {cfg.ep_size}, {cfg.nnodes} node(s), dtype {cfg.dtype},"
        f" quant {cfg.quantization or 'none'}, kv {cfg.kv_cache_dtype}, mem fraction {cfg.mem_fraction_static},"
        f" context {cfg.context_length}, attention {cfg.attention_backend}"
    )
    if cfg.disaggregation_mode != "null":
        summary += f", {cfg.disaggregation_mode} over {cfg.disaggregation_ib_device}"
    return {"summary": summary, **resolved}


def check_router(argv: list[str]) -> dict[str, Any]:
    """``argv`` is what follows ``python3 -m sglang_router.launch_router``. Returns the servers it routes to."""
    from sglang_router.launch_router import parse_router_args  # type: ignore[import-not-found]
    from sglang_router.router import Router  # type: ignore[import-not-found]

    args = parse_router_args(argv)
    args._validate_router_args()
    Router.from_args(args)
    prefill = [f"{url} (bootstrap {port})" for url, port in args.prefill_urls]
    summary = f"router, pd {args.pd_disaggregation}: prefill {', '.join(prefill)}; decode {', '.join(args.decode_urls)}"
    return {
        "summary": summary,
        "pd": args.pd_disaggregation,
        "prefill": [[url, port] for url, port in args.prefill_urls],
        "decode": list(args.decode_urls),
    }


if __name__ == "__main__":
    sys.exit(
        case_runner.run(
            "sglang", CASES, RESULTS, ("python3", "-m", "sglang.launch_server"), check, ("sglang", "sglang_router"),
            others={("python3", "-m", "sglang_router.launch_router"): check_router},
        )
    )  # fmt: skip
