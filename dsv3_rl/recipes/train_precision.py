"""Training precision by name: a preset's ``train_precision: bf16|fp8`` (and ``fp8_recipe``) as verl 0.9.1 keys.

``bf16``
    verl's default: the Megatron actor computes in BF16 (no key emitted).
``fp8``
    FP8 GEMMs through Transformer Engine: megatron-core 0.16.1's ``TransformerConfig.fp8 = "e4m3"`` and
    ``fp8_recipe`` (:data:`RECIPES`), set through verl's ``actor.megatron.override_transformer_config`` (verl passes
    that dict to the TransformerConfig it builds). BF16 master weights, grads and optimizer states stay as they are;
    what FP8 adds and saves in memory is the planner's (``Options.train_precision``, docs/planner.md "FP8
    training"). Needs Transformer Engine on the GPU (the TE spec): refused on a CPU preset (:data:`CPU_REFUSAL`).

Known gap (verl 0.9.1, reported in docs/planner.md): verl's own model builder (``use_mbridge: false``,
``verl/utils/megatron_utils.py:get_model``) sets ``config.fp8 = None`` after building the model, which turns the FP8
autocast of megatron's TransformerBlock (and verl's FP8 padding, ``models/mcore/model_forward.py``) off again; the
Megatron-Bridge / mbridge paths keep it.
"""

from __future__ import annotations

MODES = ("bf16", "fp8")
#: megatron-core 0.16.1 ``fp8_recipe`` values a Hopper GPU runs (megatron/core/enums.py Fp8Recipe; mxfp8 is
#: Blackwell-only, custom is a user class): one list for the preset and the planner (``dsv3_rl.planner.spec.FP8_RECIPES``)
RECIPES = ("delayed", "tensorwise", "blockwise")

#: the mode and recipe a preset without the keys gets
DEFAULT = "bf16"
DEFAULT_RECIPE = "blockwise"
#: the TransformerConfig format for FP8 training: e4m3 for weights, activations and gradients (DeepSeek-V3's choice)
FP8_FORMAT = "e4m3"

OTC_PATH = ("actor_rollout_ref", "actor", "megatron", "override_transformer_config")

CPU_REFUSAL = ("FP8 training runs Transformer Engine's FP8 GEMMs, which need an NVIDIA GPU (Hopper or newer) with TE "
               "installed (docs/gpu-setup.md)")


def verl_tree(mode: str, recipe: str | None = None) -> dict:
    """verl override tree for MODE (``{}`` for ``bf16``); ``recipe`` defaults to :data:`DEFAULT_RECIPE`."""
    if mode not in MODES:
        raise ValueError(f"train_precision={mode!r} (allowed: {', '.join(MODES)})")
    recipe = recipe or DEFAULT_RECIPE
    if recipe not in RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r} (allowed on Hopper with megatron-core 0.16.1: {', '.join(RECIPES)})")
    if mode == "bf16":
        return {}
    tree: dict = {"fp8": FP8_FORMAT, "fp8_recipe": recipe}
    for k in reversed(OTC_PATH):
        tree = {k: tree}
    return tree


def planner_options(otc: dict) -> dict:
    """The planner's Options fields for a composed ``override_transformer_config`` (the dry-run's memory check)."""
    if otc.get("fp8") in (None, False):
        return {}
    return {"train_precision": "fp8", "fp8_recipe": str(otc.get("fp8_recipe") or "delayed"),
            "fp8_param": bool(otc.get("fp8_param", False)), "transformer_impl": "transformer_engine"}
