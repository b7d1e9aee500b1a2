"""dsv3_rl.layout: the one parallel-layout type, its derived sizes and its ``tp=..,pp=..`` text form."""

from __future__ import annotations

import dataclasses

import pytest

from dsv3_rl.layout import FIELDS, Layout, LayoutError, parse_kv


def test_derived_defaults_follow_megatron_and_verl():
    lay = Layout(tp=4, pp=2, ep=8)
    assert lay.etp_ == 4 and lay.sp_ is True and lay.vpp_ == 1  # ETP = TP, SP on with TP > 1
    assert Layout().sp_ is False and Layout(tp=2, sp=False).sp_ is False and Layout(tp=2, etp=1).etp_ == 1
    assert lay.dp(64) == 8 and lay.edp(64) == 1  # 64 / (4*2*1), 64 / (4*8*2)
    assert Layout(tp=2, cp=2).dp(8) == 2
    assert lay.dp(60) == 0 and lay.edp(60) == 0  # no integer DP


def test_parse_reads_every_field_type():
    lay = Layout.parse("tp=8,pp=12,ep=8,etp=1,vpp=null,sp=false,last_stage_layers=6,recompute=selective,"
                       "recompute_modules=core_attn:mlp,dispatcher=allgather")
    assert lay == Layout(tp=8, pp=12, ep=8, etp=1, sp=False, last_stage_layers=6, recompute="selective",
                         recompute_modules=("core_attn", "mlp"), dispatcher="allgather")
    assert lay.short() == "TP8 PP12 EP8 ETP1 first/last=None/6 rc=sel[core_attn,mlp]"


@pytest.mark.parametrize("text,match", [
    ("tp=8,ppp=2", r"unknown key 'ppp'; allowed: .*'pp'"),
    ("tp=eight", r"Layout.tp='eight': not a "),
    ("sp=maybe", r"Layout.sp: 'maybe' is not a boolean"),
    ("tp8", r"expected key=value, got 'tp8'"),
])
def test_parse_errors_name_the_key(text, match):
    Layout.parse(text.replace("ppp", "pp").replace("eight", "8").replace("maybe", "on").replace("tp8", "tp=8"))  # twin
    with pytest.raises(LayoutError, match=match):
        Layout.parse(text)


def test_one_type_everywhere():
    """converter, planner, correctness suite and launcher all take dsv3_rl.layout.Layout; presets take its fields."""
    from dsv3_rl import planner
    from dsv3_rl.models import config_map
    from dsv3_rl.correctness import layouts
    from dsv3_rl.launch import checks
    from dsv3_rl.recipes import presets

    assert config_map.Parallel is Layout and planner.Layout is Layout
    assert issubclass(layouts.Layout, Layout)
    assert {f.name: f.type for f in dataclasses.fields(checks.Sizes)}["layout"] == "Layout"
    assert presets.LAYOUT_KEYS == FIELDS == tuple(f.name for f in dataclasses.fields(Layout))
    assert parse_kv(planner.RolloutLayout, ["tp=4,gpus=8"]) == {"tp": 4, "gpus": 8}


def test_converter_reads_the_derived_sizes():
    from dsv3_rl.models.config_map import hf_to_mcore_kwargs
    from dsv3_rl.models import presets as model_presets

    cfg = {"model_type": "deepseek_v3", **model_presets.preset_kwargs("tiny")}
    kw = hf_to_mcore_kwargs(cfg, Layout(tp=2))
    assert kw["expert_tensor_parallel_size"] == 2 and kw["sequence_parallel"] is True
    kw = hf_to_mcore_kwargs(cfg, Layout(tp=2, etp=1, sp=False))
    assert kw["expert_tensor_parallel_size"] == 1 and kw["sequence_parallel"] is False


def _megatron_takes(sizes: dict) -> list[str]:
    """Keys of SIZES that megatron-core's initialize_model_parallel or TransformerConfig does not take."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    init = set(inspect.signature(parallel_state.initialize_model_parallel).parameters)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    return [k for k in sizes if k not in init or k not in fields]


def test_mcore_sizes_are_megatron_names():
    """One mapping of a layout to megatron-core's size arguments, for both of its APIs (runtime and converter)."""
    sizes = Layout(tp=2, pp=3, vpp=2, ep=4, cp=1).mcore_sizes()
    assert _megatron_takes(sizes) == []
    assert sizes["tensor_model_parallel_size"] == 2 and sizes["pipeline_model_parallel_size"] == 3
    assert sizes["virtual_pipeline_model_parallel_size"] == 2 and sizes["expert_model_parallel_size"] == 4
    assert sizes["expert_tensor_parallel_size"] == 2  # etp unset: megatron's default, TP
    assert Layout(tp=2, etp=1).mcore_sizes()["expert_tensor_parallel_size"] == 1


def test_mcore_sizes_check_bites():
    """Twin: a misspelt megatron argument is reported."""
    assert _megatron_takes({"tensor_parallel_size": 2, "expert_model_parallel_size": 1}) == ["tensor_parallel_size"]
