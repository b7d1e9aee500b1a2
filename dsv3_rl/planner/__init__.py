"""Parallelism and memory planner for DeepSeek-V3 GRPO on megatron-core 0.16.1 + verl 0.9.1 + vLLM.

Public API (what the launcher's ``--dry-run`` calls)::

    from dsv3_rl.planner import plan, check_layout, Cluster, GRPOShape, Options, Layout

    res = plan("671b", Cluster(gpu="H100", nodes=64), GRPOShape(prompts_per_step=512, n_samples=16),
               Options())                       # -> PlanResult
    res.best, res.feasible, res.rejected, res.table(), res.plot("plan.png"), res.to_dict()

    fits, report = check_layout("671b", Cluster(gpu="H20", nodes=12), GRPOShape(...),
                                Layout(tp=8, pp=12, ep=8, etp=1, last_stage_layers=6, recompute="full"),
                                Options(...))    # -> (bool, str)

``model`` is a preset name, an HF ``config.json`` path, a dict or a transformers config;
``cluster``/``grpo``/``options``/``layout`` may be dicts of the dataclass fields (unknown keys are
errors). See docs/planner.md for the memory model and its assumptions.
"""

from dsv3_rl.planner.model import ModelSpec, ParamCount, count_params, load_model
from dsv3_rl.planner.rules import Violation
from dsv3_rl.planner.search import Evaluation, PlanResult, check_layout, evaluate, plan
from dsv3_rl.planner.spec import GPUS, Cluster, GPUType, GRPOShape, Layout, Options, RolloutLayout

__all__ = [
    "GPUS", "Cluster", "Evaluation", "GPUType", "GRPOShape", "Layout", "ModelSpec", "Options", "ParamCount",
    "PlanResult", "RolloutLayout", "Violation", "check_layout", "count_params", "evaluate", "load_model", "plan",
]
