"""The one place the suite touches the project's HF <-> megatron converter (``dsv3_rl.convert``).

* Candidate weights: ``dsv3_rl.convert.weights.hf_to_mcore`` writes the megatron dist checkpoint
  (global tensors, loads at any layout) from the HF safetensors.
* Gradient names: the worker saves the gradients as a dist checkpoint sharded exactly like the
  weights, at whatever layout it ran; ``dsv3_rl.convert.weights.mcore_to_hf`` turns that into HF
  safetensors under hub names, like any training checkpoint. Every step of the mapping is a rename,
  split, concatenation or slice, all linear, so gradients map exactly like weights. No second
  mapping table lives in the suite.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsv3_rl.convert import weights

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def hf_to_mcore(hf_path: Path, out: Path, dtype: torch.dtype) -> Path:
    """Convert the HF checkpoint into a megatron dist checkpoint at ``out`` (loads at any layout)."""
    weights.hf_to_mcore(Path(hf_path), Path(out), dtype=DTYPE_NAMES[dtype], progress=False)
    return Path(out)


def grads_to_hf(grads_dir: Path, out: Path, hf_path: Path) -> dict[str, torch.Tensor]:
    """A gradient dist checkpoint (any layout) -> {HF hub name: fp32 gradient}, through the converter.
    Entries that are buffers on the HF side (``e_score_correction_bias``: the saved tensor is the
    router's expert_bias, not a gradient) are returned too; the caller keeps HF parameters only."""
    from safetensors.torch import load_file

    weights.mcore_to_hf(Path(grads_dir), Path(out), hf_dir=Path(hf_path), progress=False)
    grads: dict[str, torch.Tensor] = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        grads.update({k: v.float() for k, v in load_file(str(f)).items()})
    return grads
