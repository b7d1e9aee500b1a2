"""Pipeline split (which layers each PP rank / virtual stage holds), the 1F1B / interleaved
schedule's in-flight micro-batches, and the pipeline bubble.

The split reproduces megatron-core 0.16.1 exactly, for its three ways to describe it:

* ``pipeline_model_parallel_layout`` strings ("Et|(tt|)*30mL"), parsed and validated like
  ``megatron/core/transformer/pipeline_parallel_layer_layout.py``;
* uneven first/last stages (``num_layers_in_first/last_pipeline_stage``), validated like
  ``transformer_config.py:1360-1436`` and ``transformer_block.py:104-133``;
* the even split, optionally counting the embedding / loss as a layer
  (``account_for_embedding/loss_in_pipeline_split``), ``transformer_config.py:1438-1480`` and
  ``transformer_block.py:146-200``; layer offsets as ``transformer_layer.py:39-193``.

Each broken rule is a :class:`~dsv3_rl.planner.rules.Violation` naming the megatron file:line.
"""

from __future__ import annotations

import dataclasses
import re

from dsv3_rl.planner.rules import MCORE, Violation

_CHAR = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


@dataclasses.dataclass
class Stage:
    """What one (pp_rank, vp_stage) model chunk holds."""

    decoder: list[int] = dataclasses.field(default_factory=list)  # global decoder layer indices
    embedding: bool = False
    loss: bool = False
    mtp: int = 0


@dataclasses.dataclass
class Split:
    pp: int
    vpp: int
    stages: list[list[Stage]]  # [pp_rank][vp_stage]
    how: str

    def rank_layers(self, r: int) -> list[int]:
        return [i for s in self.stages[r] for i in s.decoder]


def parse_layout(layout: str) -> list[list[str]]:
    """megatron's ``PipelineParallelLayerLayout.parse_str_to_list``
    (pipeline_parallel_layer_layout.py:283-322): strip commas, unroll ``(..)*n`` then ``x*n``,
    split on ``|``; characters E (embedding), L (loss), t (decoder), m (mtp)."""
    s = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        s = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), s)
    out = []
    for stage in s.split("|"):
        row = []
        for ch in stage:
            if ch not in _CHAR:
                raise ValueError(f"pipeline layout {layout!r}: invalid layer character {ch!r} in stage {stage!r}; "
                                 f"known: {list(_CHAR)} ({MCORE}/transformer/pipeline_parallel_layer_layout.py:314-318)")
            row.append(_CHAR[ch])
        out.append(row)
    return out


def _from_layout(layout: str, pp: int, vpp: int | None, num_layers: int, mtp_layers: int) -> tuple[Split | None, list[Violation]]:
    src = f"{MCORE}/transformer/pipeline_parallel_layer_layout.py"
    v: list[Violation] = []
    try:
        rows = parse_layout(layout)
    except ValueError as e:
        return None, [Violation("pp.layout.char", str(e), f"{src}:314-318")]
    if len(rows) % pp:
        return None, [Violation("pp.layout.stages", f"pipeline layout {layout!r} has {len(rows)} stages, not a multiple of "
                                f"PP={pp}", f"{src}:40")]
    v_size = len(rows) // pp
    if vpp is not None and vpp != v_size:
        v.append(Violation("pp.layout.vpp", f"VPP={vpp} conflicts with the layout's {len(rows)}/PP{pp} = {v_size} virtual "
                           f"stages", f"{MCORE}/transformer/transformer_config.py:1340-1351"))
    # 1D -> 2D: stage index = vpp_rank * pp + pp_rank (pipeline_parallel_layer_layout.py:48-54)
    grid = [[rows[vr * pp + r] for vr in range(v_size)] for r in range(pp)]
    flat = [x for vr in range(v_size) for r in range(pp) for x in grid[r][vr]]
    if not flat or flat[0] != "embedding":
        v.append(Violation("pp.layout.embedding_first", f"layout {layout!r}: the first layer must be E (embedding)", f"{src}:94-96"))
    if not flat or flat[-1] != "loss":
        v.append(Violation("pp.layout.loss_last", f"layout {layout!r}: the last layer must be L (loss)", f"{src}:97-99"))
    if flat.count("embedding") != 1 or flat.count("loss") != 1:
        v.append(Violation("pp.layout.once", f"layout {layout!r}: E and L must each appear exactly once "
                           f"(E x{flat.count('embedding')}, L x{flat.count('loss')})", f"{src}:102-105"))
    nd = flat.count("decoder")
    if nd != num_layers:
        v.append(Violation("pp.layout.num_layers", f"layout {layout!r} has {nd} decoder layers (t) but the model has "
                           f"num_layers={num_layers}", f"{src}:106-109"))
    nm = flat.count("mtp")
    if nm != mtp_layers and not (mtp_layers == 0 and nm == 0):
        v.append(Violation("pp.layout.mtp", f"layout {layout!r} has {nm} MTP layers (m) but mtp_num_layers={mtp_layers}",
                           f"{src}:111-113"))
    if "mtp" in flat and "decoder" in flat[flat.index("mtp"):]:
        v.append(Violation("pp.layout.mtp_order", "decoder layers must be placed before MTP layers", f"{src}:114-119"))
    for r in range(pp):
        for vr in range(v_size - 1):
            if "mtp" in grid[r][vr]:
                v.append(Violation("pp.layout.mtp_last_vp", f"MTP must be in the last virtual stage of its PP rank "
                                   f"(found in PP rank {r}, VP stage {vr})", f"{src}:120-125"))
    stages, layer = [[Stage() for _ in range(v_size)] for _ in range(pp)], 0
    for vr in range(v_size):
        for r in range(pp):
            st = stages[r][vr]
            for x in grid[r][vr]:
                if x == "decoder":
                    st.decoder.append(layer)
                    layer += 1
                elif x == "embedding":
                    st.embedding = True
                elif x == "loss":
                    st.loss = True
                else:
                    st.mtp += 1
    return Split(pp, v_size, stages, f"layout {layout}"), v


