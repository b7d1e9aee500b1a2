"""Rollout weights by name: a preset's ``rollout_quantization: none|fp8`` as verl 0.9.1 keys.

``none``
    vLLM serves the trainer's BF16 weights (verl's default, ``rollout.quantization: null``).
``fp8``
    ``actor_rollout_ref.rollout.quantization: fp8``: at every refit the trainer sends BF16 and verl's vLLM worker
    quantizes each weight whose vLLM layer is FP8 (``verl/utils/vllm/vllm_quant_utils.py``, 128 x 128 blocks,
    ``<name>_scale_inv`` in fp32; verl's server declares the config, router gates ignored) and vLLM runs FP8 GEMMs
    on them. The set of FP8 tensors is that of DeepSeek's FP8 release (:mod:`dsv3_rl.refit.fp8_layout`; router
    gate, norms, embeddings and lm_head stay BF16; ``tests/unit/test_refit_fp8.py``). verl patch 0030 makes the
    name-based quantizer of the sglang/trtllm rollouts (``verl/utils/fp8_utils.py``) pick the same set. The planner
    counts the rollout weights the same way (:func:`dsv3_rl.planner.memory.rollout_weight_bytes`), so the
    KV cache gets the memory FP8 frees. GPU only: refused on a CPU preset (:data:`CPU_REFUSAL`).
"""

from __future__ import annotations

import copy
from typing import Any

MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "fp8": {"actor_rollout_ref": {"rollout": {"quantization": "fp8"}}},
}

#: the mode a preset without ``rollout_quantization`` gets
DEFAULT = "none"

#: why ``fp8`` is refused on a CPU preset (docs/refit.md, "Two hazards of verl's quantizer")
CPU_REFUSAL = ("verl's FP8 quantizer (verl/utils/fp8_utils.py) needs a CUDA device: without one its Triton path fails "
               "and it silently sends the weights in BF16 next to a config that declares them FP8 (docs/refit.md); "
               "vLLM's CPU MLA backend also packs BF16 weights only")


def verl_tree(mode: str) -> dict:
    """verl override tree (nested dict in verl's config key space) for MODE; ``{}`` for ``none``."""
    if mode not in MODES:
        raise ValueError(f"rollout_quantization={mode!r} (allowed: {', '.join(MODES)})")
    return copy.deepcopy(MODES[mode])
