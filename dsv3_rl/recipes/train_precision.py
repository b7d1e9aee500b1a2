"""Training precision by name: a preset's ``train_precision: bf16|fp8|fp32|auto`` (and ``fp8_recipe``) as verl 0.9.1 keys.

``bf16``
    verl's default: the Megatron actor computes in BF16 (no key emitted).
``fp32``
    No mixed precision: the Megatron actor (and reference) hold and compute FP32 params (``actor.megatron.dtype:
    float32``, verl patch 0038; megatron-core's FP32Optimizer). For CPUs that have no native BF16.
``auto``
    ``bf16`` on a GPU and on a CPU with native BF16 (:data:`NATIVE_BF16_FLAGS`: AVX512-BF16 or AMX), else ``fp32``
    (:func:`resolve`; the launcher reads the CPU's flags and prints the choice). Measured 2026-11-28 on a 2-core AMD
    EPYC with AVX2 only: torch's BF16 GEMMs ran at 1.1 GFLOP/s against 64.5 in FP32, and the CPU demo's step took
    30-35 s in BF16 against 12-21 s with the trainer in FP32 (docs/ci-history.md).
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

MODES = ("bf16", "fp8", "fp32", "auto")
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


#: /proc/cpuinfo flags of a CPU that computes BF16 natively (AVX512-BF16: Cooper Lake, Sapphire Rapids, Zen 4;
#: AMX-BF16: Sapphire Rapids). Without them torch's BF16 GEMMs on the CPU are emulated (see ``auto`` above).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (empty when it has no flags line)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def resolve(mode: str, is_cpu: bool, flags: frozenset[str]) -> tuple[str, str]:
    """The concrete mode (``bf16``, ``fp8`` or ``fp32``) of MODE on this host, and why, for ``auto`` (else '')."""
    if mode != "auto":
        return mode, ""
    if not is_cpu:
        return "bf16", "auto: a GPU"
    native = sorted(set(NATIVE_BF16_FLAGS) & flags)
    if native:
        return "bf16", f"auto: this CPU computes BF16 natively ({', '.join(native)})"
    return "fp32", (f"auto: this CPU has no native BF16 (none of {', '.join(NATIVE_BF16_FLAGS)}): BF16 GEMMs are "
                    f"emulated there, FP32 is several times faster")


def verl_tree(mode: str, recipe: str | None = None) -> dict:
    """verl override tree for the concrete MODE (``{}`` for ``bf16``; ``auto`` is :func:`resolve`'d first);
    ``recipe`` defaults to :data:`DEFAULT_RECIPE`."""
    if mode not in MODES or mode == "auto":
        raise ValueError(f"train_precision={mode!r} (allowed: {', '.join(m for m in MODES if m != 'auto')}; "
                         f"resolve 'auto' first)")
    recipe = recipe or DEFAULT_RECIPE
    if recipe not in RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r} (allowed on Hopper with megatron-core 0.16.1: {', '.join(RECIPES)})")
    if mode == "bf16":
        return {}
    if mode == "fp32":  # verl patch 0038; the reference model's dtype is its own key (not interpolated from the actor's)
        return {"actor_rollout_ref": {"actor": {"megatron": {"dtype": "float32"}},
                                      "ref": {"megatron": {"dtype": "float32"}}}}
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
