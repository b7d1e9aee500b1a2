"""megatron-core's ``pipeline_model_parallel_layout`` survives verl's ``use_mbridge=False`` path.

The 671B preset passes ``override_transformer_config.pipeline_model_parallel_layout="Et|(tt|)*30L"`` to
verl; verl's engine builds the TransformerConfig with ``verl.models.mcore.hf_to_mcore_config(hf_config,
dtype, **override_transformer_config)`` (our patch 0001 routes DeepSeek-V3 through the project's
mapping), the model with ``make_megatron_module`` -> ``init_mcore_model`` (megatron-core GPTModel, the
local layer spec without TE), and names exported weights with ``normalize_model_name`` ->
``megatron_utils.get_transformer_layer_offset``.

Here, over gloo with 2 processes (PP=2) and the tiny DeepSeek-V3 (4 decoder layers, layer 1 dense), the
layout "Et|tttL" must give: PP rank 0 = embedding + decoder layer 1 (dense), PP rank 1 = layers 2..4
(MoE) + output layer, in the config's parsed layout, in the GPTModel each rank builds (global
``layer_number`` of each decoder layer), in verl's layer-offset helper and in verl's exported names.
Planted-fault twin: the same run with the override dropped (megatron's even 2/2 split) must be
rejected by the same checker.

The worker is this file run under torchrun (``python -m torch.distributed.run ... THIS_FILE OUT``);
both cases run in one launch (two ~10 s imports of verl + megatron per process on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PP = 2
# one torchrun launch of 2 processes (~45 s on 2 cores) shared by the check and its twin
pytestmark = pytest.mark.slow


def layout_for(num_layers: int) -> str:
    """Stage 0 = embedding + 1 decoder layer, stage 1 = the remaining layers + loss."""
    return f"Et|{'t' * (num_layers - 1)}L"


def expected_stages(num_layers: int, first_k_dense: int) -> list[dict]:
    """What each PP rank must hold under ``layout_for(num_layers)`` (1-based global layer numbers)."""

    def kinds(numbers):
        return ["dense" if n <= first_k_dense else "moe" for n in numbers]

    rank0, rank1 = [1], list(range(2, num_layers + 1))
    return [
        dict(pp_rank=0, layers=rank0, kinds=kinds(rank0), offset=0, pre=True, post=False),
        dict(pp_rank=1, layers=rank1, kinds=kinds(rank1), offset=1, pre=False, post=True),
    ]


def stage_mismatches(reports: list[dict], expected: list[dict]) -> list[str]:
    """Every way the per-rank reports of the worker differ from ``expected`` (empty = all agree)."""
    counts = [len(e["layers"]) for e in expected]
    offsets = [e["offset"] for e in expected]
    bad = []
    if sorted(r["pp_rank"] for r in reports) != [e["pp_rank"] for e in expected]:
        return [f"PP ranks reported {[r['pp_rank'] for r in reports]}, expected {[e['pp_rank'] for e in expected]}"]
    for r in sorted(reports, key=lambda r: r["pp_rank"]):
        e = expected[r["pp_rank"]]
        where = f"PP rank {r['pp_rank']}"
        if r["layout_type"] != "PipelineParallelLayerLayout":
            bad.append(f"{where}: TransformerConfig.pipeline_model_parallel_layout is {r['layout_type']} "
                       f"({r['layout']!r}), not a parsed PipelineParallelLayerLayout")
        else:
            if r["layout_counts"] != counts:
                bad.append(f"{where}: layout.get_num_layers_to_build per PP rank {r['layout_counts']}, expected {counts}")
            if r["layout_offsets"] != offsets:
                bad.append(f"{where}: layout.get_layer_offset per PP rank {r['layout_offsets']}, expected {offsets}")
        if r["layer_numbers"] != e["layers"]:
            bad.append(f"{where}: GPTModel decoder layer numbers {r['layer_numbers']}, expected {e['layers']}")
        if r["kinds"] != e["kinds"]:
            bad.append(f"{where}: decoder layer MLP kinds {r['kinds']}, expected {e['kinds']}")
        if (r["pre"], r["post"]) != (e["pre"], e["post"]):
            bad.append(f"{where}: (embedding, output_layer) present = {(r['pre'], r['post'])}, expected {(e['pre'], e['post'])}")
        if r["mcore_offset"] != e["offset"]:
            bad.append(f"{where}: megatron get_transformer_layer_offset {r['mcore_offset']}, expected {e['offset']}")
        if r["verl_offset"] != e["offset"]:
            bad.append(f"{where}: verl megatron_utils.get_transformer_layer_offset({r['pp_rank']}, None, cfg) = "
                       f"{r['verl_offset']}, expected {e['offset']}")
        want_names = [f"decoder.layers.{n - 1}.mlp.linear_fc2.weight" if k == "dense"
                      else f"decoder.layers.{n - 1}.mlp.router.weight" for n, k in zip(e["layers"], e["kinds"])]
        if r["verl_names"] != want_names:
            bad.append(f"{where}: verl normalize_model_name gives {r['verl_names']}, expected {want_names}")
    return bad


def assert_stages(reports: list[dict], expected: list[dict]) -> None:
    bad = stage_mismatches(reports, expected)
    assert not bad, "pipeline layout not carried through verl:\n  " + "\n  ".join(bad)


# --------------------------------------------------------------------------- launcher (pytest side)

@pytest.fixture(scope="module")
def worker_reports(tmp_path_factory):
    import megatron.core  # noqa: F401 - imported, not skipped: a missing or broken backend FAILS (`make setup` installs it)
    import verl  # noqa: F401 - imported, not skipped: a missing or broken backend FAILS (`make setup` installs it)
    from dsv3_rl.ports import free_port

    out = tmp_path_factory.mktemp("verl_pp_layout") / "reports.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(VERL_PLATFORM="cpu", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCHDYNAMO_DISABLE="1")
    # an explicit free port: with --master-port=0 the workers wait forever for the agent store (torch 2.13)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={PP}", f"--master-port={free_port()}",
           __file__, str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(out.read_text())


def test_layout_override_carried_through_verl(worker_reports):
    rep = worker_reports
    assert rep["layout"] == layout_for(rep["num_layers"]) == "Et|tttL", rep["layout"]
    assert_stages(rep["cases"]["layout"], expected_stages(rep["num_layers"], rep["first_k_dense"]))


def test_planted_fault_override_dropped_is_caught(worker_reports):
    """Twin: without the override megatron splits evenly (2/2); the same checker must reject it."""
    rep = worker_reports
    even = rep["cases"]["even"]
    with pytest.raises(AssertionError, match="pipeline layout not carried through verl"):
        assert_stages(even, expected_stages(rep["num_layers"], rep["first_k_dense"]))
    bad = stage_mismatches(even, expected_stages(rep["num_layers"], rep["first_k_dense"]))
    # the fault is seen where it matters: in the built model and in verl's offsets, not only in the config
    assert "PP rank 0: GPTModel decoder layer numbers [1, 2], expected [1]" in bad, bad
    assert "PP rank 1: GPTModel decoder layer numbers [3, 4], expected [2, 3, 4]" in bad, bad
    assert any(m.startswith("PP rank 1: verl megatron_utils.get_transformer_layer_offset") for m in bad), bad
    assert any("not a parsed PipelineParallelLayerLayout" in m for m in bad), bad


# --------------------------------------------------------------------------- worker (torchrun side)

def _worker(out_path: str) -> None:
    import torch

    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset as mcore_offset

    from dsv3_rl.models.presets import hf_config
    from verl.models.mcore import hf_to_mcore_config
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, get_transformer_layer_offset, make_megatron_module
    from verl.utils.model import normalize_model_name

    mpu.initialize_model_parallel(pipeline_model_parallel_size=PP)
    model_parallel_cuda_manual_seed(0)
    pp_rank = mpu.get_pipeline_model_parallel_rank()
    hf = hf_config("tiny")
    hf.architectures = ["DeepseekV3ForCausalLM"]
    layout = layout_for(hf.num_hidden_layers)
    # CPU engine settings, as tests/unit/verl_cpu_export_worker.py passes them
    cpu = dict(attention_backend=AttnBackend.local, use_cpu_initialization=True, moe_grouped_gemm=False,
               moe_shared_expert_overlap=False, apply_rope_fusion=False, bias_activation_fusion=False,
               bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
               gradient_accumulation_fusion=False)
    cases = {}
    for case, extra in (("layout", {"pipeline_model_parallel_layout": layout}), ("even", {})):
        tf = hf_to_mcore_config(hf, torch.bfloat16, **cpu, **extra)
        if not tf.mtp_num_layers:  # as verl's engine without a bridge does (patch 0014)
            tf.mtp_num_layers = None
        module, tf = make_megatron_module(McoreModuleWrapperConfig(wrap_with_ddp=False), tf, hf)
        model = module[0]
        while hasattr(model, "module"):
            model = model.module
        lay = tf.pipeline_model_parallel_layout
        parsed = type(lay).__name__ == "PipelineParallelLayerLayout"
        layers = list(model.decoder.layers)
        local_names = [f"decoder.layers.{i}.mlp.{'router' if hasattr(lyr.mlp, 'router') else 'linear_fc2'}.weight"
                       for i, lyr in enumerate(layers)]
        cases[case] = dict(
            pp_rank=pp_rank,
            layout=str(lay) if lay is not None else None,
            layout_type=type(lay).__name__,
            layout_counts=[lay.get_num_layers_to_build(pp_rank=r) for r in range(PP)] if parsed else None,
            layout_offsets=[lay.get_layer_offset(pp_rank=r) for r in range(PP)] if parsed else None,
            layer_numbers=[lyr.layer_number for lyr in layers],
            kinds=["moe" if hasattr(lyr.mlp, "router") else "dense" for lyr in layers],
            pre=model.pre_process and hasattr(model, "embedding"),
            post=model.post_process and hasattr(model, "output_layer"),
            mcore_offset=mcore_offset(tf),
            verl_offset=get_transformer_layer_offset(pp_rank, None, tf),
            verl_names=[normalize_model_name(n, pp_rank, None, tf) for n in local_names],
        )
        del module, model
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, cases)
    if torch.distributed.get_rank() == 0:
        rep = {"layout": layout, "num_layers": hf.num_hidden_layers, "first_k_dense": hf.first_k_dense_replace,
               "cases": {c: [g[c] for g in gathered] for c in cases}}
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rep, f, indent=1)
        os.replace(tmp, out_path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
