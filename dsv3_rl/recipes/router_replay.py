"""Router replay by name: a preset's ``router_replay: none|R2|R3`` as verl 0.9.1 keys.

In an MoE a tiny numeric difference between vLLM and Megatron flips a token's top-k experts, so the
trainer differentiates a network other than the one that sampled. verl 0.9.1 replays routes in its
Megatron engine (``actor_rollout_ref.actor.megatron.router_replay.mode``,
verl/utils/megatron/router_replay_patch.py and router_replay_utils.py):

``none``
    No replay: each side routes on its own (the mismatch shows in ``rollout_corr/*`` and in
    ``dsv3-consistency``).
``R2``
    The trainer records its own routes in ``compute_log_prob`` and replays them in the update, so the
    update differentiates the routing that produced ``old_log_prob`` (it stays off vLLM's routes).
    Refused by verl with rollout-correction bypass mode (verl/utils/config.py:74-85).
``R3``
    vLLM returns each token's routed experts and the trainer replays them in ``compute_log_prob`` and
    in the update: the trainer's network is the one that sampled. On vLLM's CPU build the routes come
    from verl's worker extension (patch 0021, :mod:`dsv3_rl.consistency.vllm_routes`); on GPU from
    vLLM's ``enable_return_routed_experts``. Also turns on verl's per-step rollout MoE load metrics
    (``rollout.moe_load_balance_metrics_interval: 1``, they need the rollout's routes).

Replayed routes that break DeepSeek-V3's group limit are refused (verl patch 0020).
"""

from __future__ import annotations

import copy
from typing import Any

MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "R2": {"actor_rollout_ref": {"actor": {"megatron": {"router_replay": {"mode": "R2"}}}}},
    "R3": {"actor_rollout_ref": {"actor": {"megatron": {"router_replay": {"mode": "R3"}}},
                                 "rollout": {"enable_rollout_routing_replay": True,
                                             "moe_load_balance_metrics_interval": 1}}},
}

#: the mode a preset without ``router_replay`` gets
DEFAULT = "none"


def verl_tree(mode: str) -> dict:
    """verl override tree (nested dict in verl's config key space) for MODE; ``{}`` for ``none``."""
    if mode not in MODES:
        raise ValueError(f"router_replay={mode!r} (allowed: {', '.join(MODES)})")
    return copy.deepcopy(MODES[mode])
