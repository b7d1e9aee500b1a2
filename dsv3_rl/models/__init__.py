"""DeepSeek-V3 model facts (presets), the offline mini-model tokenizer and the mini-model writer.

    from dsv3_rl.models.presets import hf_config, list_presets
    from dsv3_rl.models.mini_model import write_mini_model
"""

from .presets import PRESETS, hf_config, list_presets, preset_kwargs

__all__ = ["PRESETS", "hf_config", "list_presets", "preset_kwargs"]
