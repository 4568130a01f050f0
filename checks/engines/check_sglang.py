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
"""

from __future__ import annotations

import os
import sys
from typing import Any

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


def check(argv: list[str]) -> dict[str, Any]:
    """``argv`` is what follows ``python3 -m sglang.launch_server``. Returns what SGLang resolved."""
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
    }
    summary = (
        f"tp {cfg.tp_size} x pp {cfg.pp_size}, ep {cfg.ep_size}, {cfg.nnodes} node(s), dtype {cfg.dtype},"
        f" quant {cfg.quantization or 'none'}, kv {cfg.kv_cache_dtype}, mem fraction {cfg.mem_fraction_static},"
        f" context {cfg.context_length}, attention {cfg.attention_backend}"
    )
    return {"summary": summary, **resolved}


if __name__ == "__main__":
    sys.exit(case_runner.run("sglang", CASES, RESULTS, ("python3", "-m", "sglang.launch_server"), check, ("sglang",)))
