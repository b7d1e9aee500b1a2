"""Correctness-suite machinery without megatron processes: loss normalisation, HF hooks, the
fused-expert gradient split, reassembly of sharded records, metrics, report format, faults."""

from __future__ import annotations

import re

import pytest
import torch

from dsv3_rl.correctness import assemble, compare, data, faults, layouts
from dsv3_rl.correctness.compare import TOLERANCES, Check


# -- data / loss ---------------------------------------------------------------------------------
def test_loss_is_mean_of_micro_batch_token_means_not_global_token_mean():
    b = data.make_batch(100, 4, 16, seed=3)
    mask = b["loss_mask"]
    assert mask.sum(-1).unique().numel() > 1, "the mask must be ragged, or normalisation is not tested"
    ce = torch.rand(4, 16, dtype=torch.float64)
    got = data.training_loss(ce, mask, micro_batch_size=2)
    want = torch.stack([(ce[i:i + 2] * mask[i:i + 2]).sum() / mask[i:i + 2].sum() for i in (0, 2)]).mean()
    assert torch.allclose(got, want)
    assert not torch.allclose(got, (ce * mask).sum() / mask.sum())


def test_micro_batches_follow_data_parallel_rank():
    b = data.make_batch(100, 8, 4)
    mb = data.micro_batches(b, 2, dp_rank=1, dp=2)
    assert len(mb) == 2 and torch.equal(mb[0]["tokens"], b["tokens"][4:6]) and torch.equal(mb[1]["tokens"], b["tokens"][6:8])
    with pytest.raises(ValueError, match="not divisible"):
        data.micro_batches(b, 3)


# -- HF side -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from dsv3_rl.correctness.reference import load_hf
    from dsv3_rl.minimodel.mini_model import write_mini_model

    path = write_mini_model("tiny", tmp_path_factory.mktemp("hf") / "m", dtype="fp32")
    return load_hf(path)


def test_hf_hooks_record_every_component_consistently(hf_model):
    from dsv3_rl.correctness.reference import run_reference

    b = data.make_batch(hf_model.config.vocab_size, 2, 8)
    rec, info, grads = run_reference(hf_model, b, micro_batch_size=1)
    cfg = hf_model.config
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    assert set(rec) == ({"logits"} | {f"L{i}/{c}" for i in range(cfg.num_hidden_layers) for c in ("attn", "layer")}
                        | {"L0/mlp"} | {f"L{i}/{c}" for i in range(1, cfg.num_hidden_layers)
                                        for c in ("router_scores", "topk", "router_probs", "routed", "shared")})
    assert rec["L1/topk"].shape == (2, 8, e) and (rec["L1/topk"].sum(-1) == k).all()
    # probs live exactly on the selected experts, sum to routed_scaling_factor (norm_topk_prob)
    assert torch.equal(rec["L1/router_probs"] > 0, rec["L1/topk"])
    assert torch.allclose(rec["L1/router_probs"].sum(-1), torch.full((2, 8), cfg.routed_scaling_factor), atol=1e-5)
    # the recorded selection is HF's own group-limited top-k of the recorded scores
    scores = rec["L1/router_scores"].view(-1, e)
    idx, _ = hf_model.model.layers[1].mlp.route_tokens_to_experts(torch.logit(scores.double()).float())
    sel = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(sel.view(2, 8, e), rec["L1/topk"])
    assert info["micro_losses"].shape == (2,) and torch.isfinite(torch.tensor(info["loss"]))
    assert len(grads) == len([n for n in grads if "experts." not in n or ".shared_experts." in n]) + 3 * e * 3


