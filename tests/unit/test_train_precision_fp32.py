"""``train_precision: fp32`` and ``auto`` (dsv3_rl/recipes/train_precision.py) and verl patch 0038 beneath them.

On a CPU without native BF16 (AVX2 only: the 2-core AMD EPYC that CI ran on 2026-11-28) torch's BF16 GEMMs are
emulated, ~60x slower than FP32 there; the CPU presets (``tiny_cpu`` and what extends it) say ``auto``: the
Megatron trainer in FP32 on such a CPU, in BF16 on a CPU with AVX512-BF16 or AMX and on every GPU. verl 0.9.1
refused ``actor.megatron.dtype: float32`` outright; patch 0038 lets it through to the FP32 path verl's engine
already has. The whole GRPO demo in FP32 is the e2e runs' (tests/unit/test_grpo_learning.py on such a box).
"""

from __future__ import annotations

import pytest

from dsv3_rl.recipes import train_precision as tp

#: /proc/cpuinfo of the CI box of 2026-11-28 (abridged): AVX2, no BF16 instructions
AMD_AVX2 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel name\t: AMD EPYC\n"
            "flags\t\t: fpu vme sse4_1 sse4_2 avx sse4a avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
#: a Sapphire Rapids: AVX-512 with BF16, and AMX
SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n"


def test_auto_is_fp32_on_a_cpu_without_native_bf16():
    mode, why = tp.resolve("auto", True, tp.cpu_flags(AMD_AVX2))
    assert mode == "fp32" and "no native BF16" in why, (mode, why)


def test_auto_is_bf16_on_a_cpu_with_native_bf16_and_on_a_gpu():
    mode, why = tp.resolve("auto", True, tp.cpu_flags(SPR))
    assert mode == "bf16" and "avx512_bf16" in why and "amx_bf16" in why, (mode, why)
    assert tp.resolve("auto", False, frozenset()) == ("bf16", "auto: a GPU")


def test_planted_fault_avx512_without_bf16_is_not_native_bf16():
    """Twin: AVX-512 alone (Skylake-SP, Ice Lake) has no BF16 instructions; a check for 'avx512' would pick BF16."""
    flags = tp.cpu_flags("flags\t\t: fpu avx2 avx512f avx512bw avx512vl avx512_vnni\n")
    assert "avx512f" in flags
    assert tp.resolve("auto", True, flags)[0] == "fp32"


def test_named_modes_are_kept_and_fp32_sets_both_megatron_dtypes():
    assert tp.resolve("bf16", True, frozenset()) == ("bf16", "")
    assert tp.resolve("fp8", False, frozenset()) == ("fp8", "")
    tree = tp.verl_tree("fp32")
    assert tree["actor_rollout_ref"]["actor"]["megatron"]["dtype"] == "float32"
    assert tree["actor_rollout_ref"]["ref"]["megatron"]["dtype"] == "float32"  # its own key in verl's config
    assert tp.verl_tree("bf16") == {}
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        tp.verl_tree("auto")


def test_verl_megatron_config_accepts_float32():
    """verl patch 0038: McoreEngineConfig takes dtype float32 (unpatched: 'dtype float32 not supported')."""
    from verl.workers.config.engine import McoreEngineConfig

    assert McoreEngineConfig(dtype="float32").dtype == "float32"
    assert McoreEngineConfig(dtype="bfloat16").dtype == "bfloat16"


def test_verl_megatron_config_refuses_other_dtypes():
    """Twin of the above: the patch widened the check by one dtype, it did not remove it."""
    from verl.workers.config.engine import McoreEngineConfig

    with pytest.raises(AssertionError, match="dtype float64 not supported"):
        McoreEngineConfig(dtype="float64")


@pytest.mark.parametrize("cpuinfo,dtype", [(AMD_AVX2, "float32"), (SPR, "bfloat16")], ids=["avx2", "amx"])
def test_the_cpu_demo_composes_with_the_cpus_dtype(cpuinfo, dtype, monkeypatch, tmp_path):
    """The launcher resolves tiny_cpu's ``auto`` by this machine's CPU flags into verl's composed config (actor
    and reference), says so in a note, and verl's own validation accepts the result (patch 0038)."""
    from dsv3_rl.launch import run as launch_run
    from dsv3_rl.launch.verl_config import select

    monkeypatch.setattr(launch_run, "host_cpu_flags", lambda: tp.cpu_flags(cpuinfo))
    launch = launch_run.resolve("tiny_cpu", [], {"WORK_DIR": str(tmp_path)})  # verl's validate_config runs
    assert select(launch.cfg, "actor_rollout_ref.actor.megatron.dtype") == dtype
    assert select(launch.cfg, "actor_rollout_ref.ref.megatron.dtype") == dtype
    assert any(n.startswith(f"train_precision auto -> {'fp32' if dtype == 'float32' else 'bf16'}")
               for n in launch.notes), launch.notes
    verl_errors = [f for f in launch.findings if f.level == "error" and f.check == "verl"]
    assert not verl_errors, verl_errors


def test_a_preset_saying_the_dtype_twice_is_refused(tmp_path):
    """The preset's verl tree would override train_precision silently (it merges last): refused, naming both; twin:
    the same preset without verl's dtype key loads."""
    from dsv3_rl.recipes.presets import REPO, PresetError, load_preset

    base = REPO / "examples/deepseek_v3/presets/tiny_cpu.yaml"
    p = tmp_path / "twice.yaml"
    p.write_text(f"extends: {base}\nverl: {{actor_rollout_ref: {{actor: {{megatron: {{dtype: bfloat16}}}}}}}}\n")
    with pytest.raises(PresetError, match="megatron.dtype='bfloat16' beside train_precision='auto'"):
        load_preset(str(p))
    p.write_text(f"extends: {base}\n")
    assert load_preset(str(p)).train_precision == "auto"
