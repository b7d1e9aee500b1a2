"""Upstream glue for verl's Hydra config, below every tool (docs/architecture.md): verl's trainer entry points by
name (:mod:`.trainer_modes`), its config composed as ``main_ppo`` composes it and why a key is not in it
(:mod:`.compose`), and the one writer of verl overrides (:mod:`.overrides`). The launcher (a run preset) and the
planner (a candidate layout) both go through it; neither owns it.
"""
