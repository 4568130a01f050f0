"""Link table: all-reduce and point-to-point cost between GPUs over each kind of link.

Keys (use them with ``--link`` and ``predict_latency(link=...)``):

    nvlink3        A100 NVSwitch box (HGX A100)
    nvlink4        H100/H200 NVSwitch box (HGX H100/H200)
    nvlink5        B200 NVSwitch box (HGX B200)
    mnnvl          multi-node NVLink (GB200 NVL72); no measured table: nvlink5 figures
    nvlink-bridge  two PCIe GPUs joined by an NVLink bridge (2 GPUs at most)
    pcie4, pcie5   GPUs that talk over PCIe only (L40S box; RTX PRO 6000 Blackwell box), P2P on
    pcie4-nop2p    PCIe Gen4 with peer-to-peer off or across CPU sockets (the AIC L40S table)
    ib-hdr, ib-ndr, ib-xdr, roce-400, tcp-100   between nodes, one NIC per GPU

``two_level_link(inter, intra, gpus_per_node)`` joins the two for a TP group that spans nodes.
``pcie_link(native, peer_to_peer=...)`` picks the PCIe table of a TP group on one PCIe-only node:
the GPU's own (P2P on) unless a pair of the group cannot talk peer to peer (reported refused by
``nvidia-smi topo -p2p``, or across CPU sockets: ``topology.model.Node.peer_to_peer``).

All-reduce: for the kinds with measured data (reference/data/aiconfigurator_allreduce.csv, 16-bit
rows) the measured curve itself, interpolated in log size (``allreduce.Curve``; the tables are in
``allreduce_tables.py``; beyond the largest measured size the last doubling's bandwidth); the
other kinds use their alpha-beta constants ``alpha_us + S*2(n-1)/n / busbw`` per group size n.
``benchmarks/allreduce_fit.py`` refits the constants (weighted least squares), prints the errors
and rewrites the tables. Where a custom all-reduce table exists (vLLM / TRT-LLM with CUDA graphs,
what TP decode really uses) the cost is the faster of custom and NCCL, as engines switch to NCCL for
large messages; ``custom_max_group`` bounds the group sizes it runs on (vLLM 0.33.0 and SGLang turn
it off on more than two PCIe-only GPUs; vLLM also without P2P). Group sizes between measured ones
are interpolated linearly in n; beyond the largest, the alpha-beta fit's growth is added (alpha
grows with (n - 1), the ring steps; busbw stays).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache

from toposched.errors import InfeasibleError, InputError
from toposched.perf.allreduce import AlphaBeta, Curve
from toposched.perf.allreduce_tables import MEASURED
from toposched.registry import Registry


@dataclass(frozen=True)
class LinkSpec:
    """Costs of one link kind."""

    name: str
    description: str
    nccl: dict[int, AlphaBeta]  # all-reduce fits by group size
    custom: dict[int, AlphaBeta] = field(default_factory=dict)  # custom all-reduce (CUDA graphs)
    nccl_measured: dict[int, Curve] = field(default_factory=dict)  # measured curves of ``nccl``'s series
    custom_measured: dict[int, Curve] = field(default_factory=dict)  # measured curves of ``custom``'s
    custom_max_group: int | None = None  # largest group the custom all-reduce runs on (None: any)
    p2p_alpha_us: float = 10.0  # AIC p2p_latency 10 µs (perf-anchors §0)
    p2p_bandwidth_gbps: float = 50.0
    max_group: int | None = None
    source: str = ""
    intra: LinkSpec | None = None  # two-level: the link inside each node (``two_level_link``)
    gpus_per_node: int = 0
    switch_reduction: bool = False
    """NVLink SHARP (NVLS): the NVSwitch reduces in the switch (third-generation NVSwitch, H100 on),
    which lets NCCL pipeline a node's reduction with the network stage of a multi-node all-reduce."""

    def allreduce_us(self, nbytes: float, n: int) -> float:
        """Time of one all-reduce of ``nbytes`` across ``n`` GPUs joined by this link."""
        if n <= 1:
            return 0.0
        if self.max_group is not None and n > self.max_group:
            raise InfeasibleError(f"link {self.name!r} joins at most {self.max_group} GPUs, not {n}")
        if self.intra is not None:
            return self._two_level_us(self.intra, nbytes, n)
        return self._flat_us(nbytes, n)

    def _two_level_us(self, intra: LinkSpec, nbytes: float, n: int) -> float:
        """NCCL across nodes: reduce inside each node over ``intra``, all-reduce ``1/g`` of the message
        per NIC across the nodes, broadcast inside the node. With in-switch reduction (NVLS trees) the
        node and network stages are pipelined, so the slower one sets the pace and the faster adds
        its latency (its time for one byte); without it they add."""
        g = min(n, self.gpus_per_node)
        if g == n:
            return intra.allreduce_us(nbytes, n)
        nodes = -(-n // g)
        # NCCL runs both levels (an engine's custom all-reduce does not span nodes)
        local, across = intra._nccl_us(nbytes, g), self._flat_us(nbytes / g, nodes)
        if not intra.switch_reduction:
            return local + across
        fill = intra._nccl_us(1, g) if local < across else self._flat_us(1, nodes)
        return max(local, across) + fill

    def _nccl_us(self, nbytes: float, n: int) -> float:
        return _time(self.nccl, self.nccl_measured, nbytes, n)

    def _flat_us(self, nbytes: float, n: int) -> float:
        best = self._nccl_us(nbytes, n)
        if self.custom and (self.custom_max_group is None or n <= self.custom_max_group):
            best = min(best, _time(self.custom, self.custom_measured, nbytes, n))
        return best

    def p2p_us(self, nbytes: float) -> float:
        """Time to hand ``nbytes`` of activations from one pipeline stage to the next."""
        return self.p2p_alpha_us + nbytes / (self.p2p_bandwidth_gbps * 1e3)


def _at(table: dict[int, AlphaBeta], n: int) -> AlphaBeta:
    if n in table:
        return table[n]
    sizes = sorted(table)
    if n > sizes[-1]:
        top = table[sizes[-1]]
        return AlphaBeta(top.alpha_us * (n - 1) / (sizes[-1] - 1), top.busbw_gbps)
    if n < sizes[0]:
        return table[sizes[0]]
    lo = max(s for s in sizes if s < n)
    hi = min(s for s in sizes if s > n)
    w = (n - lo) / (hi - lo)
    a, b = table[lo], table[hi]
    return AlphaBeta(a.alpha_us + w * (b.alpha_us - a.alpha_us), a.busbw_gbps + w * (b.busbw_gbps - a.busbw_gbps))


def _time(fits: dict[int, AlphaBeta], curves: dict[int, Curve], nbytes: float, n: int) -> float:
    """All-reduce time from the measured curves where there are some, else from the alpha-beta fits."""
    if not curves:
        return _at(fits, n).time_us(nbytes, n)
    if n in curves:
        return curves[n].time_us(nbytes, n)
    sizes = sorted(curves)
    if n < sizes[0]:
        return curves[sizes[0]].time_us(nbytes, n)
    if n > sizes[-1]:
        top = sizes[-1]
        grow = _at(fits, n).time_us(nbytes, n) - fits[top].time_us(nbytes, top)
        return curves[top].time_us(nbytes, top) + grow
    lo = max(s for s in sizes if s < n)
    hi = min(s for s in sizes if s > n)
    w = (n - lo) / (hi - lo)
    t_lo, t_hi = curves[lo].time_us(nbytes, lo), curves[hi].time_us(nbytes, hi)
    return t_lo + w * (t_hi - t_lo)


def _ab(*rows: tuple[int, float, float]) -> dict[int, AlphaBeta]:
    return {n: AlphaBeta(alpha, bw) for n, alpha, bw in rows}


def _flat(alpha_us: float, busbw_gbps: float) -> dict[int, AlphaBeta]:
    """Inter-node links: one NIC per GPU, so the ring's bottleneck is the NIC whatever n is."""
    return {2: AlphaBeta(alpha_us, busbw_gbps)}


# Fitted by benchmarks/allreduce_fit.py (series name from the CSV's source column); (n, alpha µs, busbw GB/s).
_A100_NCCL = _ab((2, 11.73, 161.24), (4, 15.81, 182.42), (8, 23.82, 189.51))  # a100_sxm_comm_nccl_2.27.3
_A100_CUSTOM = _ab((2, 4.99, 177.98), (4, 5.68, 183.26), (8, 6.68, 187.35))  # car_a100 vllm_graph
_H100_NCCL = _ab((2, 7.07, 262.47), (4, 10.60, 306.65), (8, 17.37, 373.81))  # h100_sxm_comm_nccl_2.27.3
_H100_CUSTOM = _ab((2, 4.31, 278.65), (4, 4.87, 304.90), (8, 5.22, 378.13))  # car_h100 vllm_graph
_B200_NCCL = _ab((2, 10.25, 471.08), (4, 15.83, 556.47), (8, 27.55, 583.53))  # b200_sxm_comm_nccl_2.27.3
_L40S_NCCL = _ab((2, 6.97, 18.65), (4, 11.49, 5.14), (8, 22.61, 1.57))  # l40s_comm_nccl_2.27.3
_L40S_CUSTOM = _ab((2, 5.31, 19.13), (4, 12.55, 3.86), (8, 22.43, 2.19))  # car_l40s vllm_graph
_RTXPRO_NCCL = _ab((2, 6.79, 34.65), (4, 13.64, 24.52), (8, 26.91, 22.09))  # rtx_pro_6000_server nccl
# L40S with P2P on. The AIC L40S series falls from 18.65 GB/s busbw at n=2 to 5.1 / 1.6 at n=4 / 8,
# the signature of P2P off or traffic across CPU sockets (perf-anchors §1.3). No measured P2P-on
# L40S table exists in reference/, so n=4 / 8 keep the L40S n=2 fit scaled by the PCIe Gen5 box's
# busbw ratio to its n=2 (24.52 / 34.65, 22.09 / 34.65): a PCIe-switch ring loses that much with n.
# Alphas are the L40S fit's (small messages do not depend on P2P). [D]
# Custom all-reduce on PCIe-only GPUs: vLLM 0.33.0 (distributed/device_communicators/custom_all_reduce.py)
# disables it "on more than two PCIe-only GPUs" and when "your platform lacks GPU P2P capability", so
# the P2P-on table has the measured vLLM n=2 curve and the P2P-off table none.
_L40S_P2P_NCCL = _ab(
    (2, 6.97, 18.65), (4, 11.49, round(18.65 * 24.52 / 34.65, 2)), (8, 22.61, round(18.65 * 22.09 / 34.65, 2))
)  # fmt: skip

# Which CSV series each fitted table came from (checked by tests/perf/test_allreduce.py).
FITTED_SERIES: dict[str, dict[int, AlphaBeta]] = {
    "a100_sxm_comm_nccl_2.27.3": _A100_NCCL,
    "car_a100_sxm_comm_vllm_0.14.0:vllm_graph": _A100_CUSTOM,
    "h100_sxm_comm_nccl_2.27.3": _H100_NCCL,
    "car_h100_sxm_comm_vllm_0.19.0:vllm_graph": _H100_CUSTOM,
    "b200_sxm_comm_nccl_2.27.3": _B200_NCCL,
    "l40s_comm_nccl_2.27.3": _L40S_NCCL,
    "car_l40s_comm_vllm_0.22.0:vllm_graph": _L40S_CUSTOM,
    "rtx_pro_6000_server_comm_nccl_2.29.2": _RTXPRO_NCCL,
}

LINKS_TABLE: tuple[LinkSpec, ...] = (
    LinkSpec(
        "nvlink3", "A100 NVSwitch (NVLink 3)", _A100_NCCL, _A100_CUSTOM,
        MEASURED["a100_sxm_comm_nccl_2.27.3"], MEASURED["car_a100_sxm_comm_vllm_0.14.0:vllm_graph"],
        p2p_bandwidth_gbps=264.0,  # 88 % of 300 GB/s (STAS pairwise copy efficiency, perf-anchors §2)
        source="AIC a100_sxm nccl + vLLM 0.14 custom AR (fit)",
    ),
    LinkSpec(
        "nvlink4", "H100/H200 NVSwitch (NVLink 4)", _H100_NCCL, _H100_CUSTOM,
        MEASURED["h100_sxm_comm_nccl_2.27.3"], MEASURED["car_h100_sxm_comm_vllm_0.19.0:vllm_graph"],
        p2p_bandwidth_gbps=396.0,  # 8x H200 pairwise copy 396.40 GB/s uni (perf-anchors §2)
        switch_reduction=True,
        source="AIC h100_sxm nccl + vLLM 0.19 custom AR (fit)",
    ),
    LinkSpec(
        "nvlink5", "B200 NVSwitch (NVLink 5)", _B200_NCCL, nccl_measured=MEASURED["b200_sxm_comm_nccl_2.27.3"],
        p2p_bandwidth_gbps=792.0,  # 88 % of 900 GB/s (STAS efficiency, perf-anchors §2)
        switch_reduction=True,
        source="AIC b200_sxm nccl (fit); no custom AR table",
    ),
    LinkSpec(
        "mnnvl", "multi-node NVLink (GB200 NVL72)", _B200_NCCL, nccl_measured=MEASURED["b200_sxm_comm_nccl_2.27.3"],
        p2p_bandwidth_gbps=792.0, switch_reduction=True,
        source="no measured table: nvlink5 figures (assumption)",
    ),
    LinkSpec(
        "nvlink-bridge", "2 PCIe GPUs with an NVLink bridge",
        _ab((2, 6.79, 115.4)),  # busbw 115.4 GB/s, 2x H100 PCIe bridge (perf-anchors §1.4);
        # alpha: the PCIe Gen5 box's n=2 fit (no small-message data for the bridge)
        p2p_bandwidth_gbps=115.4, max_group=2,
        source="nccl-tests #194 busbw; alpha from pcie5 n=2",
    ),
    LinkSpec(
        "pcie4", "PCIe Gen4 only, P2P on (L40S box)", _L40S_P2P_NCCL, {2: _L40S_CUSTOM[2]},
        nccl_measured={2: MEASURED["l40s_comm_nccl_2.27.3"][2]},  # n=2 measured; n=4/8 add the [D] fits' growth
        custom_measured={2: MEASURED["car_l40s_comm_vllm_0.22.0:vllm_graph"][2]},
        custom_max_group=2,
        p2p_bandwidth_gbps=27.0,  # 88 % of Gen4 x16 31 GB/s (perf-anchors §2)
        source="AIC l40s nccl n=2 + vLLM custom AR n=2 (fit); n=4/8 scaled by the PCIe Gen5 box's busbw ratios [D]",
    ),
    LinkSpec(
        "pcie4-nop2p", "PCIe Gen4 only, P2P off or across sockets", _L40S_NCCL,
        nccl_measured=MEASURED["l40s_comm_nccl_2.27.3"],
        p2p_bandwidth_gbps=27.0,
        source="AIC l40s nccl (fit); 4/8-GPU data show P2P off (perf-anchors §1.3); its n=2 is the P2P-on pair's",
    ),
    LinkSpec(
        "pcie5", "PCIe Gen5 only (RTX PRO 6000 box)", _RTXPRO_NCCL,
        nccl_measured=MEASURED["rtx_pro_6000_server_comm_nccl_2.29.2"],
        p2p_bandwidth_gbps=55.4,  # Gen5 x16 measured 55.43 GB/s on H200 (perf-anchors §2)
        source="AIC rtx_pro_6000_server nccl (fit)",
    ),
    LinkSpec(
        "ib-hdr", "InfiniBand HDR 200 Gb/s, one NIC per GPU",
        _flat(20.0, 24.0),  # 24 GB/s per 200G NIC (sjeaugey, perf-anchors §1.5); alpha 20-50 µs (§3.3)
        p2p_alpha_us=17.0, p2p_bandwidth_gbps=24.0,
        source="perf-anchors §1.5, §3.3",
    ),
    LinkSpec(
        "ib-ndr", "InfiniBand NDR 400 Gb/s, one NIC per GPU",
        _flat(20.0, 47.0),  # "46-48GB/s per NIC" (AddyLaddy, perf-anchors §1.5); alpha 20-50 µs (§3.3)
        p2p_alpha_us=17.0,  # Vidur H100 cross-node send/recv 17 µs @2 KiB (perf-anchors §1.5)
        p2p_bandwidth_gbps=36.0,  # Vidur cross-node send/recv 36 GB/s @64 MiB (perf-anchors §1.5)
        source="perf-anchors §1.5, §3.3",
    ),
    LinkSpec(
        "ib-xdr", "InfiniBand XDR 800 Gb/s, one NIC per GPU",
        _flat(20.0, 94.0),  # 2x NDR's 47 GB/s: XDR is 100 GB/s per port vs NDR 50 (perf-anchors §2) [D]
        p2p_alpha_us=17.0, p2p_bandwidth_gbps=72.0,
        source="perf-anchors §2 port speeds, NDR efficiency carried over [D]",
    ),
    LinkSpec(
        "roce-400", "RoCEv2 400 Gb/s, one NIC per GPU (tuned)",
        _flat(20.0, 45.0),  # "treat like IB at about 90 % of wire": 0.9 x 50 GB/s (perf-anchors §1.5)
        p2p_alpha_us=17.0, p2p_bandwidth_gbps=32.0,
        source="perf-anchors §1.5 suggested default",
    ),
    LinkSpec(
        "tcp-100", "TCP sockets over 100 GbE",
        _flat(50.0, 5.2),  # busbw 5.21 GB/s best case (nccl #450, perf-anchors §1.5); alpha: top of §3.3
        p2p_alpha_us=50.0, p2p_bandwidth_gbps=5.2,
        source="perf-anchors §1.5 (nccl #450)",
    ),
)  # fmt: skip


@cache
def two_level_link(inter: str, intra: str, gpus_per_node: int) -> LinkSpec:
    """A TP group spanning nodes: ``gpus_per_node`` GPUs per node joined by ``intra``, the nodes by
    ``inter`` (one NIC per GPU). Its all-reduce is the two-level one of ``LinkSpec._two_level_us``;
    stage-to-stage hand-offs cross ``inter``."""
    if gpus_per_node < 1:
        raise InputError(f"gpus_per_node must be positive, got {gpus_per_node}")
    outer, inner = get_link(inter), get_link(intra)
    return replace(
        outer, name=f"{outer.name}+{inner.name}x{gpus_per_node}", intra=inner, gpus_per_node=gpus_per_node,
        description=f"{outer.description}; {gpus_per_node} GPUs per node over {inner.description}",
    )  # fmt: skip


NO_P2P_LINK = "pcie4-nop2p"
"""The only measured P2P-off table; a PCIe Gen5 group without P2P is costed with it too (no Gen5
P2P-off data: an upper bound on its time [D])."""


def pcie_link(native_link: str, *, peer_to_peer: bool) -> str:
    """The link-table key of a TP group on one PCIe-only node: the GPU's own PCIe table (``pcie4``,
    ``pcie5``: P2P on) when every pair of the group talks peer to peer, else :data:`NO_P2P_LINK`."""
    return native_link if peer_to_peer else NO_P2P_LINK


@cache
def link_registry() -> Registry[LinkSpec]:
    """The link table as a registry."""
    reg: Registry[LinkSpec] = Registry("link kind")
    for link in LINKS_TABLE:
        reg.register(link.name, link)
    return reg


def get_link(name: str) -> LinkSpec:
    """The link kind named ``name`` (``UnknownNameError`` with suggestions otherwise).

    ``INTER+INTRAxN`` (the name ``two_level_link`` gives, e.g. ``ib-ndr+nvlink4x4``) is a TP group of
    N GPUs per node over INTRA, the nodes joined by INTER: the solver's key for a TP group that spans
    nodes in equal shares, so every cache keyed by link name tells it apart from a flat ring.
    """
    if "+" in name:
        inter, _, rest = name.partition("+")
        intra, sep, count = rest.rpartition("x")
        if not (inter and intra and sep and count.isdigit() and 0 < int(count) <= 1024):
            raise InputError(
                f"link kind {name!r} is not a two-level link",
                fix="write INTER+INTRAxN, e.g. ib-ndr+nvlink4x4 (N GPUs per node over INTRA, nodes over INTER)",
            )
        return two_level_link(inter, intra, int(count))
    return link_registry().get(name)
