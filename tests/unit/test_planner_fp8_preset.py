"""A preset's ``train_precision: fp8`` (+ ``fp8_recipe``): emitted as megatron-core's ``fp8`` / ``fp8_recipe`` under
verl's ``actor.megatron.override_transformer_config``, dry-run validated against verl's composed config (the keys
are megatron TransformerConfig fields, ``check_open_dicts``) and against the values megatron-core 0.16.1 declares
(``TransformerConfig`` field types); the planner's memory check gets the FP8 options. Twins: a recipe megatron does
not run on Hopper, FP8 on a CPU preset, a misspelled recipe value."""

from __future__ import annotations

import typing

import pytest

from dsv3_rl.launch import run as launch_run
from dsv3_rl.recipes import train_precision
from dsv3_rl.recipes.presets import PRESET_DIR, PresetError, load_preset

OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"


def _preset(tmp_path, body: str, base: str = "proxy_8xH100") -> str:
    p = tmp_path / f"{base}_fp8test.yaml"
    p.write_text(f"extends: {PRESET_DIR / (base + '.yaml')}\n{body}")
    return str(p)


def _megatron_allows(key: str, value) -> bool:
    """Is ``value`` one megatron-core 0.16.1's TransformerConfig declares for ``key`` (its Literal)?"""
    from megatron.core.transformer.transformer_config import TransformerConfig

    hint = typing.get_type_hints(TransformerConfig)[key]
    allowed = set()
    for arg in typing.get_args(hint):
        allowed |= set(typing.get_args(arg)) if typing.get_origin(arg) is typing.Literal else set()
    return value in allowed


def test_verl_tree_emits_megatron_fp8_keys():
    t = train_precision.verl_tree("fp8", "blockwise")
    otc = t["actor_rollout_ref"]["actor"]["megatron"]["override_transformer_config"]
    assert otc == {"fp8": "e4m3", "fp8_recipe": "blockwise"}
    assert train_precision.verl_tree("bf16") == {}
    for recipe in train_precision.RECIPES:
        assert _megatron_allows("fp8_recipe", recipe), recipe
    assert _megatron_allows("fp8", train_precision.FP8_FORMAT)


def test_planted_fault_misspelled_recipe_is_not_a_megatron_value():
    assert not _megatron_allows("fp8_recipe", "blockwize")
    with pytest.raises(ValueError, match="fp8_recipe"):
        train_precision.verl_tree("fp8", "mxfp8")


def test_preset_keys_load_and_are_refused_where_they_cannot_run(tmp_path):
    p = load_preset(_preset(tmp_path, "train_precision: fp8\nfp8_recipe: tensorwise\n"))
    assert (p.train_precision, p.fp8_recipe) == ("fp8", "tensorwise")
    assert load_preset("proxy_8xH100").train_precision == "bf16"
    with pytest.raises(PresetError, match="fp8_recipe='mxfp8'"):
        load_preset(_preset(tmp_path, "train_precision: fp8\nfp8_recipe: mxfp8\n"))
    with pytest.raises(PresetError, match="train_precision='fp16'"):
        load_preset(_preset(tmp_path, "train_precision: fp16\n"))
    with pytest.raises(PresetError, match="applies to fp8 only"):
        load_preset(_preset(tmp_path, "fp8_recipe: delayed\n"))
    with pytest.raises(PresetError, match="CPU preset"):
        load_preset(_preset(tmp_path, "train_precision: fp8\n", base="tiny_cpu"))


def test_planner_options_from_the_composed_config():
    assert train_precision.planner_options({}) == {}
    o = train_precision.planner_options({"fp8": "e4m3", "fp8_recipe": "blockwise"})
    assert o == {"train_precision": "fp8", "fp8_recipe": "blockwise", "fp8_param": False,
                 "transformer_impl": "transformer_engine"}
    from dsv3_rl.planner import Options

    Options(**o)  # a valid planner input


@pytest.mark.slow  # composes verl's config (imports verl + megatron-core, ~20 s)
def test_fp8_preset_dry_runs_clean_with_the_keys_in_verl_config(tmp_path):
    from dsv3_rl.launch.verl_config import select
    from test_launch_dryrun import environ_for  # tests/unit is on sys.path (pytest rootdir)
    from dsv3_rl.minimodel.mini_model import write_mini_model

    ckpt = tmp_path / "DeepSeek-V3-0324-BF16"
    write_mini_model("deepseek-v3", ckpt)
    path = _preset(tmp_path, "train_precision: fp8\nfp8_recipe: blockwise\n")
    env = environ_for("proxy_8xH100", tmp_path, ckpt)
    launch = launch_run.resolve(path, [], env)
    assert launch.errors == [], [str(f) for f in launch.errors]
    assert select(launch.cfg, f"{OTC}.fp8") == "e4m3" and select(launch.cfg, f"{OTC}.fp8_recipe") == "blockwise"
    assert any(a.endswith("override_transformer_config.fp8=e4m3") for a in launch.argv)
    # the BF16 preset carries no fp8 key (twin: the emitter is what sets it)
    base = launch_run.resolve("proxy_8xH100", [], env)
    assert select(base.cfg, f"{OTC}.fp8") in (None, False)
