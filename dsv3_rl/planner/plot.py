"""PNG of the per-GPU memory breakdown of the top layouts (trainer peak and rollout), matplotlib."""

from __future__ import annotations

from pathlib import Path

from dsv3_rl.planner.spec import GIB
from dsv3_rl.fs import atomic_path

_TRAIN = (("weights", "#4c72b0"), ("grads", "#55a868"), ("optimizer", "#c44e52"), ("activations", "#8172b2"),
          ("logits", "#ccb974"), ("transient", "#64b5cd"), ("comm_buffers", "#8c8c8c"), ("ref_weights", "#937860"),
          ("reserve", "#dddddd"))
_ROLL = (("weights", "#4c72b0"), ("activations", "#8172b2"), ("cuda_graphs", "#64b5cd"), ("reserve", "#dddddd"),
         ("kv_cache", "#dd8452"), ("trainer_resident", "#937860"))


_ABBR = {"core_attn": "ca", "mla_up_proj": "mla", "layernorm": "ln", "moe_act": "act", "mlp": "mlp", "moe": "moe",
         "shared_experts": "sh"}


def _label(e) -> str:
    lay = e.layout
    l1 = f"TP{lay.tp} PP{lay.pp}" + (f" VPP{lay.vpp}" if lay.vpp else "")
    l2 = f"EP{lay.ep} ETP{lay.etp_}" + (f" CP{lay.cp}" if lay.cp > 1 else "")
    if lay.pipeline_layout:
        l3 = lay.pipeline_layout if len(lay.pipeline_layout) <= 16 else lay.pipeline_layout[:14] + ".."
    elif lay.first_stage_layers or lay.last_stage_layers:
        l3 = f"first/last {lay.first_stage_layers}/{lay.last_stage_layers}"
    else:
        l3 = "even split"
    if lay.recompute == "selective":
        l4 = "sel(" + ",".join(_ABBR.get(x, x) for x in lay.recompute_modules) + ")"
    else:
        l4 = f"rc {lay.recompute}"
    return "\n".join((l1, l2, l3, l4))


def _rlabel(e) -> str:
    ro = e.rollout
    if ro is None:
        return "-"
    a = f"TP{ro.tp}" + (f" DP{ro.dp}" if ro.dp > 1 else "")
    b = (f"EP{ro.ep} " if ro.ep > 1 else "") + f"x{ro.instances}"
    return f"{a}\n{b}\nutil {ro.gpu_memory_utilization:.2f}"


def plot_plan(res, path, top: int = 5) -> Path:
    """Two stacked bar panels (trainer peak, rollout) for the best ``top`` layouts; the GPU's
    capacity is a dashed line. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evs = res.feasible[:top]
    if not evs:
        evs = sorted((e for e in res.rejected if e.memory), key=lambda e: e.memory.total)[:top]
        title_kind = "no feasible layout; smallest rejected ones"
    else:
        title_kind = f"top {len(evs)} of {len(res.feasible)} feasible"
    cap = res.cluster.memory_bytes / GIB
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.6 * len(evs) + 4), 6.6), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"#{i + 1}{' (tight)' if e.tight else ''}\n" + _label(e) for i, e in enumerate(evs)]
    ax = axes[0]
    bottoms = [0.0] * len(evs)
    for name, color in _TRAIN:
        vals = [getattr(e.memory, name) / GIB if e.memory else 0.0 for e in evs]
        if not any(vals):
            continue
        ax.bar(range(len(evs)), vals, bottom=bottoms, color=color, label=name, edgecolor="white", linewidth=0.5)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, b in enumerate(bottoms):
        ax.text(i, b + cap * 0.01, f"{b:.1f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(len(evs) - 0.5, cap, f" {res.cluster.gpu} {cap:.0f} GiB", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(evs)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GiB per GPU")
    ax.set_title("trainer peak (worst PP rank)", fontsize=10)
    ax.set_ylim(0, cap * 1.15)
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    ax = axes[1]
    bottoms = [0.0] * len(evs)
    rl = [_rlabel(e) for e in evs]
    for name, color in _ROLL:
        vals = [getattr(e.rollout_memory, name) / GIB if e.rollout_memory else 0.0 for e in evs]
        if not any(vals):
            continue
        ax.bar(range(len(evs)), vals, bottom=bottoms, color=color, label=name, edgecolor="white", linewidth=0.5)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, e in enumerate(evs):
        if e.rollout_memory:
            ax.text(i, bottoms[i] + cap * 0.01, f"KV {e.rollout_memory.kv_tokens // 1000}k tok", ha="center", va="bottom",
                    fontsize=7)
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(evs)))
    ax.set_xticklabels([f"#{i + 1}\n{x}" for i, x in enumerate(rl)], fontsize=7)
    ax.set_title("rollout (vLLM) per GPU", fontsize=10)
    ax.set_ylim(0, cap * 1.15)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    m = res.model
    fig.suptitle(f"{m.name} GRPO on {res.cluster.nodes}x{res.cluster.gpus_per_node} {res.cluster.gpu} "
                 f"({res.options.placement}); {title_kind}", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or None)
    plt.close(fig)
    return path
