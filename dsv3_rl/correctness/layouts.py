"""Parallel layouts the correctness suite runs, by name.

A layout is megatron-core's view of one run: TP/PP/EP/ETP/VPP, sequence parallelism, the token
dispatcher and the number of processes (the rest of the world is data parallel). ``tp1`` is the
single-process run; every other layout is compared against the same reference.
"""

from __future__ import annotations

import dataclasses
import math

from dsv3_rl import layout


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout(layout.Layout):
    """A :class:`dsv3_rl.layout.Layout` with a name and the process count the suite runs it on."""

    name: str
    nproc: int | None = None
    """processes; default: the smallest world TP*PP and EP*ETP*PP both divide."""
    note: str = ""
    config_overrides: tuple = ()
    """(MLATransformerConfig field, value) pairs this layout needs"""
    model_overrides: tuple = ()
    """(mini-model preset key, value) pairs this layout needs (e.g. 8 layers for PP4 x VPP2): the suite writes,
    converts and references that variant of the random model for it (ignored with --hf-model-path)"""
    known_fail: str = ""
    """why this layout is documented to FAIL (docs/correctness.md): its FAIL is reported as XFAIL (expected),
    a PASS as XPASS (unexpected, a failure of the run: the documentation is out of date)"""
    known_fail_specs: tuple = ("te", "local")
    """the layer specs the known failure applies to"""

    @property
    def world(self) -> int:
        if self.nproc:
            return self.nproc
        return math.lcm(self.tp * self.pp, self.ep * self.etp_ * self.pp)

    @property
    def moe_tp_without_sp(self) -> bool:
        """megatron-core raises in MoELayer.forward when training with TP > 1 and no SP (a
        performance guard); such a layout runs its step with the modules in eval mode."""
        return self.tp > 1 and not self.sp_ and not self.dense_model

    @property
    def dense_model(self) -> bool:
        """The layout's model variant has no MoE layer (first_k_dense_replace >= num_hidden_layers)."""
        m = dict(self.model_overrides)
        return "first_k_dense_replace" in m and m["first_k_dense_replace"] >= m.get("num_hidden_layers", 4)

    def expected_to_fail(self, spec: str) -> bool:
        """Documented to FAIL with layer spec ``spec`` (te | local)."""
        return bool(self.known_fail) and spec in self.known_fail_specs

    def describe(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}", f"EP={self.ep}", f"ETP={self.etp_}"]
        if self.vpp:
            parts.append(f"VPP={self.vpp}")
        parts.append(f"SP={'on' if self.sp_ else 'off'}")
        parts.append(f"DP={self.dp(self.world)}")
        if self.ep > 1 or self.tp > 1 or self.etp_ > 1:
            parts.append(f"dispatcher={self.dispatcher}")
        model = f"; model {', '.join(f'{k}={v}' for k, v in self.model_overrides)}" if self.model_overrides else ""
        return f"{self.name} ({', '.join(parts)}; {self.world} process{'es' if self.world > 1 else ''}{model})"


