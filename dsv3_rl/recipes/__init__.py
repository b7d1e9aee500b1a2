"""Run presets (recipes): the YAML files that combine a model preset, a parallel layout and the hardware by name
(:mod:`.presets`, ``examples/deepseek_v3/presets``), and each named choice a preset makes, as verl keys: the trainer
mode and algorithm (:mod:`.algorithms`), rollout correction (:mod:`.rollout_correction`), router replay
(:mod:`.router_replay`), rollout quantization (:mod:`.rollout_quantization`) and training precision
(:mod:`.train_precision`). A tool: the launcher runs presets, the planner reads them (``dsv3-plan async --preset``);
it imports neither (docs/architecture.md).
"""
