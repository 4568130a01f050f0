"""Pipeline stage boundaries balance the bytes each stage holds."""

from __future__ import annotations

import pytest

from toposched.errors import InfeasibleError
from toposched.solver.split import balanced_partition
from toposched.workload import resolve_model
from toposched.workload.memory import stage_weights
from toposched.workload.parallel import partition_ranges, stage_layers


def _stage_bytes(model: str, sizes: tuple[int, ...] | list[int], tp: int) -> list[int]:
    spec = resolve_model(model)
    out, start = [], 0
    for k, n in enumerate(sizes):
        out.append(
            stage_weights(spec, range(start, start + n), first=k == 0, last=k == len(sizes) - 1, tp=tp, ep=1).total
        )
        start += n
    return out


@pytest.mark.parametrize(("model", "pp", "tp"), [("llama-3.1-8b", 4, 1), ("deepseek-v3", 4, 8), ("qwen2.5-72b", 3, 2)])
def test_balanced_never_worse_than_vllm_default(model: str, pp: int, tp: int) -> None:
    spec = resolve_model(model)
    ours = balanced_partition(spec, pp, tp)
    default = [len(r) for r in stage_layers(spec.num_layers, pp)]
    assert sum(ours) == spec.num_layers and len(ours) == pp and min(ours) >= 1
    assert max(_stage_bytes(model, ours, tp)) <= max(_stage_bytes(model, default, tp))


def test_vocabulary_heavy_ends_get_fewer_layers() -> None:
    # Llama-3.1-8B: 128k vocabulary; embedding and lm_head each ~1 GiB at tp=1, about two layers' worth
    ours = balanced_partition(resolve_model("llama-3.1-8b"), 4, 1)
    assert ours == (7, 9, 9, 7)
    assert max(_stage_bytes("llama-3.1-8b", ours, 1)) < 0.91 * max(_stage_bytes("llama-3.1-8b", [8, 8, 8, 8], 1))


def test_partition_is_checked() -> None:
    with pytest.raises(InfeasibleError, match="summing to 32"):
        partition_ranges(32, 2, (10, 10))
    assert [len(r) for r in partition_ranges(32, 2, (12, 20))] == [12, 20]