def test_hf_fused_expert_grads_split_into_hub_names(hf_model):
    from dsv3_rl.correctness.reference import hub_grads

    cfg = hf_model.config
    moe = hf_model.model.layers[1].mlp.experts
    for p in hf_model.parameters():
        p.grad = torch.zeros_like(p)
    moe.gate_up_proj.grad = torch.arange(moe.gate_up_proj.numel(), dtype=torch.float32).view_as(moe.gate_up_proj)
    moe.down_proj.grad = -torch.arange(moe.down_proj.numel(), dtype=torch.float32).view_as(moe.down_proj)
    g = hub_grads(hf_model)
    i = cfg.moe_intermediate_size
    pre = "model.layers.1.mlp.experts"
    assert torch.equal(g[f"{pre}.5.gate_proj.weight"], moe.gate_up_proj.grad[5, :i])
    assert torch.equal(g[f"{pre}.5.up_proj.weight"], moe.gate_up_proj.grad[5, i:])
    assert torch.equal(g[f"{pre}.2.down_proj.weight"], moe.down_proj.grad[2])
    assert f"{pre}.gate_up_proj" not in g
    hf_model.zero_grad(set_to_none=True)


# -- reassembly of megatron's per-rank records ----------------------------------------------------
def _rank(tmp, rank, tp_rank, dp_rank, records, n_micro=1, losses=None):
    (tmp / "acts").mkdir(exist_ok=True)
    meta = dict(rank=rank, tp_rank=tp_rank, tp=2, pp_rank=0, dp_rank=dp_rank, dp=1, n_micro=n_micro,
                micro_batch_size=2, seq_length=4, sequence_parallel=True)
    torch.save({"meta": meta, "records": records, "losses": losses}, tmp / "acts" / f"rank{rank}.pt")


def test_assemble_sequence_and_vocab_shards(tmp_path):
    full = torch.randn(4, 2, 3)  # [s, b, h]
    logits = torch.randn(4, 2, 10)
    scores = torch.rand(4, 2, 8)
    recs = [{"L0/attn": [full[2 * r:2 * r + 2]], "logits": [logits[..., 5 * r:5 * r + 5]],
             "L0/router_scores": [scores[2 * r:2 * r + 2].reshape(-1, 8)]} for r in (0, 1)]
    _rank(tmp_path, 0, 0, 0, recs[0], losses=[1.5])
    _rank(tmp_path, 1, 1, 0, recs[1], losses=[1.5])
    out, info = assemble.assemble(tmp_path, batch_size=2, seq_length=4)
    assert torch.equal(out["L0/attn"], full.transpose(0, 1))
    assert torch.equal(out["logits"], logits.transpose(0, 1))
    assert torch.equal(out["L0/router_scores"], scores.transpose(0, 1))
    assert info["loss"] == 1.5 and info["replica_max_diff"] == 0


def test_assemble_replicas_must_agree_and_micro_batches_be_complete(tmp_path):
    x = torch.randn(4, 2, 3)
    _rank(tmp_path, 0, 0, 0, {"L0/attn": [x]}, losses=[1.0])
    _rank(tmp_path, 1, 1, 0, {"L0/attn": [x + 1e-3]}, losses=[1.0])
    _, info = assemble.assemble(tmp_path, batch_size=2, seq_length=4)
    assert info["replica_max_diff"] == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(assemble.AssemblyError, match="micro-batch"):
        assemble.assemble(tmp_path, batch_size=4, seq_length=4)


# -- metrics, tolerances, report ---------------------------------------------------------------------
def test_compare_records_catches_each_kind_of_difference():
    tol = TOLERANCES["fp32"]
    ref = {"L1/attn": torch.randn(2, 4, 8), "L1/topk": torch.zeros(2, 4, 8, dtype=torch.bool),
           "L1/router_probs": torch.zeros(2, 4, 8)}
    ref["L1/topk"][..., :2] = True
    ref["L1/router_probs"][..., :2] = 1.25
    same = {k: v.clone() for k, v in ref.items()}
    assert all(c.passed for c in compare.compare_records(same, ref, tol))
    bad = {k: v.clone() for k, v in ref.items()}
    bad["L1/attn"] *= 1 + 1e-4
    bad["L1/topk"][0, 0, 1], bad["L1/topk"][0, 0, 5] = False, True  # one token routes differently
    res = {c.name: c for c in compare.compare_records(bad, ref, tol)}
    assert not res["Layer 1 Attention Output"].passed
    agree = res["Layer 1 Router Top-k Agreement"]
    assert not agree.passed and agree.value == pytest.approx(1 - 0.5 / 8)
    assert res["Layer 1 Router Probs (top-k weights)"].passed  # compared where the sets agree
    missing = compare.compare_records({}, ref, tol)
    assert not missing[0].passed


