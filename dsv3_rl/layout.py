"""The parallel layout of one megatron-core run: the one type the converter, the planner, the correctness
suite and the launcher share.

:class:`Layout` holds the sizes as megatron-core takes them (TP/PP/EP/ETP/VPP/CP, sequence parallelism,
the MoE token dispatcher) and the pipeline-split and recompute settings that go with them. Defaults
follow megatron-core 0.16.1 and verl 0.9.1, and are derived in one place:

* ``etp=None`` means ETP = TP (megatron's ``expert_tensor_parallel_size`` default): :attr:`Layout.etp_`;
* ``sp=None`` means SP on whenever TP > 1 (verl's default; megatron refuses to train MoE + TP
  without it): :attr:`Layout.sp_`;
* DP is what is left of the world: :meth:`Layout.dp` (attention) and :meth:`Layout.edp` (experts).

The text form ``tp=8,pp=12,ep=8,etp=1,last_stage_layers=6,recompute=full`` is read by
:meth:`Layout.parse` (:func:`parse_kv` for any dataclass); unknown keys are errors naming the allowed
ones. Run presets' ``layout`` sections take exactly :data:`FIELDS`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from dsv3_rl.errors import Dsv3Error

DISPATCHERS = ("alltoall", "allgather", "flex")
RECOMPUTE = ("none", "selective", "full")


class LayoutError(Dsv3Error, ValueError):
    """A layout (or another ``key=value`` list) is malformed; the message names the key and the allowed ones."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One trainer layout (megatron-core names in brackets)."""

    tp: int = 1
    """[tensor_model_parallel_size]"""
    pp: int = 1
    """[pipeline_model_parallel_size]"""
    ep: int = 1
    """[expert_model_parallel_size]"""
    etp: int | None = None
    """[expert_tensor_parallel_size]; None = TP (megatron's default). DeepSeek-V3 practice is 1."""
    vpp: int | None = None
    """[virtual_pipeline_model_parallel_size]"""
    cp: int = 1
    """[context_parallel_size]"""
    sp: bool | None = None
    """[sequence_parallel]; None = TP > 1 (verl's default)"""
    dispatcher: str = "alltoall"
    """[moe_token_dispatcher_type]: alltoall | allgather | flex"""
    pipeline_layout: str | None = None
    """[pipeline_model_parallel_layout], e.g. "Et|(tt|)*30mL" """
    first_stage_layers: int | None = None
    """[num_layers_in_first_pipeline_stage]"""
    last_stage_layers: int | None = None
    """[num_layers_in_last_pipeline_stage]"""
    account_for_embedding: bool = False
    """[account_for_embedding_in_pipeline_split]"""
    account_for_loss: bool = False
    """[account_for_loss_in_pipeline_split]"""
    recompute: str = "none"
    """[recompute_granularity]: none | selective | full"""
    recompute_modules: tuple[str, ...] = ()
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1

    @property
    def etp_(self) -> int:
        """ETP as megatron resolves it."""
        return self.tp if self.etp is None else self.etp

    @property
    def sp_(self) -> bool:
        """Sequence parallelism as verl resolves it."""
        return self.tp > 1 if self.sp is None else self.sp

    @property
    def vpp_(self) -> int:
        return self.vpp or 1

    def mcore_sizes(self) -> dict[str, int | None]:
        """The parallel sizes under megatron-core's names, as both ``TransformerConfig`` and
        ``parallel_state.initialize_model_parallel`` take them."""
        return dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                    virtual_pipeline_model_parallel_size=self.vpp, context_parallel_size=self.cp,
                    expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp_)

    def dp(self, world: int) -> int:
        """Data-parallel size of the dense (attention) part on WORLD ranks; 0 when it does not divide."""
        mp = self.tp * self.pp * self.cp
        return world // mp if mp > 0 and world % mp == 0 else 0

    def edp(self, world: int) -> int:
        """Data-parallel size of the experts on WORLD ranks; 0 when it does not divide."""
        emp = self.etp_ * self.ep * self.pp
        return world // emp if emp > 0 and world % emp == 0 else 0

    def short(self) -> str:
        s = f"TP{self.tp} PP{self.pp}"
        if self.vpp:
            s += f" VPP{self.vpp}"
        s += f" EP{self.ep}"
        if self.etp_ != self.tp or self.ep > 1:
            s += f" ETP{self.etp_}"
        if self.cp > 1:
            s += f" CP{self.cp}"
        if self.pipeline_layout:
            s += f" layout={self.pipeline_layout}"
        elif self.first_stage_layers or self.last_stage_layers:
            s += f" first/last={self.first_stage_layers}/{self.last_stage_layers}"
        rc = self.recompute if self.recompute != "selective" else "sel[" + ",".join(self.recompute_modules) + "]"
        return s + f" rc={rc}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``tp=8,pp=12,ep=8,etp=1,recompute=full`` (tuples with ':', ``recompute_modules=core_attn:mlp``)."""
        return from_dict(cls, parse_kv(cls, [text]))


#: the keys a layout takes (run presets' ``layout`` section, ``--layout``)
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Layout))


def _convert(cls, key: str, raw: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        raise LayoutError(f"{cls.__name__}: unknown key {key!r}; allowed: {sorted(fields)}")
    text = str(typing.get_type_hints(cls)[key])
    if raw.lower() in ("none", "null") and "None" in text:  # recompute=none stays the string "none"
        return None
    try:
        if "tuple" in text:
            items = [x for x in raw.strip("()[]").split(":" if ":" in raw else ";") if x] if raw else []
            inner = int if "int" in text else str
            return tuple(inner(x) if x.lower() not in ("none", "null") else None for x in items)
        if "bool" in text:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise LayoutError(f"{cls.__name__}.{key}: {raw!r} is not a boolean")
        if "float" in text:
            return float(raw)
        if "int" in text:
            return int(raw)
    except ValueError as e:
        if isinstance(e, LayoutError):
            raise
        raise LayoutError(f"{cls.__name__}.{key}={raw!r}: not a {text}") from None
    return raw


def parse_kv(cls, items: list[str]) -> dict:
    """``key=value`` pairs (comma-separated or repeated) for dataclass ``cls``, values converted to the
    field's type; tuples use ':' between items (``recompute_modules=core_attn:mla_up_proj``)."""
    out = {}
    for item in items or []:
        for part in item.split(","):
            if not part:
                continue
            if "=" not in part:
                raise LayoutError(f"expected key=value, got {part!r}")
            k, v = part.split("=", 1)
            out[k.strip()] = _convert(cls, k.strip(), v.strip())
    return out


#: parallel sizes, in any layout class (trainer Layout, the planner's RolloutLayout): integers >= 1 (or None)
PARALLEL_SIZES = ("tp", "pp", "ep", "etp", "vpp", "cp", "dp")


def from_dict(cls, d: dict[str, Any] | None):
    """Build a dataclass from a dict; unknown or missing keys are an error naming them, and so is a parallel
    size (PARALLEL_SIZES) that is not an integer >= 1 (``tp=0``)."""
    if d is None:
        return cls()
    if isinstance(d, cls):
        return d
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise LayoutError(f"{cls.__name__}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING and f.name not in d]
    if required:
        raise LayoutError(f"{cls.__name__}: missing key(s) {required}; give them as key=value")
    for k in PARALLEL_SIZES:
        v = d.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise LayoutError(f"{cls.__name__}.{k}={v!r}: a parallel size is an integer >= 1")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
