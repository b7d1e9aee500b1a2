"""The layouts whose predictions were checked on GPUs (:data:`MEASURED_LAYOUTS`): a fact the reports print beside a
candidate's estimated step (:mod:`dsv3_rl.planner.report`). Measured against :mod:`dsv3_rl.planner.validation`'s
comparison of bench results with :func:`dsv3_rl.planner.phases.predict_phases`; kept apart from it so the report,
which the search renders, does not import the validation, which runs the phase model, which runs the search.
"""

from __future__ import annotations

#: layouts whose training half (log-prob + update + export, :func:`dsv3_rl.planner.phases.predict_phases`) was run
#: on GPUs and is within the acceptance (memory 15%, step 1.5x): (model name, GPUs, GPU, layout) -> (measured step s,
#: predicted / measured, where). 4x H100, 2026-11-26, docs/planner.md "Measured vs predicted (4x H100, 2026-11-26)"
MEASURED_LAYOUTS = {
    ("proxy_4xH100", 4, "H100", "TP2 PP1 EP4 ETP1 rc=none"): (5.51, 0.88, "docs/results/2026-11-26-grpo-update/h100-4gpu"),
    ("proxy_4xH100", 4, "H100", "TP4 PP1 EP2 ETP1 rc=none"): (7.12, 0.89, "docs/results/2026-11-26-grpo-update/h100-4gpu"),
    ("proxy_4xH100 num_hidden_layers=2", 2, "H100", "TP2 PP1 EP1 ETP1 rc=none"):
        (6.23, 0.85, "docs/results/2026-11-26-grpo-update/h100-4gpu"),
    ("proxy_4xH100 num_hidden_layers=2", 2, "H100", "TP2 PP1 EP2 ETP1 rc=none"):
        (5.93, 0.88, "docs/results/2026-11-26-grpo-update/h100-4gpu"),
}


def measured_layout(model_name: str, gpus: int, gpu: str, layout_short: str):
    """(measured step s, predicted/measured, where) when this layout's training half was measured, else None."""
    return MEASURED_LAYOUTS.get((model_name, gpus, gpu, layout_short))
