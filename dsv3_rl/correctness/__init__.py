"""MLA/MoE correctness suite: transformers' DeepSeek-V3 (reference) against megatron-core (candidate)
per layer, forward and gradients, at any TP/PP/EP/ETP/SP layout, with planted faults that prove
the comparison bites. ``python -m dsv3_rl.correctness --help``; docs/correctness.md explains the
report.

Modules: :mod:`data` (batch, loss), :mod:`hooks` (activation capture on both sides),
:mod:`reference` (HF run), :mod:`worker` (megatron run per layout, torchrun entry),
:mod:`assemble` (per-rank pieces -> full tensors), :mod:`bridge` (the project's converter),
:mod:`compare` (metrics, tolerances), :mod:`report`, :mod:`faults`, :mod:`layouts`, :mod:`runner`.
"""
