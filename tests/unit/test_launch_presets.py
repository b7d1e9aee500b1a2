"""Launcher presets, override formatting and the structural checks (no verl import; fast).

Every check that must catch a bad layout has a planted-fault twin next to the passing case.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dsv3_rl.launch import checks
from dsv3_rl.verl_glue.overrides import flatten, hydra_value, parse_overrides, set_dotted, shell_join
from dsv3_rl.recipes.presets import LAYOUT_KEYS, PRESET_DIR, PresetError, list_presets, load_preset
from dsv3_rl.layout import Layout
from dsv3_rl.models import presets as model_presets

EXPECTED = {"tiny_cpu", "tiny_cpu_gsm8k", "tiny_1xH100", "proxy_1xH100", "proxy_4xH100", "proxy_8xH100", "proxy_16xH20", "671b_96xH20", "671b_512xH100",
            "tiny_2xH100", "tiny_2xH100_one_step_off", "proxy_2xH100", "proxy_2xH100_one_step_off"}


def test_every_preset_loads_and_names_model_and_hardware():
    names = list_presets()
    assert EXPECTED <= set(names), names
    assert not any(n.startswith("_") for n in names)
    for n in names:
        p = load_preset(n)
        model_presets.resolve(p.model)
        assert p.world >= 1 and p.layout, n
        # presets are named <model>_<hardware>[_<variant>], after the hardware they were checked on
        assert n.split("_")[1] == ("cpu" if p.is_cpu else p.hardware_name), n


def test_671b_presets_carry_the_rl_settings():
    for n in ("671b_96xH20", "671b_512xH100"):
        p = load_preset(n)
        assert p.router == {"bias_update_rate": 0.0, "load_balancing_type": "none", "aux_loss_coeff": 0.0,
                            "router_dtype": "fp32"}
        m = p.verl["actor_rollout_ref"]["actor"]["megatron"]
        assert m["use_distributed_optimizer"] is True and m["param_offload"] is True and m["optimizer_offload"] is True
        assert p.weights["dist_ckpt"] is True
        # uneven stages (61 layers): first/last stage sizes or a pipeline layout string
        assert p.layout.get("first_stage_layers") or p.layout.get("last_stage_layers") or p.layout.get("pipeline_layout")
        assert "tp" in p.rollout and "gpu_memory_utilization" in p.rollout
    sel = load_preset("671b_512xH100").layout
    assert sel["recompute"] == "selective" and set(sel["recompute_modules"]) == {"core_attn", "mla_up_proj", "layernorm", "moe", "mlp"}
    assert sel["pipeline_layout"] == "Et|(tt|)*30L"  # docs/planner.md's 512 x H100 recommendation


def _write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(textwrap.dedent(text))
    return p


def test_unknown_section_and_key_are_errors(tmp_path):
    base = f"extends: {PRESET_DIR / '_grpo_math.yaml'}\nmodel: tiny\nhardware: {{gpu: H100, nodes: 1, gpus_per_node: 1}}\n"
    ok = _write(tmp_path, "ok.yaml", base + "layout: {tp: 1}\n")
    assert load_preset(ok).layout == {"tp": 1}
    bad = _write(tmp_path, "bad.yaml", base + "layuot: {tp: 1}\n")
    with pytest.raises(PresetError, match=r"unknown section 'layuot'.*did you mean 'layout'"):
        load_preset(bad)
    bad2 = _write(tmp_path, "bad2.yaml", base + "layout: {tp: 1, pipline: 2}\n")
    with pytest.raises(PresetError, match=r"layout.pipline.*allowed in layout"):
        load_preset(bad2)
    bad3 = _write(tmp_path, "bad3.yaml", base.replace("H100", "H1OO") + "layout: {tp: 1}\n")
    with pytest.raises(PresetError, match=r"hardware.gpu='H1OO'"):
        load_preset(bad3)


def test_unknown_preset_names_the_choices():
    with pytest.raises(PresetError, match=r"671b_512xH100"):
        load_preset("671b_512xh100")


def test_extends_cycle_is_an_error(tmp_path):
    _write(tmp_path, "a.yaml", "extends: b.yaml\n")
    _write(tmp_path, "b.yaml", "extends: a.yaml\n")
    with pytest.raises(PresetError, match="cycle"):
        load_preset(tmp_path / "a.yaml")


def test_cpu_preset_is_the_demo_with_checks_and_shipped_weights():
    """`make demo` is tiny_cpu: shipped warm start, the synthetic task, the learning gate; the GSM8K variant keeps
    the pipeline and turns the gate off with a reason."""
    p = load_preset("tiny_cpu")
    assert p.weights["source"] == "shipped" and p.weights["path"] == "examples/deepseek_v3/models/dsv3-tiny-warm"
    assert p.data["raw"] == "examples/deepseek_v3/data/identity-arith"
    assert p.checks["learning"] == {"min_gain": 0.15, "window": 3}
    assert p.verl["actor_rollout_ref"]["actor"]["entropy_coeff"] == 0.0  # the policy gradient alone
    assert p.run["timeout_s"] > 0
    g = load_preset("tiny_cpu_gsm8k")
    assert g.data["dataset"] == "gsm8k" and "cannot learn GSM8K" in g.checks["learning"]["reason_off"]


@pytest.mark.parametrize("text,match", [
    ("checks: {learnin: {}}", "unknown key checks.learnin"),
    ("checks: {learning: {min_gian: 0.1}}", "unknown key checks.learning.min_gian"),
    ("checks: {learning: 3}", "checks.learning must be a mapping"),
    ("run: {timeout_s: -5}", "run.timeout_s=-5: input should be greater than 0"),
    # issue 29's probe: each of these passed the dry run (and some crashed the checks after the whole run)
    ("run: {timeout_s: true}", "run.timeout_s=True: input should be a valid number"),
    ("run: {timeout_s: .nan}", "run.timeout_s=nan: input should be a finite number"),
    ("run: {max_restarts: -1}", "run.max_restarts=-1: input should be greater than or equal to 0"),
    ("run: {max_start_retries: 11}", "run.max_start_retries=11: input should be less than or equal to 10"),
    ("run: {verify_checkpoints: yes}", "run.verify_checkpoints=True: input should be 'digests', 'structure' or 'off'"),
    ("checks: {learning: {window: 0}}", "checks.learning.window=0: input should be greater than or equal to 1"),
    ("checks: {rollout_vs_trainer_pearson_min: '0.97'}",
     "checks.rollout_vs_trainer_pearson_min='0.97': input should be a valid number"),
    ("checks: {route_agreement_min: -1}", "checks.route_agreement_min=-1: input should be greater than 0"),
    ("checks: {route_agreement_min: 1.5}", "checks.route_agreement_min=1.5: input should be less than or equal to 1"),
    ("data: {train_size: -5}", "data.train_size=-5: input should be greater than or equal to 1"),
    ("rollout: {gpu_memory_utilization: 1.7}", "rollout.gpu_memory_utilization=1.7: input should be less than or equal to 1"),
    ("weights: {source: shipped, path: null}", "weights.source=shipped needs weights.path"),
    ("weights: {source: shipped, path: no/such/dir}", "no directory"),
    ("recipe: examples/x.yaml", "unknown section 'recipe'"),
    ("run: {steeps: 3}", r"unknown key run.steeps .*allowed in run: project, experiment, timeout_s"),
    ("layout: {tp: 2, ppp: 1}", r"unknown key layout.ppp; did you mean 'pp'"),
    ("layout: {tp: two}", r"layout.tp='two': input should be a valid integer"),
    ("rollout: {gpu_memory_utilization: lots}", r"rollout.gpu_memory_utilization='lots': input should be a valid number"),
    ("checks: {learning: {window: 2.5}}", r"checks.learning.window=2.5: input should be a valid integer"),
])
def test_checks_run_and_weights_keys_are_checked(tmp_path, text, match):
    """The preset schema (pydantic models, unknown keys forbidden): one line naming the file, key and allowed keys."""
    base = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3" / "presets" / "tiny_cpu.yaml"
    good = _write(tmp_path, "ok.yaml", f"extends: {base}\n")
    assert load_preset(good).checks is not None  # twin: the base alone loads
    bad = _write(tmp_path, "bad.yaml", f"extends: {base}\n{text}\n")
    with pytest.raises(PresetError, match=match):
        load_preset(bad)


# ---------------------------------------------------------------------------------- overrides


@pytest.mark.parametrize("value", ["671b_512xH100", "Et|(tt|)*30L", "a b", "it's", "1e5", "123", "true", "null", "",
                                   "/a/b-c.d", "~/x", 1e-6, 0.0, 3, True, None, [1, "a b", None], {"x": 1, "y": "q r"}])
def test_hydra_value_round_trips_through_hydras_parser(value):
    (o,) = parse_overrides([f"k={hydra_value(value)}"])
    assert o.value == value and type(o.value) is type(value)


def test_flatten_and_set_dotted():
    t: dict = {}
    set_dotted(t, "a.b.c", 1)
    set_dotted(t, "a.d", [1, 2])
    set_dotted(t, "e", {})
    assert flatten(t) == [("a.b.c", 1), ("a.d", [1, 2]), ("e", {})]
    assert "\\\n" in shell_join(["python", "-m", "x", "a=1", "b='c d'"])


# ------------------------------------------------------------------------------------- checks

DSV3 = {"model_type": "deepseek_v3", **model_presets.preset_kwargs("deepseek-v3")}


def sizes(**kw) -> checks.Sizes:
    """The 512-GPU layout; KW sets Layout fields (``first``/``last``: the first/last pipeline stage's layers)
    or Sizes fields."""
    lay = dict(tp=8, pp=16, ep=32, etp=1, cp=1, vpp=None, first_stage_layers=4, last_stage_layers=1)
    d = dict(world=512, nnodes=64, gpus_per_node=8, rollout_tp=8, rollout_dp=8, rollout_ep=64, rollout_pp=1)
    for k, v in kw.items():
        k = {"first": "first_stage_layers", "last": "last_stage_layers"}.get(k, k)
        (lay if k in LAYOUT_KEYS else d)[k] = v
    return checks.Sizes(layout=Layout(**lay), **d)


def errors(findings, check=None):
    return [f for f in findings if f.level == "error" and (check is None or f.check == check)]


def test_parallel_checks_pass_on_the_512_gpu_layout():
    assert errors(checks.check_parallel(DSV3, sizes())) == []
    assert sizes().dp == 4


@pytest.mark.parametrize("kw, check, text", [
    (dict(first=None, last=None), "layers_vs_pp", r"num_hidden_layers=61 is not divisible by PP=16.*first/last = "),
    (dict(first=4, last=2), "layers_vs_pp", r"leaves 55 layers for 14 middle stages"),
    (dict(pp=64, first=None, last=None), "layers_vs_pp", r"PP=64 pipeline stages for num_hidden_layers=61"),
    (dict(ep=48), "experts_vs_ep", r"n_routed_experts=256 is not divisible by EP=48"),
    (dict(tp=3), "heads_vs_tp", r"num_attention_heads=128 is not divisible by TP=3"),
    (dict(world=500, nnodes=125, gpus_per_node=4), "gpus_vs_tp_pp_dp", r"500 GPUs .* TP\*PP\*CP = 8\*16\*1 = 128"),
    (dict(ep=64, pp=16, world=512), "gpus_vs_ep", r"ETP\*EP\*PP = 1\*64\*16 = 1024"),
    (dict(rollout_tp=1024, rollout_dp=1, rollout_ep=1), "rollout_vs_gpus", r"1024 GPUs but there are 512"),
    (dict(rollout_tp=16, rollout_dp=3, rollout_ep=1), "rollout_vs_gpus", r"not divisible by the vLLM engine size .* = 48"),
    (dict(rollout_ep=32), "rollout_ep", r"rollout EP=32 must equal rollout TP\*DP = 64"),
])
def test_parallel_checks_planted_faults_name_the_values(kw, check, text):
    errs = errors(checks.check_parallel(DSV3, sizes(**kw)), check)
    assert errs, f"{kw}: expected a {check} error"
    assert any(__import__("re").search(text, e.message) for e in errs), [e.message for e in errs]


def test_uneven_pipeline_suggestions_are_valid_splits():
    import re

    (err,) = errors(checks.check_pipeline(61, sizes(first=None, last=None)))
    pairs = re.findall(r"(\d+)/(\d+) \(", err.message)
    assert pairs, err.message
    for f, last in pairs:  # every suggested split passes the same check ...
        assert errors(checks.check_pipeline(61, sizes(first=int(f), last=int(last)))) == [], (f, last)
    assert errors(checks.check_pipeline(61, sizes(first=5, last=1)))  # ... and a wrong one does not


def test_docs_preset_table_is_what_list_prints(capsys):
    """docs/launcher.md says its preset table is `python -m dsv3_rl.launch list --markdown`; keep it so."""
    from dsv3_rl.launch.cli import cmd_list

    assert cmd_list(["--markdown"]) == 0
    table = capsys.readouterr().out.strip()
    doc = (PRESET_DIR.parents[2] / "docs" / "launcher.md").read_text()
    assert table in doc, "docs/launcher.md's preset table differs from `python -m dsv3_rl.launch list --markdown`:\n" + table
    # twin: a changed preset value would no longer be found
    assert table.replace("TP32 @0.6", "TP16 @0.6") not in doc


def test_docs_preset_example_is_the_shipped_file():
    doc = (PRESET_DIR.parents[2] / "docs" / "launcher.md").read_text()
    assert (PRESET_DIR / "671b_512xH100.yaml").read_text() in doc


def test_layout_dispatcher_becomes_the_verl_key(tmp_path):
    """`layout` takes every dsv3_rl.layout.Layout field; the dispatcher goes to override_transformer_config."""
    from dsv3_rl.verl_glue.overrides import get_dotted
    from dsv3_rl.launch.run import derived_tree

    base = PRESET_DIR / "tiny_cpu.yaml"
    model_cfg = {"model_type": "deepseek_v3", **model_presets.preset_kwargs("tiny-vllm")}
    key = "actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type"
    plain = derived_tree(load_preset(_write(tmp_path, "a.yaml", f"extends: {base}\n")), model_cfg)
    assert get_dotted(plain, key) is None  # twin: unset, verl's default
    p = load_preset(_write(tmp_path, "b.yaml", f"extends: {base}\nlayout: {{dispatcher: allgather}}\n"))
    assert get_dotted(derived_tree(p, model_cfg), key) == "allgather"


def test_cpu_rollout_at_tp1_runs_the_model_in_the_engine_core(tmp_path):
    """CPU presets at rollout tp 1 ask vLLM for its one-process executor (no worker process beside each EngineCore,
    issue 28), and env/cpu.sh lets vLLM's CPU platform keep it (VLLM_ENABLE_V1_MULTIPROCESSING=0; with 1 it turns
    "uni" back into "mp"). Twins: a GPU preset and a CPU rollout at tp 2 keep verl's "mp"."""
    from dsv3_rl.verl_glue.overrides import get_dotted
    from dsv3_rl.launch.run import derived_tree, env_from_file

    key = "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend"
    model_cfg = {"model_type": "deepseek_v3", **model_presets.preset_kwargs("tiny-vllm")}
    for name in ("tiny_cpu", "tiny_cpu_dapo", "tiny_cpu_gspo", "tiny_cpu_one_step_off", "tiny_cpu_gsm8k"):
        p = load_preset(name)
        assert get_dotted(derived_tree(p, model_cfg), key) == "uni", name
        assert env_from_file(p.env_path(), {}).get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", name
    tp2 = load_preset(_write(tmp_path, "tp2.yaml", f"extends: {PRESET_DIR / 'tiny_cpu.yaml'}\n"
                                                   "rollout: {name: vllm, tp: 2, dp: 1}\n"))
    assert get_dotted(derived_tree(tp2, model_cfg), key) is None  # twin: vLLM needs its multiprocess executor
    gpu = load_preset("tiny_1xH100")
    assert gpu.rollout.get("tp", 1) == 1 and not gpu.is_cpu
    assert get_dotted(derived_tree(gpu, model_cfg), key) is None  # twin: GPU engines keep verl's choice
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env_from_file(gpu.env_path(), {})
    # vLLM itself: its CPU platform keeps "uni" only when the engine's multiprocessing switch is off
    import importlib.util

    src = Path(importlib.util.find_spec("vllm").origin).parent / "platforms" / "cpu.py"
    text = src.read_text()
    assert 'os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"' in text and \
        'distributed_executor_backend = "mp"' in text, f"{src}: vLLM's rule changed; revisit run.derived_tree"


