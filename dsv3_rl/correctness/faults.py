"""Planted faults: deliberate, documented breakages that must turn the overall result into FAIL.

Each fault is one explicit transformation of the candidate (never of the reference):

=============================  ==========================================================================
swap-experts                   experts 0 and 1 of the first MoE layer swap weights in the converted
                               megatron checkpoint (a converter that mixes up expert ids)
router-bias                    every MoE layer's ``router.expert_bias`` (HF ``e_score_correction_bias``)
                               gets N(0, 0.05) added in the converted checkpoint
yarn-mscale                    megatron built with ``mscale_all_dim=0`` (its default) instead of the
                               config's value: wrong softmax scale and rope attention factor
no-group-routing               megatron built without group-limited routing
                               (``moe_router_num_groups=None``, ``moe_router_group_topk=None``)
mla-tp-grad-patch-reverted     megatron patch 0003 (MLA rope-key gradient summed over TP) reversed in a
                               scratch copy of the patched tree; runs a TP>1 layout (adds tp2_sp)
mla-down-proj-patch-reverted   megatron patch 0001 (TE spec: column-parallel q/kv down-projections) reversed
                               in a scratch tree; TE spec only (--spec te), at tp2_nosp_dense (TP2, no SP, an
                               all-dense model, which megatron trains): the duplicated TELinear path leaves the
                               rope-key gradient a per-rank partial sum over heads (Megatron-LM #1699 on the path
                               patch 0003 does not cover). With SP on, the sequence gather's reduce-scatter sums
                               it and the duplicated weights are all-reduced over TP, so tp2_sp is expected to PASS.
rope-interleave-false          the HF config says ``rope_interleave=False``, which megatron-core cannot
                               express: the config mapping must refuse it (FAIL, never PASS)
rope-interleave-false-unchecked  the same, but the candidate is built as if the key had been ignored
                               (what a converter without the check does): the numbers must FAIL
=============================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    description: str
    catches: str
    """which checks are expected to fail (documentation; the tests assert the overall FAIL)"""
    weight_edit: Callable[[dict[str, torch.Tensor]], list[str]] | None = None
    mcore_config_overrides: dict = dataclasses.field(default_factory=dict)
    hf_config_overrides: dict = dataclasses.field(default_factory=dict)
    """applied to the HF config of the reference (and, unless ``candidate_ignores_hf_overrides``,
    of the candidate, whose config mapping then has to cope with it)"""
    candidate_ignores_hf_overrides: bool = False
    revert_patch: str | None = None
    needs_tp: bool = False
    needs_te: bool = False
    """only meaningful on the Transformer Engine spec (``--spec te``)"""
    layout: str | None = None
    """the named layout the fault is planted at (default: the run's first layout, tp2_sp for needs_tp)"""
    needs_moe: bool = False
    """acts on MoE layers (not planted at a layout whose model variant is all dense)"""


def _moe_layers(sd: dict[str, torch.Tensor]) -> list[int]:
    return sorted({int(m.group(1)) for k in sd for m in [re.match(r"decoder\.layers\.(\d+)\.mlp\.router\.weight$", k)] if m})


def swap_experts(sd: dict[str, torch.Tensor]) -> list[str]:
    layer = _moe_layers(sd)[0]
    changed = []
    for w in ("linear_fc1.weight", "linear_fc2.weight"):
        a = f"decoder.layers.{layer}.mlp.experts.local_experts.0.{w}"
        b = f"decoder.layers.{layer}.mlp.experts.local_experts.1.{w}"
        if a not in sd or b not in sd:
            raise KeyError(f"swap-experts: {a} / {b} not in the checkpoint (grouped-GEMM experts are not handled)")
        ta = sd[a].clone()
        sd[a].copy_(sd[b])
        sd[b].copy_(ta)
        changed += [a, b]
    return changed


def perturb_router_bias(sd: dict[str, torch.Tensor]) -> list[str]:
    g = torch.Generator().manual_seed(5)
    changed = []
    for layer in _moe_layers(sd):
        k = f"decoder.layers.{layer}.mlp.router.expert_bias"
        if k not in sd:
            raise KeyError(f"router-bias: {k} not in the checkpoint")
        sd[k].add_((torch.randn(sd[k].shape, generator=g) * 0.05).to(sd[k].device, sd[k].dtype))
        changed.append(k)
    return changed


MLA_TP_PATCH = "0003-mla-rope-key-grad-sum-over-tp.patch"
TE_DOWN_PROJ_PATCH = "0001-te-spec-mla-down-proj-column-parallel.patch"

FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("swap-experts", "experts 0 and 1 of the first MoE layer swapped in the converted checkpoint",
          "MOE routed output (and everything downstream), their expert gradients", weight_edit=swap_experts,
          needs_moe=True),
    Fault("router-bias", "router expert_bias (e_score_correction_bias) + N(0, 0.05) in the converted checkpoint",
          "router top-k agreement, routed output", weight_edit=perturb_router_bias, needs_moe=True),
    Fault("yarn-mscale", "megatron config built with mscale_all_dim=0 (yarn softmax scale / rope factor wrong)",
          "attention output of every layer", mcore_config_overrides={"mscale_all_dim": 0.0}),
    Fault("no-group-routing", "megatron config built without group-limited routing",
          "router top-k agreement", mcore_config_overrides={"moe_router_num_groups": None, "moe_router_group_topk": None},
          needs_moe=True),
    Fault("mla-tp-grad-patch-reverted", f"megatron patch {MLA_TP_PATCH} reversed (scratch copy), TP>1 layout",
          "gradients of linear_kv_down_proj (kv_a_proj_with_mqa) and everything upstream", revert_patch=MLA_TP_PATCH,
          needs_tp=True),
    Fault("mla-down-proj-patch-reverted", f"megatron patch {TE_DOWN_PROJ_PATCH} reversed (scratch copy): the TE "
          "spec's q/kv down-projections are TP-duplicated TELinear again; TE spec, TP2 without SP, dense model",
          "gradients of kv_a_proj_with_mqa (its rope rows: each TP rank's k_pos_emb gradient only sums its own "
          "heads, and the duplicated path has no TP reduction for it) and everything upstream",
          revert_patch=TE_DOWN_PROJ_PATCH, needs_tp=True, needs_te=True, layout="tp2_nosp_dense"),
    Fault("rope-interleave-false", "HF config rope_interleave=False (megatron-core MLA cannot express it)",
          "config mapping refuses it", hf_config_overrides={"rope_interleave": False}),
    Fault("rope-interleave-false-unchecked", "HF rope_interleave=False, candidate built as if the key were ignored",
          "attention output", hf_config_overrides={"rope_interleave": False}, candidate_ignores_hf_overrides=True),
]}


