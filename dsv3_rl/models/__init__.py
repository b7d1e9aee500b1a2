"""DeepSeek-V3 model facts: the model presets (:mod:`.presets`), the offline mini-model tokenizer (:mod:`.tokenizer`),
the one HF -> megatron-core config mapping (:mod:`.config_map`) and what a DeepSeek-V3 ``config.json`` must hold
(:mod:`.hf_config_rules`). The layer above the foundation: it imports only errors, CLI arguments, layout and fs
(docs/architecture.md). The tools that write mini models from these facts are :mod:`dsv3_rl.minimodel`.

    from dsv3_rl.models.presets import hf_config, list_presets
"""

from .presets import PRESETS, hf_config, list_presets, preset_kwargs

__all__ = ["PRESETS", "hf_config", "list_presets", "preset_kwargs"]