def test_lr_warmup_not_below_the_decay_steps_is_refused_at_dry_run():
    """megatron-core asserts lr_warmup_steps < lr_decay_steps only once the model is on the GPUs (proxy_4xH100 on the
    GPU box, 2026-11-28: 10 warm-up steps of _grpo_math over a 4-step run). The dry run says it first; twins: a
    warm-up below the total, a run whose total comes from the data, and the ratio form."""
    from omegaconf import OmegaConf

    def cfg(total, warm=None, ratio=None, decay=None):
        return OmegaConf.create({"trainer": {"total_training_steps": total}, "actor_rollout_ref": {"actor": {"optim": {
            "lr_warmup_steps": warm, "lr_warmup_steps_ratio": ratio, "lr_decay_steps": decay}}}})

    f = checks.check_lr_schedule(cfg(4, warm=10))
    assert len(f) == 1 and f[0].level == "error", f
    assert "lr_warmup_steps=10 is not below the LR decay steps (trainer.total_training_steps=4)" in f[0].message
    assert checks.check_lr_schedule(cfg(4, warm=3)) == []
    assert checks.check_lr_schedule(cfg(None, warm=10)) == []
    assert checks.check_lr_schedule(cfg(20, warm=0, ratio=1.0))[0].level == "error"  # ratio 1.0: warm-up == decay
    assert checks.check_lr_schedule(cfg(20, warm=0, ratio=0.1)) == []
    assert "optim.lr_decay_steps=5" in checks.check_lr_schedule(cfg(100, warm=5, decay=5))[0].message


@pytest.mark.parametrize("hw", ["h100", "h20"])
def test_gpu_env_names_no_socket_interface_the_host_lacks(hw):
    """env/h100.sh and env/h20.sh default NCCL/Gloo to eth0 (or MLP_SOCKET_IFNAME) only where the host has that
    interface: a single-node box without eth0 would otherwise fail Gloo's 'Unable to find address for: eth0' in every
    worker. Twins: an interface the host has (lo) is set, and a value the job set itself is always kept."""
    from dsv3_rl.launch.run import env_from_file

    f = PRESET_DIR.parent / "env" / f"{hw}.sh"
    env = env_from_file(f, {"PATH": "/usr/bin:/bin", "MLP_SOCKET_IFNAME": "nosuchnic0"})
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env, env
    env = env_from_file(f, {"PATH": "/usr/bin:/bin", "MLP_SOCKET_IFNAME": "lo"})
    assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    env = env_from_file(f, {"PATH": "/usr/bin:/bin", "NCCL_SOCKET_IFNAME": "nosuchnic0"})
    assert env.get("GLOO_SOCKET_IFNAME") == "nosuchnic0"  # the job's own choice is not second-guessed
