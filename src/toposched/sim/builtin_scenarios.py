"""The built-in scenarios, by name (``SCENARIOS``; ``sim/loading.py`` looks names up).

* ``seed-256`` — seed 000's setting: 32 x HGX H100 (256 GPUs) over 8 x 400G InfiniBand; an FP8
  175B-class dense model (``data/scenarios/dense-175b-class.json``: GPT-3 175B's shape); 4,096
  requests of sequence length 2,048 (1,024 in, 1,024 out); instances with batch 32; per-token SLO
  100 ms; Poisson arrivals at 36 requests/s (unchanged since before issue 15).
* ``small`` — 4 HGX H100 nodes, Llama-3.1-70B, 400 requests: for tests and quick looks.
* ``large-16k`` — 2,048 HGX H100 nodes (16,384 GPUs), Llama-3.1-70B, 100,000 requests: the
  performance scenario.
* ``churn-128`` — issue 15's busy cluster: 16 x HGX H100, tenants of TP 1/2/4/8 (weights 4:3:2:1),
  exponential lifetimes (mean 300 s), requests at 70 % of each instance's in-domain capacity, three
  GPU failures, SLO = 1.25 x the in-domain per-token latency, offered occupancy 0.85.
* ``churn-mixed`` — churn-128's tenants and churn on a cluster of three generations (issue 35):
  9 GB200 trays in one NVLink domain, 6 x HGX H100 and 4 x 8 L40S PCIe (116 GPUs, preset
  ``mixed-gb200-h100-l40s``), a GPU failure on each kind.
* ``churn-tiny`` — a two-node churn scenario for tests.
* ``pd-256`` — issue 20's disaggregated deployment on the 256-GPU preset: Llama-3.1-70B, 32 prefill
  and 32 decode instances of TP 4, each request's KV moved from its prefill to a decode instance
  (``perf/kv_transfer.py``), run once per layout of decode (and store) against prefill: same-server,
  rack-local, spread (``Pd``).
* ``pd-tiny`` — the same with Llama-3.1-8B at TP 2 on 16 HGX H100 nodes (two racks), for tests.
"""

from __future__ import annotations

from importlib import resources

from toposched.registry import Registry
from toposched.sim.scenario import PD_LAYOUTS, Arrivals, Churn, Failure, Lengths, Pd, Scenario, Tenant


def _dense_175b() -> str:
    return str(resources.files("toposched") / "data" / "scenarios" / "dense-175b-class.json")


SCENARIOS: Registry[Scenario] = Registry("scenario")
SCENARIOS.register(
    "seed-256",
    Scenario(
        name="seed-256",
        cluster="cluster-32x-hgx-h100",
        model=_dense_175b(),
        weight_dtype="fp8",
        requests=4096,
        arrivals=Arrivals(rate_per_s=36.0),
        input_len=Lengths(mean=1024),
        output_len=Lengths(mean=1024),
        slo_ms=100.0,
        batch=32,
    ),
)
SCENARIOS.register(
    "small",
    Scenario(
        name="small",
        cluster="4xhgx-h100",
        model="llama-3.1-70b",
        requests=400,
        arrivals=Arrivals(rate_per_s=20.0),
        input_len=Lengths(mean=512, dist="uniform"),
        output_len=Lengths(mean=128, dist="uniform"),
        slo_ms=60.0,
        slo_mix={"interactive": 0.7, "batch": 0.3},
        batch=16,
        failures=(Failure(at_s=5.0, gpu="hgx-h100-1/3"),),
    ),
)
SCENARIOS.register(
    "large-16k",
    Scenario(
        name="large-16k",
        cluster="2048xhgx-h100",
        model="llama-3.1-70b",
        requests=100_000,
        arrivals=Arrivals(rate_per_s=2000.0),
        input_len=Lengths(mean=512),
        output_len=Lengths(mean=128),
        slo_ms=30.0,
        batch=32,
    ),
)