def get(name: str) -> Fault:
    if name not in FAULTS:
        raise KeyError(f"unknown planted fault {name!r} (allowed: {', '.join(FAULTS)})")
    return FAULTS[name]


def tree_without(patch_name: str, dest: Path) -> Path:
    """A copy of the megatron tree in use with one series patch reversed; put ``dest`` first on
    PYTHONPATH. The real backend is never touched."""
    import megatron.core

    from dsv3_rl.backends import load_lock
    from dsv3_rl.patching import lint

    patches = {p.name: p for p in lint(load_lock()["megatron-core"], headers=False)}
    if patch_name not in patches:
        raise KeyError(f"{patch_name} is not in the megatron-core series (have: {', '.join(patches)})")
    src = Path(megatron.core.__file__).resolve().parents[1]  # .../megatron
    dest.mkdir(parents=True, exist_ok=True)
    if (dest / "megatron").exists():
        shutil.rmtree(dest / "megatron")
    shutil.copytree(src, dest / "megatron", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    # GIT_CEILING_DIRECTORIES: never let git find an enclosing repository and re-root the paths.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.resolve().parent)}
    r = subprocess.run(["git", "apply", "-R", str(patches[patch_name].path)], cwd=dest, check=False, capture_output=True, text=True,
                       env=env)
    if r.returncode:
        raise RuntimeError(f"could not reverse {patch_name} in the scratch copy {dest}: {r.stderr.strip()}")
    return dest
