"""Pipeline stage boundaries that balance memory (and so decode time) across stages.

vLLM splits layers evenly and puts the remainder on the stages before the last; the first stage
also holds the embedding and the last the lm_head and final norm, so with a large vocabulary the
end stages carry more bytes. Decode is memory-bound, so the bytes a stage reads per step are its
time as well: minimising the largest stage's weight bytes balances both. The partition is exact
(dynamic programming over contiguous layer ranges) and can be handed to vLLM as
``VLLM_PP_LAYER_PARTITION``.
"""

from __future__ import annotations

from functools import lru_cache

from toposched.workload.memory import stage_weights
from toposched.workload.spec import ModelSpec


@lru_cache(maxsize=256)
def balanced_partition(spec: ModelSpec, pp: int, tp: int, ep: int = 1) -> tuple[int, ...]:
    """Layers per stage minimising the largest stage's weight bytes (ties: vLLM's even split)."""
    n = spec.num_layers
    if pp <= 1:
        return (n,)
    layer = [stage_weights(spec, range(i, i + 1), first=False, last=False, tp=tp, ep=ep).total for i in range(n)]
    head = stage_weights(spec, range(0, 0), first=True, last=False, tp=tp, ep=ep).total
    tail = stage_weights(spec, range(0, 0), first=False, last=True, tp=tp, ep=ep).total
    prefix = [0]
    for b in layer:
        prefix.append(prefix[-1] + b)

    def cost(start: int, end: int, stage: int) -> int:
        extra = (head if stage == 0 else 0) + (tail if stage == pp - 1 else 0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[s][i]: smallest possible max-stage-cost placing layers [0, i) on stages [0, s)
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for s in range(1, pp + 1):
        for i in range(s, n - (pp - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                value = max(best[s - 1][j], cost(j, i, s - 1))
                # prefer later cuts on ties, so earlier stages take the remainder as vLLM does
                if value < best[s][i] or (value == best[s][i] and j > cut[s][i]):
                    best[s][i], cut[s][i] = value, j
    sizes: list[int] = []
    i = n
    for s in range(pp, 0, -1):
        j = cut[s][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))
