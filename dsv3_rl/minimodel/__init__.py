"""Small DeepSeek-V3 checkpoints made here from the model facts (:mod:`dsv3_rl.models`): a random mini model of any
model preset (:mod:`.mini_model`, ``dsv3-mini-model``) and the warm-started tiny model the CPU demo learns from
(:mod:`.warm_start`, ``dsv3-warm-start``). Tools: they write checkpoints with :mod:`dsv3_rl.checkpoint` and read
prompts with :mod:`dsv3_rl.data`.
"""
