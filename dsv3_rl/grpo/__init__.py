"""GRPO of DeepSeek-V3 through verl's ``main_ppo``: the self-checks of a run (:mod:`.checks`) and its
progress lines and plots (:mod:`.progress`). Runs are started by the launcher (:mod:`dsv3_rl.launch`);
``make demo`` is its ``tiny_cpu`` preset (see docs/grpo-demo.md).
"""
