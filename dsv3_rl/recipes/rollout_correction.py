"""Rollout correction by name: a preset's ``rollout_correction: <mode>`` as verl 0.9.1 keys.

vLLM samples the responses, Megatron computes the log-probs the loss uses. The two never agree exactly
(different kernels and reduction orders in bf16; for a MoE a tiny router-logit difference can flip one of
a token's top-8 experts), so GRPO trains on samples from a policy slightly different from the one it
differentiates. verl 0.9.1 corrects this with ``algorithm.rollout_correction``
(verl/trainer/config/algorithm.py:64 ``RolloutCorrectionConfig``, defaults in
verl/trainer/config/algorithm/rollout_correction.yaml): with ``rollout_log_probs`` from vLLM
(``actor_rollout_ref.rollout.calculate_log_probs``) the driver computes, once per batch in decoupled mode,
``log r = old_log_prob - rollout_log_prob`` (Megatron's log-prob minus vLLM's, per token;
verl/trainer/ppo/rollout_corr_helper.py:849) and from it IS weights that multiply the policy loss and/or a
rejection mask that removes tokens or sequences from ``response_mask``
(``compute_rollout_correction_and_add_to_batch``, rollout_corr_helper.py:1013, called from
verl/trainer/ppo/ray_trainer.py:1650-1658).

The modes (each is one of verl's own presets, with its default thresholds):

``none``
    Nothing is set: verl's defaults (``rollout_is: null``, ``rollout_rs: null``) compute no weight and
    reject nothing, but still log the ``rollout_corr/*`` mismatch metrics (kl, k3_kl, ppl, chi2) whenever
    vLLM returns log-probs. Use it for small or dense models where the mismatch metrics stay small, and to
    measure the mismatch before choosing a correction.
``tis``
    Token-level truncated importance sampling (``RolloutCorrectionConfig.decoupled_token_is``,
    algorithm.py:188): each token's loss is multiplied by ``w_t = min(exp(log r_t), 2.0)``
    (rollout_corr_helper.py:572-596). Low variance, slightly biased; never drops a token. The default
    choice for a bf16 vLLM rollout vs a Megatron trainer, and for long responses, where a sequence-level
    weight (a product over thousands of tokens) is useless.
``seq_tis``
    Sequence-level truncated IS (``decoupled_seq_is``, algorithm.py:202): every token of a sequence gets
    ``min(exp(sum_t log r_t), 2.0)`` (rollout_corr_helper.py:578-596). Unbiased at the sequence level but
    its variance grows with the length; for short responses (a few hundred tokens) and small mismatch.
``mis``
    Masked (rejection-sampled) sequence IS, the "Seq-MIS" preset (``decoupled_seq_is_rs``,
    algorithm.py:237): sequence-level IS weights truncated at 2.0 as in ``seq_tis``, and a sequence whose
    ratio ``prod_t r_t`` falls outside ``[0.5, 2.0]`` is dropped from the loss (``rollout_rs: seq_sum_k1``,
    rollout_corr_helper.py:323-340). For short responses where a few sequences are badly off-policy
    (e.g. a stale or half-synced rollout) and should be thrown away rather than down-weighted.
``icepop``
    Token-level IcePop (``decoupled_token_icepop``, algorithm.py:216): a token keeps its full IS weight
    ``exp(log r_t)`` when it lies in ``[0.5, 5.0]`` and gets weight 0 outside (rollout_corr_helper.py:597-604;
    ``response_mask`` is left as it is). From the Ring-1T MoE work: tokens whose probability differs by more
    than 2x/5x between the engines (a flipped expert, a numerically unstable token) contribute no gradient
    at all instead of a clipped one. Use it when the mismatch has a heavy tail (high
    ``rollout_corr/rollout_is_ratio_fraction_high``, ``rollout_corr/chi2_token``) that TIS leaves in.

Every mode is decoupled (three policies: vLLM's, the recomputed old policy, the one being trained), so it
works with router replay R2, which verl refuses in bypass mode (verl/utils/config.py:74-85). Bypass mode
(``bypass_mode: true``: skip the old-log-prob forward, use vLLM's log-probs as the PPO anchor) is not a
named mode; set ``verl: {algorithm: {rollout_correction: ...}}`` for it or for other thresholds: the preset's
``verl:`` section is merged after this one, key by key.
"""

from __future__ import annotations

import copy
from typing import Any

#: verl's config node for rollout correction (ppo_megatron_trainer.yaml ``algorithm.rollout_correction``)
NODE = "algorithm.rollout_correction"

#: name -> the keys under ``algorithm.rollout_correction`` (verl 0.9.1 names; thresholds are the defaults
#: of the RolloutCorrectionConfig factory named in the module docstring)
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "tis": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": None, "bypass_mode": False},
    "seq_tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": None, "bypass_mode": False},
    "mis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
            "rollout_rs_threshold": "0.5_2.0", "bypass_mode": False},
    "icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0", "rollout_rs": None, "bypass_mode": False},
}

#: the mode a preset without ``rollout_correction`` gets
DEFAULT = "none"


def verl_tree(mode: str) -> dict:
    """verl override tree (nested dict in verl's config key space) for MODE; ``{}`` for ``none``.

    A correcting mode also sets ``actor_rollout_ref.rollout.calculate_log_probs: true``: without vLLM's
    log-probs in the batch verl skips the correction silently (ray_trainer.py:1650-1653)."""
    if mode not in MODES:
        raise ValueError(f"rollout_correction={mode!r} (allowed: {', '.join(MODES)})")
    keys = MODES[mode]
    if not keys:
        return {}
    return {"algorithm": {"rollout_correction": copy.deepcopy(keys)},
            "actor_rollout_ref": {"rollout": {"calculate_log_probs": True}}}
