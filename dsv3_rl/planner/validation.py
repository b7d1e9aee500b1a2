"""The planner's prediction for a row of ``bench/measure_train_memory.py`` output, so measured peak
memory can be compared with it (``dsv3-plan validate``, tests/unit/test_planner_validation.py).

A bench row describes one single-GPU megatron-core training step of a DeepSeek-V3-shaped model
(TP=PP=EP=1, local spec, megatron's cross entropy, DistributedOptimizer at DP=1); the prediction
is the planner's torch-allocated peak (everything but the non-torch reserve) for that setup. The
core attention path is the one the row says the built model ran (``impl.attention``: ``sdpa`` or
``unfused``, read off ``core_attention.use_sdpa`` by the bench; ``impl.attention_kernel`` names the
SDPA kernel). Rows without it predate patch 0012 and ran the unfused path.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv3_rl.planner.memory import train_memory
from dsv3_rl.planner.model import ModelSpec
from dsv3_rl.planner.pipeline import split_layers
from dsv3_rl.planner.spec import GRPOShape, Layout, Options

REQUIRED = ("name", "hf_config", "seq_length", "micro_batch_size", "num_microbatches", "recompute")


def load_measurements(path) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or not line.lstrip().startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON: {e}") from e
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"{path}:{i}: row lacks {missing}")
        rows.append(row)
    return rows


def row_attention(row: dict) -> str:
    """The planner's ``Options.attention`` for a bench row: what the measured model ran."""
    impl = row.get("impl") or {}
    att = impl.get("attention", "unfused")
    if att not in ("sdpa", "unfused"):
        raise ValueError(f"row {row.get('name')!r}: impl.attention={att!r}; allowed: sdpa, unfused")
    kernel = impl.get("attention_kernel")
    if att == "sdpa" and kernel == "math":
        # torch's math fallback materialises the S x S scores/probs (CPU with MLA's unequal head
        # dims): neither of the planner's attention models
        raise ValueError(f"row {row.get('name')!r}: SDPA ran its math kernel, which the planner does not model; "
                         f"measure with --attention unfused or head dims a fused kernel takes")
    return att


def bench_setup(row: dict) -> tuple[ModelSpec, Layout, GRPOShape, Options]:
    m = ModelSpec.from_hf(row["hf_config"], name=row["name"])
    rc = row["recompute"] or {}
    gran = rc.get("granularity") or "none"
    lay = Layout(recompute=gran, recompute_modules=tuple(rc.get("modules", ("core_attn",))) if gran == "selective" else (),
                 recompute_method=rc.get("method", "uniform"), recompute_num_layers=rc.get("num_layers", 1))
    s, b, nmb = row["seq_length"], row["micro_batch_size"], row["num_microbatches"]
    g = GRPOShape(prompts_per_step=b * nmb, n_samples=1, max_prompt_len=s - 1, max_response_len=1,
                  micro_batch_size=b, dynamic_batch=False)
    # megatron's fallback optimizer is torch Adam(W); on CUDA it runs foreach (one fp32 temporary
    # per param during step()), on CPU per tensor
    torch_foreach = row.get("device") in ("cuda", None) and "torch" in str(row.get("impl", {}).get("optimizer", "torch"))
    o = Options(transformer_impl="local", attention=row_attention(row), loss="megatron_ce", ref_model=False, rollout=False, reserve_gib=0.0,
                moe_grouped_gemm=False, grad_reduce_in_fp32=True, distributed_optimizer=True,
                optimizer_impl="torch" if torch_foreach else "fused")
    return m, lay, g, o


def predict_row(row: dict) -> float:
    """Predicted torch-allocated peak bytes for a bench row."""
    m, lay, g, o = bench_setup(row)
    split, v = split_layers(m.num_layers, 1)
    mb, _ = train_memory(m, split, lay, g, o, 1, row["num_microbatches"])
    return mb.allocated
