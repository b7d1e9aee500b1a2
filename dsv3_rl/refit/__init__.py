"""Refit: trainer -> rollout weight export, measured (bench/bench_refit.py), verified (manifest), FP8 layout
checks (fp8_layout) and the import of verl's export path without Ray (verl_export). See docs/refit.md."""
