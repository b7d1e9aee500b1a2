"""Code that exists is imported, never looked up: when a piece of the package breaks, what uses it FAILS
(issue 18, item 5). Each test breaks one import (``sys.modules[name] = None`` makes ``import name`` raise)
and shows the failure; its twin runs the same call with the module in place."""

from __future__ import annotations

import json
import sys

import pytest

from dsv3_rl.launch import checks
from dsv3_rl.layout import Layout


def _sizes(**lay) -> checks.Sizes:
    return checks.Sizes(layout=Layout(**{"tp": 8, "pp": 8, "ep": 8, "etp": 1, **lay}), world=512, nnodes=64,
                        gpus_per_node=8, rollout_tp=8, rollout_dp=1, rollout_ep=1, rollout_pp=1)


def test_pipeline_layout_check_fails_without_the_planner(monkeypatch):
    s = _sizes(pp=6, pipeline_layout="Et|(tt|)*30L")
    bad = checks.check_pipeline(61, s)  # twin: with the planner present, 32 stages over PP=6 are rejected
    assert bad and bad[0].level == "error" and "pipeline_model_parallel_layout" in bad[0].message, bad
    assert checks.check_pipeline(61, _sizes(pp=8, vpp=4, pipeline_layout="Et|(tt|)*30L")) == []
    monkeypatch.setitem(sys.modules, "dsv3_rl.planner.pipeline", None)
    with pytest.raises(ImportError):  # it used to be a warning "pipeline layout not checked"
        checks.check_pipeline(61, s)


def test_memory_check_fails_without_the_planner(monkeypatch):
    monkeypatch.setitem(sys.modules, "dsv3_rl.planner", None)
    with pytest.raises(ImportError):  # it used to be a warning "dsv3_rl.planner is not importable"
        checks.planner_check({}, None, _sizes(), "H100", {}, cpu=False)
    # twin: on a CPU run nothing is imported and nothing fails
    assert checks.planner_check({}, None, _sizes(), "H100", {}, cpu=True)[0].level == "info"


def test_config_stage_fails_without_the_config_fixer(tmp_path, monkeypatch):
    from dsv3_rl.recipes.presets import load_preset
    from dsv3_rl.launch.run import Paths
    from dsv3_rl.launch.stages import build_stages

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    paths = Paths(tmp_path, hf, hf, tmp_path / "mc", tmp_path / "raw", tmp_path / "data", tmp_path / "ck", tmp_path / "lg")
    stage = {s.name: s for s in build_stages(load_preset("671b_512xH100"), paths, max_prompt_length=2048,
                                             model_cfg={})}["hf_config"]
    ok, detail = stage.verify()  # twin: the fixer runs and refuses a non-DeepSeek config
    assert not ok and "cannot be fixed" in detail
    monkeypatch.setitem(sys.modules, "dsv3_rl.checkpoint.hf_config", None)
    with pytest.raises(ImportError):  # it used to fall back to a subprocess and read its output
        stage.verify()


def test_planner_has_no_model_fallback(monkeypatch):
    from dsv3_rl.planner import model

    assert model.load_model("671b").num_layers > 0  # twin
    monkeypatch.setattr(model, "_SPEC_CACHE", {})
    monkeypatch.setattr(model.model_presets, "PRESETS", {})
    with pytest.raises(ValueError, match="unknown model preset '671b'"):
        model.load_model("671b")
