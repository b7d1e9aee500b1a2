"""verl's layout of one saved checkpoint step (``trainer.default_local_dir/global_step_N``): where the actor's model
dist checkpoint is. Read by the GRPO self-checks (:mod:`dsv3_rl.grpo.checks`); the launcher's resume and
verification of whole steps is :mod:`dsv3_rl.launch.ckpt`.
"""

from __future__ import annotations

import json
from pathlib import Path


def model_dir(step_dir: Path) -> Path:
    """The actor's model dist checkpoint of one step, by verl's own layout: ``actor/ckpt_contents.json``'s
    ``contents.model.path`` when it is there, else verl's layout-v2 path ``actor/model/dist_ckpt``."""
    actor = Path(step_dir) / "actor"
    try:
        rel = json.loads((actor / "ckpt_contents.json").read_text())["contents"]["model"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        rel = "model/dist_ckpt"
    return actor / rel
