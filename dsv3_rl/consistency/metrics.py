"""What a consistency run measures, from the route and log-prob records of both sides (pure functions).

Routes are int tensors ``[rows, layers, top_k]`` (rows: the tokens fed to the model; -1 marks a dense
layer); two routes agree when their top-k expert *sets* are equal (the order the kernels return
them in is arbitrary). Log-probs are those of the sampled response tokens.
"""

from __future__ import annotations

import math

import torch


def route_sets(routes: torch.Tensor) -> torch.Tensor:
    """The same routes with each top-k sorted, so that equal sets compare equal."""
    return torch.sort(routes.long(), dim=-1).values


def moe_layers(routes: torch.Tensor) -> list[int]:
    """Layers that were routed (not all -1)."""
    return [i for i in range(routes.shape[1]) if bool((routes[:, i] >= 0).any())]


def route_agreement(rollout: list[torch.Tensor], trainer: list[torch.Tensor]) -> tuple[float, list[dict]]:
    """Fraction of (token, MoE layer) whose expert sets are equal, overall and per layer."""
    a = torch.cat([route_sets(r) for r in rollout])
    b = torch.cat([route_sets(r) for r in trainer])
    if a.shape != b.shape:
        raise ValueError(f"route records differ in shape: rollout {tuple(a.shape)} vs trainer {tuple(b.shape)}")
    layers = moe_layers(a)
    if not layers:
        raise ValueError("no routed layer in the rollout's routes")
    same = (a == b).all(dim=-1)  # [rows, layers]
    per_layer = [{"layer": i, "route_agreement": float(same[:, i].float().mean())} for i in layers]
    overall = float(same[:, layers].float().mean())
    return overall, per_layer


def logprob_gap(rollout: list[torch.Tensor], trainer: list[torch.Tensor]) -> dict:
    """Mean and max |delta logp| and the k3 estimate of KL(rollout || trainer) over response tokens."""
    a = torch.cat([x.double() for x in rollout])
    b = torch.cat([x.double() for x in trainer])
    if a.shape != b.shape:
        raise ValueError(f"log-prob records differ in length: rollout {a.numel()} vs trainer {b.numel()}")
    if not a.numel():
        raise ValueError("no response tokens to compare")
    diff = (b - a).abs()
    r = b - a  # log(p_trainer / p_rollout) at tokens sampled from the rollout
    k3 = torch.expm1(r) - r
    return {"logprob_abs_diff_mean": float(diff.mean()), "logprob_abs_diff_max": float(diff.max()),
            "k3_kl": float(k3.mean()), "tokens": int(a.numel())}


def expert_load(routes: list[torch.Tensor], num_experts: int) -> tuple[torch.Tensor, list[dict]]:
    """Tokens per expert per layer ``[layers, num_experts]`` and per-layer max/mean imbalance."""
    a = torch.cat([r.long() for r in routes])
    layers = moe_layers(a)
    load = torch.zeros(a.shape[1], num_experts, dtype=torch.long)
    for i in layers:
        ids = a[:, i].reshape(-1)
        load[i] = torch.bincount(ids[ids >= 0], minlength=num_experts)[:num_experts]
    stats = []
    for i in layers:
        mean = float(load[i].float().mean())
        stats.append({"layer": i, "max_over_mean": float(load[i].max()) / mean if mean else math.nan,
                      "idle_experts": int((load[i] == 0).sum())})
    return load, stats


def group_limit_violations(routes: list[torch.Tensor], num_experts: int, n_group: int, topk_group: int) -> int:
    """(token, layer) routes that use more than ``topk_group`` of the ``n_group`` expert groups."""
    a = torch.cat([r.long() for r in routes])
    if n_group <= 1:
        return 0
    per_group = num_experts // n_group
    bad = 0
    for i in moe_layers(a):
        groups = a[:, i] // per_group
        used = torch.zeros(groups.shape[0], n_group, dtype=torch.bool).scatter_(1, groups, True)
        bad += int((used.sum(-1) > topk_group).sum())
    return bad
