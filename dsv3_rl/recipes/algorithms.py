"""Trainer modes and RL algorithms by name: a preset's ``trainer_mode`` and ``algorithm`` as verl 0.9.1's own
entry points, config files and keys (docs/algorithms.md). The one place the mode -> entry point mapping lives.

``trainer_mode`` (:data:`MODES`):

``sync``
    ``python -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer``: rollout, then training, on the
    same GPUs (colocated, ``hybrid_engine``); every sample comes from the current policy.
``one_step_off``
    ``python -m verl.experimental.one_step_off_policy.main_ppo --config-name=one_step_off_ppo_megatron_trainer``
    (verl/experimental/one_step_off_policy): the rollout runs on its own GPUs (``rollout.nnodes`` x
    ``rollout.n_gpus_per_node``) and generates batch k+1 while the trainer (``trainer.nnodes`` x
    ``trainer.n_gpus_per_node``) trains on batch k; the weights go trainer -> rollout once per step through
    verl's checkpoint engine (``actor_rollout_ref.rollout.checkpoint_engine.backend``: ``nccl`` on GPUs, ``shm``
    on a CPU preset, verl patch 0035). Every sample is
    exactly one policy version old (the staleness bound is 1 by construction).
``fully_async``
    ``python -m verl.experimental.fully_async_policy.fully_async_main
    --config-name=fully_async_ppo_megatron_trainer``: a rollouter streams samples into a message queue and the
    trainer consumes them; weights are synced every ``async_training.trigger_parameter_sync_step`` trainer
    steps, and at most ``staleness_threshold`` x (a sync window's samples) may come from older weights
    (``async_training.staleness_threshold``; verl logs ``fully_async/count/stale_trajectory_processed`` and
    ``fully_async/partial/max_partial_span`` per step).

Both off-policy modes need ``hybrid_engine: false`` (verl asserts it), separate rollout and trainer resources
(the preset's ``off_policy`` section splits the hardware) and get rollout correction: TIS is the default
(:mod:`dsv3_rl.recipes.rollout_correction`; decoupled, so the trainer's recomputed ``old_log_prob`` is the PPO
anchor and ``min(p_old / p_rollout, 2)`` weights each token: it corrects both the engine mismatch and the
one-version lag). ``rollout_correction: none`` is refused for them. R3 (``router_replay: R3``) replays the
routes vLLM returned with each sample, so a stale sample is replayed with the routes of the engine version
that produced it.

``algorithm`` (:data:`ALGORITHMS`):

``grpo``
    verl's defaults under the preset's ``verl:`` keys (group-normalised advantages, PPO-clip ``vanilla`` loss).
``dapo``
    DAPO (arXiv 2503.14476): dynamic sampling (``algorithm.filter_groups``: groups whose rewards all agree carry
    no GRPO signal and are evicted and refilled by verl's v1 ReplayBuffer), clip-higher
    (``clip_ratio_high: 0.28`` over ``clip_ratio_low: 0.2``), token-level loss aggregation, no KL, and overlong
    reward shaping (verl's ``dapo`` reward manager, ``reward.reward_kwargs.overlong_buffer_cfg``: a response
    in the last ``len`` tokens before ``max_resp_len`` loses up to ``penalty_factor``).
``gspo``
    GSPO (arXiv 2507.18071): the importance ratio is the sequence likelihood ratio (length-normalised), clipped
    per sequence (``actor.policy_loss.loss_mode: gspo``, clip range 3e-4 / 4e-4, ``seq-mean-token-mean``).
    Sequence-level ratios are what MoE models need when single tokens' expert choices flip.
``cispo``
    CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached, and multiplies the
    log-prob gradient of *every* token (``loss_mode: cispo``): no token's gradient is dropped by the clip.
    ``clip_ratio_low: 1.0`` (no lower bound, as MiniMax), ``clip_ratio_high: 0.28``.

Combinations verl 0.9.1 cannot run are refused in one line (:func:`choose`): DAPO's group filter is read only
by the v1 trainer's ReplayBuffer (verl/trainer/ppo/v1/trainer_base.py), which the experimental one-step-off and
fully-async trainers do not use; fully-async on a CPU preset is refused (not run on CPU: its rollouter and
trainer need their own resource pools and the CPU demo's 2 cores; one-step-off runs there with the ``shm``
checkpoint engine).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

import pydantic

from dsv3_rl.errors import Dsv3Error, close
from dsv3_rl.verl_glue.trainer_modes import DEFAULT_MODE, MODES, TrainerMode


class AlgorithmError(Dsv3Error, ValueError):
    """A trainer mode / algorithm choice that verl 0.9.1 cannot run (one line naming the key)."""


A = "actor_rollout_ref.actor"

#: name -> verl keys (nested, verl's key space). DAPO's overlong ``len`` is filled in by :func:`verl_tree`.
ALGORITHMS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dapo": {
        "algorithm": {"filter_groups": {"enable": True, "metric": "reward", "max_num_gen_batches": 0},
                      "use_kl_in_reward": False},
        "actor_rollout_ref": {"actor": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean",
                                        "use_kl_loss": False, "policy_loss": {"loss_mode": "vanilla"}}},
        "reward": {"reward_manager": {"name": "dapo"},
                   "reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "penalty_factor": 1.0, "log": True},
                                     "max_resp_len": "${data.max_response_length}"}},
    },
    "gspo": {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "gspo"}, "clip_ratio_low": 3e-4,
                                             "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}}},
    "cispo": {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_low": 1.0,
                                              "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"}}},
}
DEFAULT_ALGORITHM = "grpo"
#: DAPO's overlong buffer as a share of max_response_length (the paper: 4096 of 20480)
OVERLONG_SHARE = 0.2
#: GSPO's clip range is on a length-normalised sequence ratio: a value above this is a token-level clip left over
GSPO_CLIP_MAX = 0.01
#: the rollout correction an off-policy mode gets when the preset does not name one
OFF_POLICY_CORRECTION = "tis"
#: the checkpoint engine an off-policy mode gets on a CPU preset (verl patch 0035: files under /dev/shm, one host)
CPU_CHECKPOINT_ENGINE = "shm"
#: verl checkpoint engines whose trainer -> rollout sync carries the refit checksum manifest (dsv3_rl.refit.manifest)
MANIFEST_ENGINES = {"nccl": "patch 0042", "shm": "patch 0035"}

_Count = typing.Annotated[int, pydantic.Field(strict=True, ge=1)]


class OffPolicySection(pydantic.BaseModel):
    """A preset's ``off_policy`` section: how the hardware is split and how stale a sample may be.

    ``rollout_nodes`` x ``rollout_gpus_per_node`` GPUs run the rollout (verl's ``rollout.nnodes`` /
    ``rollout.n_gpus_per_node``); the rest of ``hardware`` trains. Either whole nodes (``rollout_gpus_per_node``
    = ``hardware.gpus_per_node``) or, on one node, part of it. ``staleness_threshold`` and
    ``trigger_parameter_sync_step`` are verl's ``async_training`` keys (fully_async only: one-step-off is
    one version stale by construction)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    rollout_nodes: _Count | None = None
    rollout_gpus_per_node: _Count | None = None
    staleness_threshold: typing.Annotated[float, pydantic.Field(strict=True, ge=0, allow_inf_nan=False)] | None = None
    trigger_parameter_sync_step: _Count | None = None
    partial_rollout: bool | None = None


