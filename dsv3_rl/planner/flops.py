"""The planner's FLOP count next to the two others a user meets, term by term (``dsv3-plan flops``).

Our count is :func:`dsv3_rl.planner.comm.flop_terms` (the one implementation; the planner and
``bench/bench_grpo_update.py``'s MFU use it). The other two are restated here in the same terms, only to explain
the difference (docs/planner.md, "The FLOP count"):

* :func:`verl_terms`: verl 0.9.1's ``FlopsCounter`` for ``deepseek_v3`` (``verl/utils/flops_counter.py``
  ``_estimate_deepseek_v3_flops``; what verl's workers log as ``perf/mfu``). The restatement is tested equal to
  verl's own function (tests/unit/test_planner_phases.py).
* :func:`megatron_terms`: Megatron-LM's ``num_floating_point_operations`` (``megatron/training/training.py``,
  the MLA + MoE branch of ``transformer_flops``; what Megatron-LM and Megatron-Bridge report as model TFLOP/s),
  with the attention per sequence (Megatron uses one ``seq_length`` for every sample; for packed sequences of
  different lengths the same rule applies to each) and the vocabulary unpadded.

All three count one forward pass (training = 3 x).
"""

from __future__ import annotations

from dsv3_rl.planner import comm


def verl_terms(m, seq_lens) -> dict[str, float]:
    """verl 0.9.1's DeepSeek-V3 count split into :data:`comm.FLOP_TERMS`, one forward pass (verl's number / 3).
    verl counts ``6 x N x tokens + 3 x sum(s^2) x layers x heads x (qk_head_dim + v_head_dim)`` with N = the MLA
    projections + router + (top-k + shared) experts per MoE layer + dense MLP + ``vocab x hidden x 2``
    (``emd_and_lm_head_N``: the output layer and the input embedding, a lookup, as a second matmul)."""
    h, nh, layers = m.hidden, m.num_heads, m.num_layers
    moe = layers - m.first_k_dense  # verl: every layer from first_k_dense_replace on is MoE (moe_layer_freq ignored)
    q_in = m.q_lora_rank or h
    per_token = {
        "mla_down": layers * ((h * m.q_lora_rank if m.q_lora_rank else 0) + h * m.kv_lora_rank),
        "mla_up": layers * (q_in * nh * m.qk_nope_dim + nh * (m.qk_nope_dim + m.v_head_dim) * m.kv_lora_rank),
        "mla_rope": layers * (q_in * nh * m.qk_rope_dim + h * m.qk_rope_dim),
        "mla_out": layers * nh * m.v_head_dim * h,
        "dense_mlp": m.first_k_dense * 3 * h * m.dense_ffn,
        "router": moe * h * m.num_experts,
        "routed_experts": moe * 3 * h * m.moe_ffn * m.topk,
        "shared_experts": moe * 3 * h * m.moe_ffn * m.num_shared_experts,
        "lm_head": m.vocab * h,
        "embedding": m.vocab * h,
    }
    tokens = float(sum(seq_lens))
    terms = {k: 2.0 * v * tokens for k, v in per_token.items()}
    square = float(sum(s * s for s in seq_lens))
    terms["attention"] = square * layers * (m.qk_head_dim + m.v_head_dim) * nh  # verl's 3 x ... / 3
    return {k: terms[k] for k in comm.FLOP_TERMS}


def megatron_terms(m, seq_lens, mtp_layers: int = 0) -> dict[str, float]:
    """Megatron-LM's ``num_floating_point_operations`` for MLA + MoE split into :data:`comm.FLOP_TERMS` (+ ``norms``
    for its q/kv LoRA-norm ``+ 1`` terms, + ``mtp``), one forward pass (Megatron's number / 3). No router, no
    embedding; causal attention ``seq_length / 2``; ``mtp_layers`` MTP modules (DeepSeek-V3 pretraining: 1; the
    GRPO trainer: 0) add one more MoE layer each, their ``eh_proj`` and norms, and one more output layer."""
    h, nh = m.hidden, m.num_heads
    moe, dense = m.num_moe_layers, m.num_layers - m.num_moe_layers
    q_in = m.q_lora_rank or h

    def layer(s_sq: float, tokens: float, moe_layers: int, dense_layers: int) -> dict[str, float]:
        n = moe_layers + dense_layers
        return {
            "mla_down": 2 * tokens * n * ((h * m.q_lora_rank if m.q_lora_rank else 0) + h * m.kv_lora_rank),
            "mla_up": 2 * tokens * n * (q_in * nh * m.qk_nope_dim + m.kv_lora_rank * nh * (m.qk_nope_dim + m.v_head_dim)),
            "mla_rope": 2 * tokens * n * (q_in * nh * m.qk_rope_dim + h * m.qk_rope_dim),
            "mla_out": 2 * tokens * n * nh * m.v_head_dim * h,
            "norms": 2 * tokens * n * ((m.q_lora_rank or 0) + m.kv_lora_rank),
            # s x heads x (qk + rope) / 2 + s x heads x v / 2 per token, x 2 (FMA): per sequence s^2 x that
            "attention": 2 * n * nh * (m.qk_head_dim + m.v_head_dim) * s_sq / 2,
            "dense_mlp": 2 * tokens * dense_layers * 3 * h * m.dense_ffn,
            "routed_experts": 2 * tokens * moe_layers * 3 * h * m.moe_ffn * m.topk,
            "shared_experts": 2 * tokens * moe_layers * 3 * h * m.shared_ffn,
        }

    tokens = float(sum(seq_lens))
    square = float(sum(s * s for s in seq_lens))
    terms = dict.fromkeys(comm.FLOP_TERMS, 0.0)
    terms.update(layer(square, tokens, moe, dense))
    terms["lm_head"] = 2 * tokens * h * m.vocab
    last_is_moe = m.is_moe_layer(m.num_layers - 1)
    extra = layer(square, tokens, mtp_layers * last_is_moe, mtp_layers * (1 - last_is_moe))
    terms["mtp"] = (sum(extra.values()) + 2 * tokens * mtp_layers * (3 * h + 2 * h * h)
                    + 2 * tokens * h * m.vocab * mtp_layers)
    return terms


