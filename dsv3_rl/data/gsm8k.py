"""GSM8K -> verl RL parquet (``python -m dsv3_rl.data.gsm8k``).

    modelscope download --dataset modelscope/gsm8k --local_dir DIR   # or the HF copy openai/gsm8k
    dsv3-prep-data gsm8k --input-dir DIR --out OUT     # or python -m dsv3_rl.data.gsm8k

Input columns: question, answer (reasoning ending in ``#### N``). The ground truth is N with
thousands separators removed; an answer without a numeric ``#### N`` is an unusable row. The
prompt asks for ``\\boxed{}`` like MATH; the reward also accepts ``#### N``.
"""

from __future__ import annotations

import re
import sys

from dsv3_rl.data.common import BadRow, Converted, DatasetSpec, main_for
from dsv3_rl.errors import cli_main

DATA_SOURCE = "openai/gsm8k"
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")


def convert_row(row: dict) -> Converted:
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise BadRow("empty_question")
    if not isinstance(answer, str) or "####" not in answer:
        raise BadRow("no_hash_answer", (answer or "")[-80:].replace("\n", " ") if isinstance(answer, str) else "")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "").rstrip(".")
    if not _NUMBER.match(final):
        raise BadRow("answer_not_numeric", final[:40])
    return Converted(question=question.strip(), ground_truth=final, level="", type="", solution=answer)


SPEC = DatasetSpec(
    name="GSM8K",
    data_source=DATA_SOURCE,
    hub_name="openai/gsm8k",
    hub_config="main",
    subdirs=("main",),
    required_columns=("question", "answer"),
    convert=convert_row,
    default_local_dir="~/data/gsm8k",
    download_hint=(
        "Download it with `huggingface-cli download openai/gsm8k --repo-type dataset --local-dir DIR` "
        "(or `modelscope download --dataset modelscope/gsm8k --local_dir DIR`) and pass --input-dir DIR."
    ),
)


@cli_main(interrupted='the previous outputs are as they were; rerun the same command')
def main(argv: list[str] | None = None) -> int:
    return main_for(SPEC, argv, prog="dsv3-prep-data gsm8k", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
