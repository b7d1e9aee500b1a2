"""verl patch 0039 and the presets' ``trainer.v1.sampler.poll_interval``.

verl 0.9.1's v1 trainer samples each step's batch from its ReplayBuffer, which polls TransferQueue and, while the
batch is not complete, sleeps ``poll_interval`` (a constructor default of 2.0 s that ``_build_replay_buffer`` never
set). On one H100 (2026-12-07) every ``timing_s/gen`` was 2k s + ~0.08 s (6.074, 10.076, 12.106, 8.080, 12.063,
6.087): the trainer noticed each finished rollout ~1 s late on average. The patch makes it a config key passed to
the built-in samplers (verl's default unchanged); every preset sets 0.1 s.

The buffers are built by verl's own ``PPOTrainer._build_replay_buffer`` from verl's composed config; the twin
builds them with the patch's hunk reversed (verl's file as it was), where the key is ignored.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dsv3_rl.backends import load_lock
from dsv3_rl.recipes.presets import list_presets, load_preset
from dsv3_rl.verl_glue.overrides import get_dotted

VERL = load_lock()["verl"]
PATCH = "0039-replay-buffer-poll-interval.patch"
TRAINER_BASE = "verl/trainer/ppo/v1/trainer_base.py"
KEY = "trainer.v1.sampler.poll_interval"


def _verl_cfg(*overrides: str):
    from dsv3_rl.verl_glue.compose import compose

    return compose("ppo_megatron_trainer", list(overrides))


def _pre_patch_trainer_base(tmp: Path):
    """verl's trainer_base.py without patch 0039: the live file with the patch's hunk reversed, imported as a
    sibling module."""
    from dsv3_rl.patching import lint

    patch = {p.name: p for p in lint(VERL, headers=False)}[PATCH]
    dst = tmp / TRAINER_BASE
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text((VERL.path() / TRAINER_BASE).read_text())
    r = subprocess.run(["git", "apply", "-R", f"--include={TRAINER_BASE}", str(patch.path)], cwd=tmp,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "poll_interval" not in dst.read_text(), "the reversed file still reads poll_interval"
    spec = importlib.util.spec_from_file_location("verl.trainer.ppo.v1.trainer_base_pre0039", dst)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _build(cfg, trainer_base=None):
    """The replay buffer verl's trainer builds for CFG (PPOTrainer._build_replay_buffer, nothing else of the trainer
    constructed)."""
    if trainer_base is None:
        from verl.trainer.ppo.v1 import trainer_base
    base = trainer_base.PPOTrainer
    probe = type("Probe", (base,), {m: (lambda self, *a, **k: None) for m in base.__abstractmethods__})
    trainer = object.__new__(probe)
    trainer.config = cfg
    trainer.trainer_mode = cfg.trainer.v1.trainer_mode
    return trainer._build_replay_buffer()


class FakeTQ:
    """TransferQueue's kv API as ReplayBuffer.sample uses it: one GRPO group (prompt u0, one trajectory) that is
    running until FINISH_AT (time.monotonic()), then finished."""

    def __init__(self, finish_at: float):
        self.finish_at = finish_at
        self.polls = 0

    def kv_list(self, partition_id=None):
        self.polls += 1
        status = "finished" if time.monotonic() >= self.finish_at else "running"
        return {"train": {"u0": {"is_prompt": True, "status": status, "global_steps": 1},
                          "u0_0_0": {"status": status}}}

    def kv_clear(self, partition_id, keys):
        pass


def _lag_after_rollout_finished(buffer, monkeypatch) -> float:
    """Seconds between the (fake) rollout finishing 0.2 s into sample() and sample() returning the batch."""
    from verl.trainer.ppo.v1 import replay_buffer

    fake = FakeTQ(time.monotonic() + 0.2)
    monkeypatch.setattr(replay_buffer, "tq", fake)
    batch, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    lag = time.monotonic() - fake.finish_at
    assert list(batch.keys) == ["u0_0_0"] and fake.polls >= 2, (batch, fake.polls)
    return lag


def test_configured_poll_interval_reaches_the_built_in_buffers():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    sync = _build(_verl_cfg(f"{KEY}=0.05"))
    assert type(sync) is ReplayBuffer and sync.poll_interval == 0.05
    async_ = _build(_verl_cfg(f"{KEY}=0.05", "trainer.v1.trainer_mode=colocate_async"))
    assert type(async_) is ReplayBufferAsync and async_.poll_interval == 0.05
    assert _build(_verl_cfg()).poll_interval == 2.0  # verl's default is unchanged
    with pytest.raises(ValueError, match="poll_interval must be > 0"):
        _build(_verl_cfg(f"{KEY}=0"))


def test_sample_returns_within_the_poll_interval_of_the_rollout(monkeypatch):
    """Behaviour: with 0.05 s the batch comes back well under a second after the rollout finished (2.0 s: >= 1.8,
    the twin below). The bound is loose for a loaded 2-core box; sleep never returns early, so the twin's is exact."""
    lag = _lag_after_rollout_finished(_build(_verl_cfg(f"{KEY}=0.05")), monkeypatch)
    assert lag < 1.0, lag