# ETP is 1 unless a layout says otherwise (experts replicated over TP, DeepSeek-V3 practice)
TP_NOSP_FAIL = "MoE + TP without SP (forced to eval mode): routed-expert and MLA q_a_layernorm grads 2x"
BATCH_P2P_FAIL = "PP=2 + VPP with batched p2p: forward and backward messages cross (gloo and NCCL)"
Q_NORM_FAIL = "local spec, TP without SP: MLA q_a_layernorm grad 2x (finalize_model_grads all-reduces 'q_layernorm')"
_LAYOUTS = [
    Layout(name="tp1", etp=1, note="single process"),
    Layout(name="dp2", etp=1, nproc=2, note="data parallel: each rank its own micro-batches, DDP averaging"),
    Layout(name="tp2_nosp", tp=2, etp=1, sp=False, known_fail=TP_NOSP_FAIL,
           note="TP2 without SP: megatron refuses to train MoE+TP without SP; run in eval mode. KNOWN FAIL: 2x grads"),
    Layout(name="tp2_sp", tp=2, etp=1, sp=True, note="TP2 + sequence parallel, experts replicated over TP (ETP1)"),
    Layout(name="pp2", pp=2, etp=1),
    Layout(name="pp2_vpp2", pp=2, etp=1, vpp=2,
           note="interleaved pipeline, one layer per chunk on the tiny preset; unbatched p2p (config_map, as verl)"),
    Layout(name="pp2_vpp2_batchp2p", pp=2, etp=1, vpp=2, config_overrides=(("batch_p2p_comm", True),),
           known_fail=BATCH_P2P_FAIL,
           note="as pp2_vpp2 with megatron-core's default batched p2p: KNOWN FAIL on gloo and NCCL "
                "(forward/backward messages cross at PP=2)"),
    Layout(name="ep2", ep=2, etp=1),
    Layout(name="ep2_allgather", ep=2, etp=1, dispatcher="allgather"),
    Layout(name="tp2_ep2", tp=2, ep=2, etp=1),
    Layout(name="tp2_etp2", tp=2, etp=2, note="experts tensor-parallel like the dense layers"),
    Layout(name="etp2", etp=2, nproc=2, note="experts tensor-parallel, attention data-parallel"),
    # a dense model (no MoE layer), so megatron trains TP without SP: the MLA TP paths alone. Known FAIL on
    # the local spec (q_layernorm 2x); on the TE spec the q/kv norms are fused into linear_q/kv_up_proj and it
    # PASSes, which is where megatron patch 0001's twin (mla-down-proj-patch-reverted) runs.
    Layout(name="tp2_nosp_dense", tp=2, etp=1, sp=False,
           model_overrides=(("first_k_dense_replace", 4),), known_fail=Q_NORM_FAIL, known_fail_specs=("local",),
           note="TP2 without SP on an all-dense variant of the model (megatron trains it): MLA's TP paths alone"),
    # 4 processes (issue 25). Experts: tiny has 8 (2 per rank at EP4), 4 groups.
    Layout(name="ep4", ep=4, etp=1, note="4 processes: 2 experts per rank, attention DP4"),
    Layout(name="ep4_allgather", ep=4, etp=1, dispatcher="allgather", note="4 processes, allgather dispatcher"),
    Layout(name="tp2_ep2_dp2", tp=2, ep=2, etp=1, nproc=4, note="4 processes: TP2+SP x EP2, attention DP2"),
    Layout(name="pp2_ep2", pp=2, ep=2, etp=1, note="4 processes: PP2 x EP2 (expert DP1, attention DP2)"),
    Layout(name="pp4_vpp2", pp=4, etp=1, vpp=2, model_overrides=(("num_hidden_layers", 8),),
           note="4 processes: PP4 x VPP2, one layer per chunk on an 8-layer variant of the model"),
    Layout(name="tp2_pp2", tp=2, pp=2, etp=1, note="4 processes: TP2+SP x PP2"),
    Layout(name="dp2_ep2", ep=2, etp=1, nproc=4, note="4 processes: EP2 x expert-DP2 (attention DP4)"),
]
LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in _LAYOUTS}
# tp2_nosp is not among them: megatron-core refuses to train MoE + TP without SP, and where the
# suite forces it (eval mode) the gradients of routed experts and MLA q_a_layernorm are 2x
# (tests/unit/test_correctness_layouts.py keeps that finding pinned).
CI_LAYOUTS = ["tp1", "dp2", "tp2_sp", "pp2", "pp2_vpp2", "ep2", "ep2_allgather", "tp2_ep2", "tp2_etp2", "etp2"]
#: every 2-process layout, the documented known failures included (reported XFAIL): `--layout two`
TWO_PROC_LAYOUTS = [lay.name for lay in _LAYOUTS if lay.world == 2]
#: every 4-process layout: `--layout four`
FOUR_PROC_LAYOUTS = [lay.name for lay in _LAYOUTS if lay.world == 4]
GROUPS = {"ci": CI_LAYOUTS, "two": TWO_PROC_LAYOUTS, "four": FOUR_PROC_LAYOUTS}


def get(name: str) -> Layout:
    """A named layout (:data:`LAYOUTS`) or one written as ``tp=2,ep=2`` (:meth:`dsv3_rl.layout.Layout.parse`;
    ETP defaults to 1 here, SP to TP > 1)."""
    if "=" in name:
        lay = layout.Layout.parse(name)
        return from_sizes(tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp if lay.etp is not None else 1, vpp=lay.vpp,
                          sp=lay.sp, dispatcher=lay.dispatcher)
    if name not in LAYOUTS:
        raise KeyError(f"unknown layout {name!r} (allowed: {', '.join(LAYOUTS)}; or sizes like tp=2,ep=2)")
    return LAYOUTS[name]


def from_sizes(tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, vpp: int | None = None, sp: bool | None = None,
               dispatcher: str = "alltoall", nproc: int | None = None) -> Layout:
    """A layout from sizes (the seed-compatible ``--test-tp/--test-pp/--test-ep`` flags)."""
    for lay in _LAYOUTS:
        if (lay.tp, lay.pp, lay.ep, lay.etp_, lay.vpp, lay.sp_, lay.dispatcher) == (
                tp, pp, ep, etp, vpp, sp if sp is not None else tp > 1, dispatcher) and (nproc in (None, lay.world)):
            return lay
    parts = [f"tp{tp}"] + [f"{k}{v}" for k, v in (("pp", pp), ("ep", ep), ("etp", etp), ("vpp", vpp)) if v and v > 1]
    if sp is not None and tp > 1 and sp != (tp > 1):
        parts.append("nosp" if not sp else "sp")
    if dispatcher != "alltoall":
        parts.append(dispatcher)
    return Layout(name="_".join(parts), tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, sp=sp, dispatcher=dispatcher, nproc=nproc)
