"""dsv3_rl: GRPO of DeepSeek-V3 on megatron-core + verl + vLLM, as a patch overlay on pinned upstreams."""

__version__ = "0.1.0"
