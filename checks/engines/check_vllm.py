"""Every ``vllm serve`` argv of the corpus through vLLM 0.33.0's own parser and config validation.

Run by ``run.py`` under the engines venv: ``check_vllm.py CASES.json RESULTS.jsonl WORKDIR``.

What runs is vLLM's code, as ``vllm serve ARGS`` runs it up to the point where it would bind its port
and start worker processes:

1. the ``vllm`` CLI's top-level parser with the ``serve`` subcommand (``FlexibleArgumentParser``,
   ``ServeSubcommand.subparser_init`` -> ``make_arg_parser``), parsing ``serve ARGS``;
2. ``ServeSubcommand.validate`` (``validate_parsed_serve_args``);
3. ``ServeSubcommand.cmd`` itself, which picks the mode (API server, headless worker, several API
   servers) and checks the mode's flags; the functions it would then call (``run_server``,
   ``run_headless``, ``run_multi_api_server``, ``run_dp_supervisor``) are replaced by recorders;
4. what that mode does before starting anything: ``validate_api_server_args`` for an API server, then
   ``AsyncEngineArgs.from_cli_args(args).create_engine_config(...)``, which builds and validates
   every config (model config from the model's ``config.json``, ``--max-model-len`` against the
   model's context, quantization against the GPU's compute capability, dtype support, parallel
   config against the device count and ``--nnodes``, executor backend, cache dtype...);
   for a headless worker, ``run_headless``'s own checks on the result. A prefill/decode instance's
   ``--kv-transfer-config`` JSON is parsed and validated there as ``KVTransferConfig`` (connector,
   ``kv_role``); what it resolved (connector, role, ``device_name``) is returned for ``run.py`` to
   compare with the plan.

Stubbed (each needs a GPU): vLLM's compiled CUDA extensions and the capability queries they answer,
and the device queries of the CUDA platform (``toposched_gpu_stub``, installed in the engines venv and
loaded through vLLM's ``vllm.platform_plugins`` entry point). The platform is vLLM's own
``NonNvmlCudaPlatform`` with only capability, name, memory, device count and NVLink answered from the
case's GPU and ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import case_runner
import toposched_gpu_stub  # type: ignore[import-not-found]

CASES, RESULTS = case_runner.prepare()

os.environ[toposched_gpu_stub.ENV] = "stub;9.0;0;1"  # the platform plug-in resolves at first import
import vllm.entrypoints.cli.serve as serve  # type: ignore[import-not-found]  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # type: ignore[import-not-found]  # noqa: E402
from vllm.entrypoints.common.cli_args import (  # type: ignore[import-not-found]  # noqa: E402
    propagate_flash_late_interaction,
    validate_api_server_args,
)
from vllm.platforms import current_platform  # type: ignore[import-not-found]  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # type: ignore[import-not-found]  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]  # noqa: E402

if type(current_platform).__name__ != "StubCudaPlatform":
    sys.exit(
        f"vLLM chose the platform {type(current_platform).__name__}, not the GPU stub: is toposched-gpu-stub installed?"
    )

# The MooncakeConnector's module (which vLLM imports to validate a --kv-transfer-config) imports vLLM's
# Mamba kernels, which filter their Triton autotune configs at import time when the GPU is sm90. Here
# Triton is vLLM's placeholder (no GPU, CPU torch), whose configs have no fields, so that import fails
# under an H100 stub though it works wherever Triton is installed. Import it once under another
# capability; the module is then cached and nothing in it depends on the case's GPU.
with case_runner.case_env({}, "stub;8.0;0;1"):
    case_runner.clear_caches(("vllm",))
    importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")
case_runner.clear_caches(("vllm",))

_modes: list[str] = []


def _recorder(mode: str) -> Any:
    def record(args: argparse.Namespace) -> None:
        _modes.append(mode)

    return record


async def _api_server(args: argparse.Namespace, **kwargs: Any) -> None:
    _modes.append("api")


serve.run_headless = _recorder("headless")
serve.run_multi_api_server = _recorder("api-servers")
serve.run_dp_supervisor = _recorder("dp-supervisor")
serve.run_server = _api_server

_parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
_subparsers = _parser.add_subparsers(required=False, dest="subparser")
_serve = serve.ServeSubcommand()
_serve.subparser_init(_subparsers).set_defaults(dispatch_function=_serve.cmd)


def check(argv: list[str]) -> dict[str, Any]:
    """``argv`` is what follows ``vllm``: ``serve MODEL --flag ...``. Returns what vLLM resolved."""
    args = _parser.parse_args(argv)
    if args.subparser != "serve":
        raise ValueError(f"not a `vllm serve` command: {argv[:1]}")
    _serve.validate(args)
    _modes.clear()
    _serve.cmd(args)
    (mode,) = _modes
    engine_args = AsyncEngineArgs.from_cli_args(args)
    propagate_flash_late_interaction(args, engine_args)
    if mode in ("api", "api-servers"):
        validate_api_server_args(args)
    config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=mode == "headless")
    parallel, model, cache = config.parallel_config, config.model_config, config.cache_config
    kv = config.kv_transfer_config  # None, or the validated KVTransferConfig of a prefill/decode instance
    if mode == "headless" and parallel.data_parallel_size_local <= 0:
        raise ValueError("data_parallel_size_local must be > 0 in headless mode")
    resolved = {
        "tp": parallel.tensor_parallel_size,
        "pp": parallel.pipeline_parallel_size,
        "ep": parallel.enable_expert_parallel,
        "redundant_experts": parallel.eplb_config.num_redundant_experts if parallel.enable_eplb else 0,
        "nnodes": parallel.nnodes,
        "max_len": model.max_model_len,
        "quantization": model.quantization,
        "kv_dtype": cache.cache_dtype,
        "kv_connector": kv.kv_connector if kv is not None else None,
        "kv_role": kv.kv_role if kv is not None else None,
        "kv_devices": _kv_devices(kv),
    }
    summary = (
        f"{mode}: tp {resolved['tp']} x pp {resolved['pp']} ({parallel.distributed_executor_backend},"
        f" {parallel.nnodes} node(s)), {model.dtype}, quant {model.quantization or 'none'},"
        f" kv {cache.cache_dtype}, max len {model.max_model_len}"
        + (f", {kv.kv_connector} {kv.kv_role}" if kv is not None and kv.kv_connector else "")
    )
    return {"summary": summary, **resolved}


def _kv_devices(kv: Any) -> str:
    """The ``device_name`` the KV transfer uses: the config's own, or, under ``MultiConnector``, that of the
    connector among ``kv_connector_extra_config["connectors"]`` that names one (the P2P MooncakeConnector)."""
    if kv is None:
        return ""
    if kv.kv_connector != "MultiConnector":
        return str(kv.get_from_extra_config("device_name", ""))
    for child in kv.get_from_extra_config("connectors", []) or []:
        name = (child.get("kv_connector_extra_config") or {}).get("device_name")
        if name:
            return str(name)
    return ""


if __name__ == "__main__":
    sys.exit(case_runner.run("vllm", CASES, RESULTS, ("vllm",), check, ("vllm",)))