def test_planted_fault_pre_patch_builder_ignores_the_key(tmp_path, monkeypatch):
    """Twin: verl's _build_replay_buffer without the patch builds the sync buffer with 2.0 s whatever the config
    says, and sample() then notices the finished rollout only at the next poll, 1.8 s later."""
    buffer = _build(_verl_cfg(f"{KEY}=0.05"), _pre_patch_trainer_base(tmp_path))
    assert buffer.poll_interval == 2.0 != 0.05
    assert _lag_after_rollout_finished(buffer, monkeypatch) >= 1.8


CUSTOM = """
class StrictSampler:
    # a custom sampler written against verl 0.9.1's constructor contract for custom samplers
    def __init__(self, trainer_mode, trainer_config, max_off_policy_threshold, max_off_policy_strategy,
                 sampler_kwargs, refill_fn=None):
        self.kwargs = dict(trainer_mode=trainer_mode, trainer_config=trainer_config,
                           max_off_policy_threshold=max_off_policy_threshold,
                           max_off_policy_strategy=max_off_policy_strategy, sampler_kwargs=sampler_kwargs,
                           refill_fn=refill_fn)
"""


def test_custom_sampler_keeps_its_constructor_contract(tmp_path):
    """A custom sampler (trainer.v1.sampler.custom_sampler) gets no poll_interval, so one written for verl 0.9.1
    still builds with the key set. Twin: passing it would have broken that sampler."""
    path = tmp_path / "strict_sampler.py"
    path.write_text(textwrap.dedent(CUSTOM))
    cfg = _verl_cfg(f"{KEY}=0.05", f"trainer.v1.sampler.custom_sampler.path={path}",
                    "trainer.v1.sampler.custom_sampler.name=StrictSampler")
    sampler = _build(cfg)
    assert type(sampler).__name__ == "StrictSampler" and not hasattr(sampler, "poll_interval")
    with pytest.raises(TypeError, match="poll_interval"):
        type(sampler)(**sampler.kwargs, poll_interval=0.05)


def test_gpu_presets_set_a_short_poll_interval(tmp_path):
    """Every GPU preset polls every 0.1 s (_grpo_math.yaml, and tiny_1xH100 over tiny_cpu); the CPU presets keep
    verl's 2.0 (on 2 cores the generation takes ~4 s and a faster poll shortened no step: docs/ci-history.md, 2026-11-27).
    tiny_1xH100's composed verl config (the launcher's, verl's validation run) builds its sync buffer with 0.1.
    Twin: the same config without the key builds the 2 s buffer."""
    from omegaconf import open_dict

    from dsv3_rl.launch import run as launch_run

    names = list_presets()
    assert {"tiny_cpu", "tiny_1xH100", "proxy_1xH100", "671b_512xH100"} <= set(names)
    gpu = {n: load_preset(n).hardware.get("gpu", "cpu") != "cpu" for n in names}
    assert {n: get_dotted(load_preset(n).verl, KEY) for n in names} == {n: 0.1 if gpu[n] else None for n in names}
    assert gpu["tiny_1xH100"] and not gpu["tiny_cpu"]
    cfg = launch_run.resolve("tiny_1xH100", [], {"WORK_DIR": str(tmp_path)}).cfg
    assert _build(cfg).poll_interval == 0.1
    with open_dict(cfg):
        del cfg.trainer.v1.sampler["poll_interval"]
    assert _build(cfg).poll_interval == 2.0
