"""The planner's divisibility rules and pipeline split are megatron-core 0.16.1's own: for many
layouts, the planner's verdict and layer assignment are compared with what megatron itself does
(``TransformerConfig.__post_init__``, ``get_num_layers_to_build``, ``get_transformer_layer_offset``,
``PipelineParallelLayerLayout``, ``initialize_model_parallel`` with a faked world size). A planted
fault (a rule set without the ETP*EP*PP check) must disagree with megatron."""

from __future__ import annotations

import itertools
from unittest import mock

import megatron.core  # noqa: F401 - imported, not skipped: a broken megatron install fails here
import pytest
import torch

from dsv3_rl.planner.pipeline import balanced_layout, split_layers
from dsv3_rl.planner.rules import trainer_rules
from dsv3_rl.planner.spec import GRPOShape, Layout, Options


def megatron_split(num_layers, pp, vpp, first=None, last=None, acc_emb=False, acc_loss=False, layout=None):
    """Per (pp_rank, vp_stage): (num decoder layers, first layer offset) as megatron computes them,
    or the exception megatron raises."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        cfg = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=8,
                                pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                pipeline_dtype=torch.bfloat16 if pp > 1 else None,
                                num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                account_for_embedding_in_pipeline_split=acc_emb, account_for_loss_in_pipeline_split=acc_loss,
                                pipeline_model_parallel_layout=layout, mtp_num_layers=None)
        vs = cfg.virtual_pipeline_model_parallel_size or 1
        out = {}
        for r in range(pp):
            for v in range(vs):
                stage = v if cfg.virtual_pipeline_model_parallel_size else None
                if cfg.pipeline_model_parallel_layout is not None:
                    lay = cfg.pipeline_model_parallel_layout
                    n = lay.layout[r][v].count(LayerType.decoder)
                    off = sum(lay.layout[rr][vv].count(LayerType.decoder) for vv in range(v + 1)
                              for rr in range(pp if vv < v else r))
                else:
                    n = get_num_layers_to_build(cfg, vp_stage=stage, pp_rank=r)
                    off = get_transformer_layer_offset(cfg, vp_stage=stage, pp_rank=r)
                out[(r, v)] = (n, off)
        return out
    except (ValueError, AssertionError, RuntimeError) as e:
        return e


def planner_split(num_layers, pp, vpp, first=None, last=None, acc_emb=False, acc_loss=False, layout=None):
    split, v = split_layers(num_layers, pp, vpp, layout=layout, first=first, last=last, account_for_embedding=acc_emb,
                            account_for_loss=acc_loss)
    if split is None:
        return v
    return {(r, c): (len(st.decoder), st.decoder[0] if st.decoder else None)
            for r, row in enumerate(split.stages) for c, st in enumerate(row)}


def _cases():
    out = []
    for L, pp, vpp in itertools.product((61, 12, 8, 7), (2, 3, 4, 8), (None, 2)):
        out.append((L, pp, vpp, None, None, False, False, None))
        out.append((L, pp, vpp, None, None, True, True, None))
        for first, last in ((None, 1), (2, None), (2, 2), (4, 6), (1, 5), (6, None)):
            out.append((L, pp, vpp, first, last, False, False, None))
    out += [(61, 12, None, None, 6, False, False, None), (61, 8, 4, None, None, False, False, "Et|(tt|)*30L"),
            (61, 32, None, None, None, False, False, balanced_layout(61, 32)),
            (61, 16, 2, None, None, False, False, balanced_layout(61, 16, 2)),
            (61, 12, None, None, None, False, False, balanced_layout(61, 12)),
            (61, 8, None, None, None, False, False, "Et*8|(t*8|)*6t*5L"),
            (61, 8, None, None, None, False, False, "Et*8|(t*8|)*6t*4L"),   # 60 decoder layers: rejected
            (61, 6, None, None, None, False, False, "Et|(tt|)*30L"),        # 32 stages over PP=6: rejected
            (61, 8, 2, None, None, False, False, "Et|(tt|)*30L"),           # layout means VPP=4, not 2: rejected
            (61, 4, None, None, 6, False, False, "Et|(tt|)*30L")]           # layout + uneven: rejected
    return out


@pytest.mark.parametrize("case", _cases(), ids=lambda c: "-".join(str(x) for x in c))
def test_split_matches_megatron(case):
    L, pp, vpp, first, last, acc_emb, acc_loss, layout = case
    mine = planner_split(L, pp, vpp, first, last, acc_emb, acc_loss, layout)
    theirs = megatron_split(L, pp, vpp, first, last, acc_emb, acc_loss, layout)
    if not isinstance(theirs, Exception) and any(n < 0 for n, _ in theirs.values()):
        # megatron 0.16.1 accepts first+last > num_layers and computes a negative middle stage
        # (it breaks later when building the model); the planner rejects it up front
        assert isinstance(mine, list) and any(v.rule == "pp.middle_negative" for v in mine), mine
        return
    if isinstance(theirs, Exception):
        assert isinstance(mine, list) and mine, f"megatron rejects ({theirs}) but the planner accepts {mine}"
    else:
        assert not isinstance(mine, list), f"megatron accepts {theirs} but the planner rejects: {[str(v) for v in mine]}"
        assert {k: v[0] for k, v in mine.items()} == {k: v[0] for k, v in theirs.items()}
        assert {k: v[1] for k, v in mine.items() if v[0]} == {k: v[1] for k, v in theirs.items() if v[0]}


def megatron_init_error(world, tp, pp, cp, ep, etp, vpp):
    """Run megatron's initialize_model_parallel with a faked world size; the error it raises
    before building groups (or None)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with mock.patch.object(dist, "is_initialized", return_value=True), \
            mock.patch.object(dist, "get_world_size", return_value=world), \
            mock.patch.object(dist, "get_rank", return_value=0), \
            mock.patch.object(ps, "create_group", return_value=None):
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
            return None
        except (RuntimeError, AssertionError) as e:
            return e
        finally:
            ps.destroy_model_parallel()


