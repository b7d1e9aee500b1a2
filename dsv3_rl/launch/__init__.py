"""One launcher from checkpoint to GRPO: named presets (model x hardware), validated before any GPU is used.

    python -m dsv3_rl.launch --preset 671b_512xH100 --dry-run [verl overrides ...]
    bash examples/deepseek_v3/run_mcore_deepseek_verl.sh --preset tiny_cpu

Modules: :mod:`.run` (resolve a preset into paths, env, stages, verl overrides and checks), :mod:`.verl_config`
(what main_ppo and its workers validate in verl's real Hydra config), :mod:`.checks`
(parallel sizes vs model and GPUs, router, planner), :mod:`.stages` (FP8 cast, config fix-up, HF->mcore,
data), :mod:`.platform` (PAI-DLC / Slurm / local environment), :mod:`.ray_cluster` (multi-node Ray
bring-up), :mod:`.specs` (DLC job spec, sbatch line), :mod:`.cli`. The presets it runs (the YAML files and
their named choices) are :mod:`dsv3_rl.recipes`; verl's config is composed by :mod:`dsv3_rl.verl_glue`. The top
layer of the package (docs/architecture.md). See docs/launcher.md.
"""

__all__ = ["main", "resolve"]


def main(argv=None) -> int:
    from dsv3_rl.launch.cli import main as _main

    return _main(argv)


def resolve(preset, overrides=None, environ=None, *, validate=True):
    from dsv3_rl.launch.run import resolve as _resolve

    return _resolve(preset, overrides, environ, validate=validate)