@dataclasses.dataclass(frozen=True)
class Choice:
    trainer_mode: str
    algorithm: str
    off_policy: dict[str, Any]
    rollout_correction: str

    @property
    def mode(self) -> TrainerMode:
        return MODES[self.trainer_mode]


def _allowed(key: str, value, allowed) -> str:
    return f"{key}={value!r}{close(str(value), allowed)} (allowed: {', '.join(allowed)}; docs/algorithms.md)"


def choose(data: dict, hardware: dict, rollout_correction: str) -> Choice:
    """The preset's (merged) trainer_mode / algorithm / off_policy, checked against each other, the hardware and
    the rollout correction. Raises :class:`AlgorithmError` (one line naming the key and the allowed values)."""
    mode = data.get("trainer_mode")
    mode = DEFAULT_MODE if mode is None else mode
    if not isinstance(mode, str) or mode not in MODES:
        raise AlgorithmError(_allowed("trainer_mode", mode, MODES))
    algo = data.get("algorithm")
    algo = DEFAULT_ALGORITHM if algo is None else algo
    if not isinstance(algo, str) or algo not in ALGORITHMS:
        raise AlgorithmError(_allowed("algorithm", algo, ALGORITHMS))
    if ("entry" in data or "config_name" in data) and mode != DEFAULT_MODE:
        raise AlgorithmError(f"trainer_mode={mode} sets verl's entry point and config "
                             f"({MODES[mode].entry}, {MODES[mode].config_name}); drop the preset's entry/config_name")
    off = dict(data.get("off_policy") or {})
    tm = MODES[mode]
    cpu = hardware.get("gpu") == "cpu"
    if off and not tm.off_policy:
        raise AlgorithmError(f"off_policy is set but trainer_mode={mode} (allowed with: "
                             f"{', '.join(k for k, m in MODES.items() if m.off_policy)})")
    if tm.off_policy and algo == "dapo":
        raise AlgorithmError(f"algorithm=dapo with trainer_mode={mode}: verl 0.9.1 filters groups "
                             "(algorithm.filter_groups) only in the v1 trainer's ReplayBuffer, which the experimental "
                             "off-policy trainers do not use (allowed with dapo: sync)")
    if mode == "fully_async" and cpu:
        raise AlgorithmError("trainer_mode=fully_async on a CPU preset (hardware.gpu=cpu): not supported on CPU "
                             "(its rollouter and trainer need their own resource pools; not run on the CPU demo) "
                             "(allowed on cpu: sync, one_step_off)")
    if mode != "fully_async":
        for k in ("staleness_threshold", "trigger_parameter_sync_step", "partial_rollout"):
            if k in off:
                raise AlgorithmError(f"off_policy.{k} is a fully_async setting; trainer_mode={mode} is one policy "
                                     "version stale by construction (allowed in off_policy: rollout_nodes, "
                                     "rollout_gpus_per_node)")
    if tm.off_policy:
        nodes, gpn = int(hardware["nodes"]), int(hardware["gpus_per_node"])
        rn = off.setdefault("rollout_nodes", 1 if nodes == 1 else max(1, nodes // 2))
        rg = off.setdefault("rollout_gpus_per_node", max(1, gpn // 2) if nodes == 1 else gpn)
        if nodes == 1:
            if rn != 1 or rg >= gpn:
                raise AlgorithmError(f"off_policy: rollout {rn} node(s) x {rg} GPU(s) leaves no trainer GPU on "
                                     f"hardware 1 x {gpn} (on one node: rollout_nodes 1, rollout_gpus_per_node "
                                     f"< {gpn})")
        elif rg != gpn or rn >= nodes:
            raise AlgorithmError(f"off_policy: rollout {rn} node(s) x {rg} GPU(s) on hardware {nodes} x {gpn}: "
                                 f"give the rollout whole nodes (rollout_gpus_per_node {gpn}) and leave the trainer "
                                 f"at least one (rollout_nodes < {nodes})")
        if rollout_correction == "none":
            raise AlgorithmError(f"rollout_correction=none with trainer_mode={mode}: off-policy samples need "
                                 "rollout correction (allowed: tis, seq_tis, mis, icepop; the default is tis)")
    return Choice(mode, algo, off, rollout_correction)


def default_correction(data: dict) -> str | None:
    """The rollout correction a preset gets when it names none: TIS for an off-policy trainer_mode."""
    mode = data.get("trainer_mode")
    if data.get("rollout_correction") is None and isinstance(mode, str) and mode in MODES and MODES[mode].off_policy:
        return OFF_POLICY_CORRECTION
    return None


def pools(choice: Choice, hardware: dict) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """((trainer nodes, GPUs per node), (rollout nodes, GPUs per node) or None for a colocated run)."""
    nodes, gpn = int(hardware["nodes"]), int(hardware["gpus_per_node"])
    if not choice.mode.off_policy:
        return (nodes, gpn), None
    rn, rg = choice.off_policy["rollout_nodes"], choice.off_policy["rollout_gpus_per_node"]
    trainer = (1, gpn - rg) if nodes == 1 else (nodes - rn, gpn)
    return trainer, (rn, rg)


def verl_tree(choice: Choice, hardware: dict, max_response_length: int | None) -> dict:
    """verl override tree for the mode's resources and the algorithm's keys (merged after the layout keys,
    before the preset's ``verl:`` section)."""
    t = copy.deepcopy(ALGORITHMS[choice.algorithm])
    if choice.algorithm == "dapo" and max_response_length:
        t["reward"]["reward_kwargs"]["overlong_buffer_cfg"]["len"] = max(1, int(max_response_length * OVERLONG_SHARE))
    (tn, tg), rollout = pools(choice, hardware)
    t.setdefault("trainer", {}).update(nnodes=tn, n_gpus_per_node=tg)
    if rollout is not None:
        t["rollout"] = {"nnodes": rollout[0], "n_gpus_per_node": rollout[1]}
        t.setdefault("actor_rollout_ref", {})["hybrid_engine"] = False
        if hardware.get("gpu") == "cpu":   # verl's cross-process engines are CUDA-only: patch 0035's shm engine
            t["actor_rollout_ref"]["rollout"] = {"checkpoint_engine": {"backend": CPU_CHECKPOINT_ENGINE}}
        if choice.trainer_mode == "fully_async":
            a = {k: choice.off_policy[k] for k in ("staleness_threshold", "trigger_parameter_sync_step",
                                                   "partial_rollout") if k in choice.off_policy}
            if a:
                t["async_training"] = a
    return t


# ----------------------------------------------------------------------------- after composition

def _sel(cfg, key, default=None):
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key, default=default)
    return default if v is None else v


#: ``algorithm.filter_groups.metric`` values verl 0.9.1's ReplayBuffer can read for the launcher's reward: ``reward``
#: (the summed token rewards) or a numeric key of ``reward_extra_info``: the reward function's (``score``, ``acc``;
#: dsv3_rl.reward.math_reward's ``pred`` is text) and the DAPO reward manager's overlong ones when that is enabled
DAPO_METRICS = ("reward", "score", "acc")
DAPO_OVERLONG_METRICS = ("overlong_reward", "overlong")
#: advantage estimators whose baseline is the other samples of the prompt's group: with ``rollout.n`` 1 every
#: advantage is 0 (verl trains on nothing and says nothing)
GROUP_ESTIMATORS = ("grpo", "grpo_passk", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg")


def check_config(cfg, choice: Choice) -> list[str]:
    """What the composed config must still say for CHOICE after the preset's ``verl:`` keys and the command line
    (each a one-line error naming the key): a planted-fault twin for each lives in
    tests/unit/test_launch_algorithms.py."""
    errs = []
    loss = str(_sel(cfg, f"{A}.policy_loss.loss_mode", "vanilla"))
    low, high = _sel(cfg, f"{A}.clip_ratio_low"), _sel(cfg, f"{A}.clip_ratio_high")
    if choice.algorithm == "dapo":
        if not _sel(cfg, "algorithm.filter_groups.enable", False) or not _sel(cfg, "algorithm.filter_groups.metric"):
            errs.append("algorithm=dapo but algorithm.filter_groups.enable is false (or its metric unset): "
                        "zero-variance groups (all rewards equal, advantage 0) would be trained on; DAPO evicts them")
        metric = _sel(cfg, "algorithm.filter_groups.metric")
        ob_on = bool((_sel(cfg, "reward.reward_kwargs.overlong_buffer_cfg") or {}).get("enable"))
        known = DAPO_METRICS + (DAPO_OVERLONG_METRICS if ob_on else ())
        if metric and str(metric) not in known:
            errs.append(f"algorithm.filter_groups.metric={metric!r} is not a metric the reward gives (one of: "
                        f"{', '.join(known)}); verl would raise at step 1, after the start-up")
        if low is None or high is None or not float(high) > float(low):
            errs.append(f"algorithm=dapo needs clip-higher: actor.clip_ratio_high ({high}) > clip_ratio_low ({low})")
        if str(_sel(cfg, "reward.reward_manager.name")) != "dapo":
            errs.append(f"algorithm=dapo needs reward.reward_manager.name=dapo (overlong shaping), got "
                        f"{_sel(cfg, 'reward.reward_manager.name')!r}")
        ob = _sel(cfg, "reward.reward_kwargs.overlong_buffer_cfg") or {}
        mx = _sel(cfg, "reward.reward_kwargs.max_resp_len")
        resp = _sel(cfg, "data.max_response_length")
        if ob.get("enable"):
            if mx != resp:
                errs.append(f"reward.reward_kwargs.max_resp_len={mx} differs from data.max_response_length={resp}")
            elif not (0 < int(ob.get("len") or 0) < int(resp)):
                errs.append(f"reward.reward_kwargs.overlong_buffer_cfg.len={ob.get('len')} must be in "
                            f"(0, data.max_response_length={resp})")
    elif choice.algorithm in ("gspo", "cispo") and loss != choice.algorithm:
        errs.append(f"algorithm={choice.algorithm} but actor.policy_loss.loss_mode={loss!r}")
    elif choice.algorithm == "gspo" and max(float(low or 0), float(high or 0)) > GSPO_CLIP_MAX:
        errs.append(f"algorithm=gspo with actor.clip_ratio_low/high = {low}/{high}: GSPO clips the length-normalised "
                    f"sequence ratio, whose range is ~1e-3 (the paper: 3e-4/4e-4); token-level values "
                    f"(> {GSPO_CLIP_MAX}) leave it unclipped (a base preset's clip-higher?)")
    est, n = str(_sel(cfg, "algorithm.adv_estimator", "")), _sel(cfg, "actor_rollout_ref.rollout.n", 1)
    if est in GROUP_ESTIMATORS and int(n) < 2:
        errs.append(f"actor_rollout_ref.rollout.n={n} with algorithm.adv_estimator={est}: the advantage is a sample's "
                    f"reward against its group's, so every advantage would be 0; set rollout.n >= 2")
    if choice.algorithm != "dapo" and _sel(cfg, "algorithm.filter_groups.enable", False) and choice.mode.off_policy:
        errs.append(f"algorithm.filter_groups.enable=true with trainer_mode={choice.trainer_mode}: the experimental "
                    "off-policy trainers do not filter groups (verl 0.9.1)")
    if choice.mode.off_policy:
        if _sel(cfg, "actor_rollout_ref.hybrid_engine", True):
            errs.append(f"trainer_mode={choice.trainer_mode} needs actor_rollout_ref.hybrid_engine=false "
                        "(verl asserts it)")
        if not _sel(cfg, "actor_rollout_ref.rollout.calculate_log_probs", False):
            errs.append(f"trainer_mode={choice.trainer_mode} needs actor_rollout_ref.rollout.calculate_log_probs="
                        "true (rollout correction and the staleness metrics use vLLM's log-probs)")
        be = _sel(cfg, "actor_rollout_ref.rollout.checkpoint_engine.backend")
        if str(_sel(cfg, "trainer.device", "")) == "cpu" and be != CPU_CHECKPOINT_ENGINE:
            errs.append(f"trainer_mode={choice.trainer_mode} on CPU with actor_rollout_ref.rollout.checkpoint_engine."
                        f"backend={be!r}: verl's cross-process engines need CUDA (on CPU: {CPU_CHECKPOINT_ENGINE}, "
                        "verl patch 0035)")
        rc = _sel(cfg, "algorithm.rollout_correction") or {}
        if not rc.get("bypass_mode") and rc.get("rollout_is") is None and rc.get("rollout_rs") is None:
            errs.append(f"trainer_mode={choice.trainer_mode} without rollout correction "
                        "(algorithm.rollout_correction.rollout_is and rollout_rs null, bypass_mode false)")
    if choice.trainer_mode == "fully_async":
        st = _sel(cfg, "async_training.staleness_threshold")
        if st is None or float(st) < 0:
            errs.append(f"async_training.staleness_threshold={st}: the staleness bound must be >= 0")
    return errs


def choice_of(preset) -> Choice:
    """The :class:`Choice` of a loaded :class:`dsv3_rl.recipes.presets.Preset`."""
    return Choice(preset.trainer_mode, preset.algorithm, dict(preset.off_policy), preset.rollout_correction)


def trainer_world(preset) -> int:
    """GPUs (CPU: trainer processes) that train: all of ``hardware`` for sync, the rest after the rollout's
    share for an off-policy mode."""
    (tn, tg), _ = pools(choice_of(preset), preset.hardware)
    return tn * tg


def samples_per_step(cfg, mode: str) -> int | None:
    """Trajectories (responses) one fully-async trainer step consumes: verl's ``required_samples``
    (``ppo_mini_batch_size x async_training.require_batches`` prompts, fully_async_rollouter.py) x ``rollout.n``;
    None for the other modes (their staleness check does not need it)."""
    if mode != "fully_async":
        return None
    mb, rb, n = (_sel(cfg, k) for k in (f"{A}.ppo_mini_batch_size", "async_training.require_batches",
                                         "actor_rollout_ref.rollout.n"))
    return int(mb) * int(rb) * int(n) if mb and rb and n else None


def rollout_world(preset) -> int:
    """GPUs of an off-policy mode's rollout pool (0 for a colocated run)."""
    _, r = pools(choice_of(preset), preset.hardware)
    return r[0] * r[1] if r else 0
