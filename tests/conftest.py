"""Shared pytest setup: CPU-friendly defaults for every test process (and the ones it spawns)."""

import os
import sys

# torch.compile costs ~22 s per process on 2 cores and buys nothing at these sizes.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


import pytest  # noqa: E402

# megatron-core's LanguageModule (every GPTModel built in the pytest process) exports TransformerEngine's
# attention switches into os.environ, and a later model with another attention_backend, in this process or
# in a subprocess inheriting the environment, then fails megatron's check ("NVTE_FLASH_ATTN set to 1, but
# expected 0"). Put them back as they were after every test.
from dsv3_rl.grpo.recipe import TE_ATTENTION_ENV as _TE_ATTENTION_ENV  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = {k: os.environ.get(k) for k in _TE_ATTENTION_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    guard = sys.modules.get("megatron.core.transformer.mla_attention_guard")  # our megatron patch records them too
    for k in _TE_ATTENTION_ENV:
        getattr(guard, "MCORE_SET_ENV", {}).pop(k, None)