class _M:  # just what trainer_rules reads for the parallel_state rules
    num_heads, num_experts, moe_ffn, shared_ffn, dense_ffn, vocab = 64, 64, 64, 64, 64, 64
    num_layers, num_dense_layers = 8, 1
    q_lora_rank, kv_lora_rank, qk_rope_dim = 64, 64, 0


PS_RULES = {"mcore.world_div_tp_pp_cp", "mcore.world_div_etp_ep_pp"}


def _state_cases():
    out = []
    for world, tp, pp, cp, ep, etp in itertools.product((8, 24, 64), (1, 2, 4), (1, 2, 3), (1, 2), (1, 4, 16), (1, 2)):
        out.append((world, tp, pp, cp, ep, etp, None))
    out += [(16, 2, 1, 1, 1, 1, 2), (16, 2, 2, 1, 1, 1, 2)]
    return out


def planner_state_verdict(world, tp, pp, cp, ep, etp, vpp, rules=trainer_rules):
    lay = Layout(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp, sp=tp > 1)
    g = GRPOShape(prompts_per_step=world * 8, n_samples=1, max_prompt_len=8, max_response_len=8)
    v = [x.rule for x in rules(_M, world, lay, g, Options()) if x.rule in PS_RULES]
    _, pv = split_layers(8, pp, vpp)
    v += [x.rule for x in pv if x.rule == "pp.vpp_needs_pp"]
    return v


def test_parallel_state_rules_match_megatron():
    for case in _state_cases():
        theirs = megatron_init_error(*case)
        mine = planner_state_verdict(*case)
        assert bool(mine) == (theirs is not None), (case, mine, theirs)


def test_planted_fault_missing_expert_rule_disagrees():
    """Twin: without the ETP*EP*PP rule the planner must disagree with megatron somewhere."""
    def faulty(*a, **k):
        return [x for x in trainer_rules(*a, **k) if x.rule != "mcore.world_div_etp_ep_pp"]

    disagreements = [c for c in _state_cases()
                     if bool(planner_state_verdict(*c, rules=faulty)) != (megatron_init_error(*c) is not None)]
    assert disagreements


@pytest.mark.parametrize("tp,heads,sp", [(1, 8, False), (2, 8, True), (3, 8, True), (8, 8, True), (16, 8, True),
                                         (1, 8, True), (4, 6, True)])
def test_config_rules_match_megatron(tp, heads, sp):
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=heads, tensor_model_parallel_size=tp,
                          sequence_parallel=sp)
        theirs = False
    except ValueError:
        theirs = True

    class M(_M):
        num_heads = heads
        num_experts = 0

    lay = Layout(tp=tp, pp=1, ep=1, sp=sp)
    g = GRPOShape(prompts_per_step=tp * 8, n_samples=1, max_prompt_len=8, max_response_len=8)
    mine = [x.rule for x in trainer_rules(M, tp * 8, lay, g, Options()) if x.rule in ("mcore.heads_div_tp", "mcore.sp_needs_tp")]
    assert bool(mine) == theirs, (tp, heads, sp, mine)