# Request lengths of the churn scenarios: lognormal (sigma 0.6) around 1,024 prompt and 256 output
# tokens, clipped at 4x the mean. Our choice, of the order of chat workloads; not a measured trace.
_CHAT_IN = Lengths(dist="lognormal", mean=1024, sigma=0.6)
_CHAT_OUT = Lengths(dist="lognormal", mean=256, sigma=0.6)
_CHURN_TENANTS = (
    # TP 1/2/4/8 with weights 4:3:2:1 (issue 15); each model needs exactly that degree on H100 80 GB
    # for batch 32 at this context: 8B BF16 fits one GPU, 70B FP8 two, 70B BF16 four, 405B FP8 eight.
    Tenant(name="llama8b-tp1", model="llama-3.1-8b", tp=1, batch=32, weight=4, slo_factor=1.25,
           input_len=_CHAT_IN, output_len=_CHAT_OUT),
    Tenant(name="llama70b-fp8-tp2", model="llama-3.1-70b", weight_dtype="fp8", tp=2, batch=32, weight=3,
           slo_factor=1.25, input_len=_CHAT_IN, output_len=_CHAT_OUT),
    Tenant(name="llama70b-tp4", model="llama-3.1-70b", tp=4, batch=32, weight=2, slo_factor=1.25,
           input_len=_CHAT_IN, output_len=_CHAT_OUT),
    Tenant(name="llama405b-fp8-tp8", model="llama-3.1-405b", weight_dtype="fp8", tp=8, batch=32, weight=1,
           slo_factor=1.25, input_len=_CHAT_IN, output_len=_CHAT_OUT),
)  # fmt: skip
SCENARIOS.register(
    "churn-128",
    Scenario(
        name="churn-128",
        cluster="16xhgx-h100",
        tenants=_CHURN_TENANTS,
        # five mean lifetimes: long enough for fragmentation to settle, short enough for ~20 s per run
        churn=Churn(occupancy=0.85, duration_s=1500.0, mean_lifetime_s=300.0, load=0.7),
        # vLLM loads a checkpoint and captures CUDA graphs before serving; 30 s is our assumption
        # for a warm node (weights in the page cache), not a measurement.
        instance_startup_s=30.0,
        failures=(
            Failure(at_s=375.0, gpu="hgx-h100-03/5"),
            Failure(at_s=750.0, gpu="hgx-h100-08/2"),
            Failure(at_s=1125.0, gpu="hgx-h100-13/7"),
        ),
    ),
)
SCENARIOS.register(
    "churn-mixed",  # churn-128's tenants, churn and start-up on three GPU generations, a failure on each kind
    SCENARIOS.get("churn-128").model_copy(
        update={
            "name": "churn-mixed",
            "cluster": "mixed-gb200-h100-l40s",
            "failures": (
                Failure(at_s=375.0, gpu="gb200-tray04/1"),
                Failure(at_s=750.0, gpu="h100-2/5"),
                Failure(at_s=1125.0, gpu="l40s-1/3"),
            ),
        }
    ),
)
SCENARIOS.register(
    "churn-tiny",
    Scenario(
        name="churn-tiny",
        cluster="2xhgx-h100",
        tenants=(
            Tenant(name="small-tp1", model="llama-3.1-8b", tp=1, batch=8, weight=3, slo_factor=1.25,
                   input_len=Lengths(dist="uniform", mean=256), output_len=Lengths(dist="uniform", mean=32)),
            Tenant(name="big-tp4", model="llama-3.1-70b", tp=4, batch=8, weight=1, slo_factor=1.25,
                   slo_class="standard", input_len=Lengths(dist="uniform", mean=256),
                   output_len=Lengths(dist="uniform", mean=32)),
        ),
        churn=Churn(occupancy=0.85, duration_s=120.0, mean_lifetime_s=30.0, load=0.7),
        instance_startup_s=2.0,
        failures=(Failure(at_s=40.0, gpu="hgx-h100-1/3"),),
    ),
)  # fmt: skip


# Issue 20's disaggregated deployment. Llama-3.1-70B BF16 at TP 4 on HGX H100: one prefill and one
# decode instance per node, so every layout holds the same instances (same-server needs both on a
# node). Requests at about 70 % of the 32 decode instances' capacity (batch 32, 256 output tokens:
# ~6.5 requests/s each by the cost model), chat lengths as churn-128's.
SCENARIOS.register(
    "pd-256",
    Scenario(
        name="pd-256",
        cluster="cluster-32x-hgx-h100",
        model="llama-3.1-70b",
        requests=4096,
        arrivals=Arrivals(rate_per_s=145.0),
        input_len=_CHAT_IN,
        output_len=_CHAT_OUT,
        slo_ms=100.0,
        batch=32,
        pd=Pd(prefill=32, decode=32, prefill_tp=4, decode_tp=4, layouts=PD_LAYOUTS),
    ),
)
SCENARIOS.register(
    "pd-tiny",
    Scenario(
        name="pd-tiny",
        cluster="16xhgx-h100",
        model="llama-3.1-8b",
        requests=300,
        arrivals=Arrivals(rate_per_s=40.0),
        input_len=Lengths(dist="uniform", mean=1024),
        output_len=Lengths(dist="uniform", mean=64),
        slo_ms=100.0,
        batch=16,
        pd=Pd(prefill=4, decode=4, prefill_tp=2, decode_tp=2, layouts=PD_LAYOUTS),
    ),
)