def _even_or_uneven(L: int, pp: int, vpp: int | None, first: int | None, last: int | None, acc_emb: bool,
                    acc_loss: bool) -> tuple[Split | None, list[Violation]]:
    tc = f"{MCORE}/transformer/transformer_config.py"
    tb = f"{MCORE}/transformer/transformer_block.py"
    v: list[Violation] = []
    vs = vpp or 1
    uneven = first is not None or last is not None
    if uneven and (acc_emb or acc_loss):
        return None, [Violation("pp.uneven_and_account", "num_layers_in_first/last_pipeline_stage cannot be combined with "
                                "account_for_embedding/loss_in_pipeline_split", f"{tc}:1294-1306")]
    per_rank: list[int] = []
    if uneven:
        mid_layers, mid_stages = L, pp
        for name, n in (("first", first), ("last", last)):
            if n is None:
                continue
            if n <= 0:
                v.append(Violation(f"pp.{name}_positive", f"num_layers_in_{name}_pipeline_stage={n} must be > 0",
                                   f"{tc}:{1368 if name == 'first' else 1387}"))
            if vpp is not None and n % vpp:
                v.append(Violation(f"pp.{name}_vpp", f"num_layers_in_{name}_pipeline_stage={n} is not divisible by VPP={vpp}",
                                   f"{tc}:{1372 if name == 'first' else 1391}"))
            mid_layers -= n
            mid_stages -= 1
        if mid_layers < 0:
            v.append(Violation("pp.middle_negative", f"first={first} + last={last} layers exceed num_layers={L} "
                               f"({mid_layers} left for the {mid_stages} middle PP stages); megatron-core does not check "
                               f"this and would build a negative layer count", f"{tc}:1406-1418 (unchecked)"))
        elif bool(mid_layers) != bool(mid_stages):
            v.append(Violation("pp.middle_mismatch", f"{mid_layers} middle layers remain for {mid_stages} middle PP stages "
                               f"(num_layers={L}, PP={pp}, first={first}, last={last})", f"{tc}:1406-1410"))
        elif mid_stages and mid_layers % mid_stages:
            v.append(Violation("pp.middle_divisible", f"{mid_layers} middle layers are not divisible by the {mid_stages} middle "
                               f"PP stages (num_layers={L}, PP={pp}, first={first}, last={last})", f"{tc}:1414-1418; {tb}:130-133"))
        elif mid_stages and vpp is not None and (mid_layers // mid_stages) % vpp:
            v.append(Violation("pp.middle_vpp", f"{mid_layers // mid_stages} layers per middle PP rank are not divisible by "
                               f"VPP={vpp}", f"{tc}:1421-1434"))
        if v:
            return None, v
        mid = mid_layers // mid_stages if mid_stages else 0
        per_rank = [mid] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        n = L + int(acc_emb) + int(acc_loss)
        if n % pp:
            what = " (num_layers + embedding/loss counted as layers)" if (acc_emb or acc_loss) else ""
            return None, [Violation("pp.num_layers_divisible", f"num_layers={n}{what} is not divisible by PP={pp}; "
                                    f"use an uneven first/last stage or a pipeline layout",
                                    f"{tb}:155-157" + (f"; {tc}:1444-1464" if (acc_emb or acc_loss) else ""))]
        if vpp is not None and (n // pp) % vpp:
            return None, [Violation("pp.vpp_divisible", f"{n // pp} layers per PP rank are not divisible by VPP={vpp}",
                                    f"{tb}:174-177" + (f"; {tc}:1470-1480" if (acc_emb or acc_loss) else ""))]
        per_rank = [n // pp] * pp
    # Build chunks with megatron's offsets (transformer_layer.py:39-193): model chunk c of rank r
    # holds a contiguous run; virtual chunk c across ranks comes after all of chunk c-1.
    chunk = [[per_rank[r] // vs for _ in range(vs)] for r in range(pp)]
    if acc_emb:
        chunk[0][0] -= 1
    if acc_loss:
        chunk[-1][-1] -= 1
    for r, vr, what in ((0, 0, "first"), (pp - 1, vs - 1, "last")):
        if chunk[r][vr] < 0:
            return None, [Violation(f"pp.{what}_empty", f"not enough layers in the {what} virtual pipeline stage after "
                                    f"accounting for the {'embedding' if what == 'first' else 'loss'}",
                                    f"{tb}:{192 if what == 'first' else 200}")]
    stages, layer = [[Stage() for _ in range(vs)] for _ in range(pp)], 0
    for vr in range(vs):
        for r in range(pp):
            stages[r][vr].decoder = list(range(layer, layer + chunk[r][vr]))
            layer += chunk[r][vr]
    stages[0][0].embedding = True
    stages[-1][-1].loss = True
    how = "even" if not uneven else f"uneven first={first} last={last}"
    if acc_emb or acc_loss:
        how += " (embedding/loss counted)"
    return Split(pp, vs, stages, how), v


def split_layers(num_layers: int, pp: int, vpp: int | None = None, *, layout: str | None = None,
                 first: int | None = None, last: int | None = None, account_for_embedding: bool = False,
                 account_for_loss: bool = False, mtp_layers: int = 0) -> tuple[Split | None, list[Violation]]:
    """The layer split for one layout, or ``(None, violations)``."""
    tc = f"{MCORE}/transformer/transformer_config.py"
    if vpp is not None and pp <= 1:
        return None, [Violation("pp.vpp_needs_pp", f"VPP={vpp} needs PP > 1 (got PP={pp})",
                                f"{MCORE}/parallel_state.py:745-749")]
    if vpp is not None and vpp < 1:
        return None, [Violation("pp.vpp_positive", f"VPP={vpp} must be >= 1", f"{MCORE}/parallel_state.py:745")]
    if layout is not None:
        if first is not None or last is not None or account_for_embedding or account_for_loss:
            return None, [Violation("pp.layout_conflict", "pipeline_model_parallel_layout cannot be combined with "
                                    "num_layers_in_first/last_pipeline_stage or account_for_* options", f"{tc}:1308-1325")]
        split, v = _from_layout(layout, pp, vpp, num_layers, mtp_layers)
        return (split if not v else None), v
    split, v = _even_or_uneven(num_layers, pp, vpp, first, last, account_for_embedding, account_for_loss)
    if split is not None and mtp_layers:
        split.stages[-1][-1].mtp = mtp_layers  # megatron's default: MTP with the loss on the last stage
    return split, v


def suggest_splits(num_layers: int, pp: int, vpp: int | None, mtp_layers: int = 0) -> list[dict]:
    """The pipeline description to try for (PP, VPP): the even split if megatron accepts it;
    otherwise the legal uneven first/last stage split with the smallest largest stage (counting
    the embedding and the loss as one layer each), or a balanced ``pipeline_model_parallel_layout``
    when that is strictly better balanced. Stages must not outnumber layers + 2."""
    if pp == 1:
        return [{}]
    vs = vpp or 1
    n = pp * vs
    if n > num_layers + 2:
        return []
    if num_layers % pp == 0 and (num_layers // pp) % vs == 0:
        return [{}]
    best = None
    for first in [None, *range(vs, num_layers, vs)]:
        for last in [None, *range(vs, num_layers, vs)]:
            if first is None and last is None:
                continue
            mid_stages = pp - (first is not None) - (last is not None)
            rest = num_layers - (first or 0) - (last or 0)
            if mid_stages <= 0 or rest <= 0 or rest % mid_stages or (rest // mid_stages) % vs:
                continue
            mid = rest // mid_stages
            units = max((first if first is not None else mid) + 1, (last if last is not None else mid) + 1, mid)
            key = (units, (first is not None) + (last is not None))
            if best is None or key < best[0]:
                best = (key, first, last)
    ideal = -(-(num_layers + 2) // n) * vs  # per-rank units of the balanced layout
    if best is not None and best[0][0] <= ideal:
        d = {}
        if best[1] is not None:
            d["first_stage_layers"] = best[1]
        if best[2] is not None:
            d["last_stage_layers"] = best[2]
        return [d]
    return [{"pipeline_layout": balanced_layout(num_layers, pp, vs, mtp_layers)}]


def balanced_layout(num_layers: int, pp: int, vpp: int = 1, mtp_layers: int = 0) -> str:
    """A layout string over ``pp * vpp`` stages that counts the embedding and the loss as one
    layer each (like account_for_embedding/loss_in_pipeline_split) and gives the remainder to
    the middle stages; e.g. 61 layers on 32 stages -> ``Et|(tt|)*30L``."""
    n = pp * vpp
    units = num_layers + 2
    base, extra = divmod(units, n)
    counts = [base] * n
    order = list(range(1, n - 1)) + [0, n - 1] if n > 2 else list(range(n))
    for i in order[:extra]:
        counts[i] += 1
    counts[0] -= 1
    counts[-1] -= 1
    if counts[0] < 0:  # fewer units than stages: move the deficit to the next stage
        counts[1] += counts[0]
        counts[0] = 0
    stages = ["t" * max(0, c) for c in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp_layers + "L"
    return compress_layout(stages)


def compress_layout(stages: list[str]) -> str:
    """Join stages with ``|`` and fold runs of identical stages / layers the way megatron's
    parser unrolls them: ``(tt|)*30`` and ``t*4``."""
    def fold(stage: str) -> str:
        return re.sub(r"t{3,}", lambda x: f"t*{len(x.group(0))}", stage)

    out, i = [], 0
    while i < len(stages):
        j = i
        while j + 1 < len(stages) and stages[j + 1] == stages[i]:
            j += 1
        run = j - i + 1
        # a run that ends the layout keeps its last stage outside the group (no trailing '|')
        if run >= 3 and j < len(stages) - 1:
            out.append(f"({fold(stages[i])}|)*{run}")
            i = j + 1
            continue
        out.append(fold(stages[i]) + ("|" if i < len(stages) - 1 else ""))
        i += 1
    return "".join(out)


def warmup_microbatches(pp: int, vpp: int, rank: int, m: int) -> int:
    """Forward passes a rank runs before its first backward (schedules.py:760-786), capped at the
    total; with interleaving, microbatch_group_size_per_vp_stage defaults to PP
    (model_parallel_config.py:447-448)."""
    total = m * vpp
    if pp == 1:
        return 0
    if vpp == 1:
        w = pp - rank - 1
    else:
        w = (pp - rank - 1) * 2 + (vpp - 1) * pp
    return min(w, total)


def inflight_chunks(pp: int, vpp: int, rank: int, m: int) -> int:
    """Model-chunk forwards whose activations a rank holds at its peak: the warm-up forwards plus
    the one forward of the first 1F1B step (or all of them when they are all warm-up)."""
    total = m * vpp
    return min(warmup_microbatches(pp, vpp, rank, m) + 1, total)


def bubble_fraction(pp: int, vpp: int, m: int) -> float:
    """Idle fraction of the pipeline schedule: (PP-1) / (VPP*M + PP-1)."""
    if pp == 1:
        return 0.0
    return (pp - 1) / (vpp * m + pp - 1)
