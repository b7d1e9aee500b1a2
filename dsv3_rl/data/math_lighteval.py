"""MATH-lighteval -> verl RL parquet (``python -m dsv3_rl.data.math_lighteval``).

    modelscope download --dataset AI-ModelScope/MATH-lighteval --local_dir DIR   # or the HF copy
    dsv3-prep-data math-lighteval --input-dir DIR --out OUT     # or python -m dsv3_rl.data.math_lighteval

Input columns: problem, level, solution, type. The ground truth is the content of the last
``\\boxed{...}`` / ``\\fbox{...}`` in the solution (nested braces handled); a solution without
one is an unusable row (counted; the run fails above ``--max-bad-frac``).
"""

from __future__ import annotations

import sys

from dsv3_rl.data.common import BadRow, Converted, DatasetSpec, main_for
from dsv3_rl.reward.answer import last_boxed_answer
from dsv3_rl.errors import cli_main

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"  # the name verl's default reward also knows


def convert_row(row: dict) -> Converted:
    problem, solution = row.get("problem"), row.get("solution")
    if not isinstance(problem, str) or not problem.strip():
        raise BadRow("empty_problem")
    if not isinstance(solution, str) or not solution.strip():
        raise BadRow("empty_solution")
    answer = last_boxed_answer(solution)
    if answer is None:
        raise BadRow("no_boxed_answer", solution[-80:].replace("\n", " "))
    return Converted(
        question=problem.strip(),
        ground_truth=answer,
        level=str(row.get("level") or ""),
        type=str(row.get("type") or ""),
        solution=solution,
    )


SPEC = DatasetSpec(
    name="MATH-lighteval",
    data_source=DATA_SOURCE,
    hub_name="DigitalLearningGmbH/MATH-lighteval",
    hub_config=None,
    subdirs=("data",),
    required_columns=("problem", "level", "solution", "type"),
    convert=convert_row,
    default_local_dir="~/data/math",
    download_hint=(
        "Download it with `modelscope download --dataset AI-ModelScope/MATH-lighteval --local_dir DIR` "
        "(or `huggingface-cli download DigitalLearningGmbH/MATH-lighteval --repo-type dataset --local-dir DIR`) "
        "and pass --input-dir DIR."
    ),
)


@cli_main(interrupted='the previous outputs are as they were; rerun the same command')
def main(argv: list[str] | None = None) -> int:
    return main_for(SPEC, argv, prog="dsv3-prep-data math-lighteval", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
