"""megatron-core glue: distributed init, building DeepSeek-V3 GPTModels, one training step.

Everything here uses megatron-core's own machinery (parallel_state, GPTModel + layer specs,
DistributedDataParallel, the pipeline schedules, finalize_model_grads, dist_checkpointing), so
the code paths tested are the ones training runs.
"""