def compare(m, seq_lens) -> list[dict]:
    """One row per term: ours, verl's, Megatron-LM's forward FLOPs and verl - ours; the last row the totals."""
    ours, verl, mega = comm.flop_terms(m, seq_lens), verl_terms(m, seq_lens), megatron_terms(m, seq_lens)
    rows = []
    for k in list(comm.FLOP_TERMS) + ["norms", "mtp"]:
        o, v, g = ours.get(k, 0.0), verl.get(k, 0.0), mega.get(k, 0.0)
        rows.append(dict(term=k, ours=o, verl=v, megatron=g, verl_minus_ours=v - o))
    tot = {c: sum(r[c] for r in rows) for c in ("ours", "verl", "megatron", "verl_minus_ours")}
    rows.append(dict(term="total", **tot))
    return rows


def _seq_lens(a) -> tuple[list[int], str]:
    if a.bench_json:
        from dsv3_rl.fs import read_json

        b = read_json(a.bench_json, what="bench_grpo_update.py result (--bench-json)").get("batch", {})
        if "prompt_lens" not in b or "resp_lens" not in b:
            raise ValueError(f"--bench-json {a.bench_json}: no batch.prompt_lens / batch.resp_lens (a bench_grpo_update.py "
                             "--json result has them)")
        return [p + r for p, r in zip(b["prompt_lens"], b["resp_lens"])], f"the batch of {a.bench_json}"
    if a.seq_lens:
        lens = [int(x) for x in a.seq_lens.split(",") if x.strip()]
        if not lens or min(lens) < 1:
            raise ValueError(f"--seq-lens {a.seq_lens!r}: give positive integers, e.g. 4096,4096")
        return lens, f"{len(lens)} sequences"
    raise ValueError("give --bench-json FILE (a bench_grpo_update.py result) or --seq-lens 4096,2048,...")


def cmd_flops(a) -> int:
    from dsv3_rl.fs import write_json_atomic
    from dsv3_rl.planner.model import load_model

    m = load_model(a.model)
    lens, what = _seq_lens(a)
    rows = compare(m, lens)
    tot = rows[-1]
    print(f"forward FLOPs of {a.model} over {what} ({sum(lens):,} tokens), per term (training = 3x):")
    print("| term | ours | verl FlopsCounter | Megatron-LM | verl - ours | share of verl - ours |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        share = r["verl_minus_ours"] / tot["verl_minus_ours"] if tot["verl_minus_ours"] else 0.0
        print(f"| {r['term']} | {r['ours']:.4g} | {r['verl']:.4g} | {r['megatron']:.4g} | {r['verl_minus_ours']:+.4g} "
              f"| {share:.1%} |")
    print(f"verl / ours = {tot['verl'] / tot['ours']:.4f}, Megatron-LM / ours = {tot['megatron'] / tot['ours']:.4f}")
    if a.json:
        write_json_atomic(a.json, dict(model=str(a.model), tokens=sum(lens), sequences=len(lens), rows=rows))
    return 0


def add_parser(sub) -> None:
    """``dsv3-plan flops``: our FLOP count next to verl's and Megatron-LM's, term by term."""
    from pathlib import Path

    p = sub.add_parser("flops", help="the planner's FLOP count (MFU) next to verl's FlopsCounter and Megatron-LM's "
                                     "num_floating_point_operations, term by term")
    p.add_argument("--model", default="proxy_4xH100", help="preset name or HF config.json path")
    p.add_argument("--bench-json", type=Path, help="sequence lengths from a bench_grpo_update.py --json result")
    p.add_argument("--seq-lens", help="comma-separated sequence lengths (prompt + response)")
    p.add_argument("--json", type=Path, help="write the rows as JSON (atomic)")
    p.set_defaults(func=cmd_flops)