def test_compare_grads_zero_reference_and_missing_names():
    tol = TOLERANCES["fp32"]
    ref = {"model.layers.1.mlp.experts.0.up_proj.weight": torch.zeros(3, 3),
           "model.layers.1.self_attn.o_proj.weight": torch.ones(3, 3)}
    ok = compare.compare_grads({k: v.clone() for k, v in ref.items()}, ref, tol)
    assert all(c.passed for c in ok)
    cand = {k: v.clone() for k, v in ref.items()}
    cand["model.layers.1.mlp.experts.0.up_proj.weight"][0, 0] = 1e-9  # zero reference: any grad is wrong
    assert not all(c.passed for c in compare.compare_grads(cand, ref, tol))
    del cand["model.layers.1.self_attn.o_proj.weight"]
    assert any("Every parameter" in c.name and not c.passed for c in compare.compare_grads(cand, ref, tol))


def test_grad_groups_cover_both_naming_schemes():
    assert compare.grad_group("model.layers.3.mlp.experts.7.down_proj.weight")[1] == "Layer 3 Routed Experts"
    assert compare.grad_group("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight")[1] == "Layer 3 Routed Experts"
    assert compare.grad_group("model.layers.1.mlp.gate.weight")[1] == "Layer 1 Router"
    assert compare.grad_group("decoder.layers.0.pre_mlp_layernorm.weight")[1] == "Layer 0 Norms"
    assert compare.grad_group("lm_head.weight")[1] == compare.grad_group("output_layer.weight")[1]


SEED_LINE = re.compile(r"^(PASS|FAIL): .+ - Max diff: \S+, Avg diff: \S+")


def test_report_lines_in_the_seed_format():
    c = Check("MLA", "Layer 0 Attention Output", True, 1.2e-7, 3e-8, "rel", 2e-7, 1e-5)
    assert SEED_LINE.match(c.line()), c.line()
    assert c.line().startswith("PASS: Layer 0 Attention Output - Max diff: 1.2e-07, Avg diff: 3e-08")
    assert Check("MLA", "x", False, 1.0, 0.5, "rel", 1.0, 1e-5).line().startswith("FAIL: x - Max diff")


def test_tolerances_stated_per_dtype():
    assert TOLERANCES["fp32"].act_rel == 1e-5 and TOLERANCES["fp32"].topk_agreement == 1.0
    assert TOLERANCES["bf16"].act_rel > TOLERANCES["fp32"].act_rel
    assert "bf16" in TOLERANCES["bf16"].note


# -- layouts and faults -----------------------------------------------------------------------------
def test_layout_world_and_data_parallel_size():
    assert layouts.get("ep2").world == 2 and layouts.get("ep2").dp(2) == 2
    assert layouts.get("tp2_ep2").world == 2 and layouts.get("tp2_ep2").dp(2) == 1
    assert layouts.get("tp2_sp").sp_ and not layouts.get("tp2_nosp").sp_
    assert layouts.get("tp2_sp").etp_ == 1 and layouts.get("tp2_etp2").etp_ == 2  # the suite's ETP default is 1
    assert layouts.from_sizes(tp=2).name == "tp2_sp"
    assert layouts.from_sizes(tp=1, pp=2).name == "pp2"
    assert layouts.from_sizes(tp=4, ep=8).world == 8
    with pytest.raises(KeyError, match="allowed"):
        layouts.get("tp3")
    assert layouts.get("tp=2,ep=2") is layouts.get("tp2_ep2")  # the package's one layout syntax
    assert layouts.get("tp=4,ep=8").name == "tp4_ep8" and layouts.get("tp=4,ep=8").etp_ == 1
    with pytest.raises(ValueError, match="unknown key 'tpp'"):
        layouts.get("tpp=2")


