"""Shared pytest setup: CPU-friendly defaults for every test process (and the ones it spawns)."""

import os

# torch.compile costs ~22 s per process on 2 cores and buys nothing at these sizes.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
