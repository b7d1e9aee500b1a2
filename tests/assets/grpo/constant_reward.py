"""A planted fault for tests/unit/test_grpo_learning.py: a reward that ignores the answer (always 1.0).

Every GRPO group then has zero spread, every advantage is 0 and the policy gradient vanishes: the learning
gate of `make demo` must fail on a run scored by this function.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0