def test_weight_faults_edit_what_they_say():
    sd = {"decoder.layers.1.mlp.router.weight": torch.zeros(8, 4),
          "decoder.layers.1.mlp.router.expert_bias": torch.zeros(8)}
    for e in range(2):
        sd[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.full((4, 4), float(e))
        sd[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"] = torch.full((4, 2), float(e))
    changed = faults.swap_experts(sd)
    assert len(changed) == 4 and sd["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"][0, 0] == 1
    assert faults.perturb_router_bias(sd) == ["decoder.layers.1.mlp.router.expert_bias"]
    assert sd["decoder.layers.1.mlp.router.expert_bias"].abs().max() > 0.01


def test_every_fault_is_documented_and_listed():
    import dsv3_rl.correctness.faults as mod

    for name, f in faults.FAULTS.items():
        assert name in mod.__doc__, f"{name} missing from the faults table"
        assert f.weight_edit or f.mcore_config_overrides or f.hf_config_overrides or f.revert_patch
    with pytest.raises(KeyError, match="allowed"):
        faults.get("nope")


def test_unexpressible_config_is_refused_before_any_run(tmp_path):
    """rope_interleave=False: refused by the config mapping -> FAIL with exit status 1, no launch."""
    from dsv3_rl.correctness.runner import Options, run_suite

    lines = []
    rc = run_suite(Options(layouts=["tp1"], fault="rope-interleave-false", work=str(tmp_path)), out=lines.append)
    text = "\n".join(lines)
    assert rc == 1
    assert "REFUSED: rope_interleave=False" in text and "Overall Result =============\nFAIL" in text
    assert not list(tmp_path.glob("launch_*")), "a refused config must not start megatron"


def test_bf16_judges_routed_expert_grads_per_layer():
    """One token routed differently moves its gradient between two experts: per expert that can be a
    large relative change, per layer it is small. bf16 judges per layer, fp32 per tensor."""
    ref = {f"model.layers.1.mlp.experts.{e}.up_proj.weight": torch.ones(4, 4) * (10 if e else 0.1) for e in range(8)}
    cand = {k: v.clone() for k, v in ref.items()}
    cand["model.layers.1.mlp.experts.0.up_proj.weight"] *= 1.5  # 50% off on a nearly idle expert
    assert not all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["fp32"]))
    assert all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["bf16"]))
    assert all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["bf16"], per_tensor=True))
    cand["model.layers.1.mlp.experts.3.up_proj.weight"] *= 1.5  # a busy expert 50% off: fails either way
    assert not all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["bf16"]))
    assert not all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["bf16"], per_tensor=True))


def test_bf16_router_grad_limit_is_its_own_and_still_fails():
    """bf16: the gate weight gradient may be 0.2 off (top-k flips), other tensors only 0.1; a router
    gradient 30% off, or an MLA weight 15% off, still fails."""
    ref = {"model.layers.1.mlp.gate.weight": torch.ones(8, 4), "model.layers.1.self_attn.q_a_proj.weight": torch.ones(4, 4)}
    cand = {k: v.clone() for k, v in ref.items()}
    cand["model.layers.1.mlp.gate.weight"] *= 1.15
    assert all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["bf16"]))
    assert not all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["fp32"]))
    cand["model.layers.1.mlp.gate.weight"] = ref["model.layers.1.mlp.gate.weight"] * 1.3
    assert not all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["bf16"]))
    cand["model.layers.1.mlp.gate.weight"] = ref["model.layers.1.mlp.gate.weight"].clone()
    cand["model.layers.1.self_attn.q_a_proj.weight"] *= 1.15
    assert not all(c.passed for c in compare.compare_grads(cand, ref, TOLERANCES["bf16"]))
