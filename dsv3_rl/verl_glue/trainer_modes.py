"""verl's trainer entry points by name (a preset's ``trainer_mode``): which module ``python -m`` runs, which Hydra
config it composes and where that config lives in the verl package (:data:`MODES`), and the Hydra arguments the
off-policy entry points need. Upstream glue for verl: the recipes (:mod:`dsv3_rl.recipes.algorithms`) choose a
mode, :mod:`dsv3_rl.verl_glue.compose` composes its config (``hydra_args``, ``config_search``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainerMode:
    entry: str
    """the module ``python -m`` runs"""
    config_name: str
    """verl's Hydra config (``--config-name``)"""
    config_dir: str | None
    """the directory of CONFIG_NAME inside the verl package; None: verl/trainer/config"""
    off_policy: bool


MODES: dict[str, TrainerMode] = {
    "sync": TrainerMode("verl.trainer.main_ppo", "ppo_megatron_trainer", None, False),
    "one_step_off": TrainerMode("verl.experimental.one_step_off_policy.main_ppo", "one_step_off_ppo_megatron_trainer",
                                "experimental/one_step_off_policy/config", True),
    "fully_async": TrainerMode("verl.experimental.fully_async_policy.fully_async_main",
                               "fully_async_ppo_megatron_trainer", "experimental/fully_async_policy/config", True),
}
DEFAULT_MODE = "sync"
