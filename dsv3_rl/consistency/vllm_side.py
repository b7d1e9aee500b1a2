"""The rollout side of a consistency run: vLLM (CPU build, offline ``LLM``) generates from the prompts
and records, for every token it fed through the model, the routed experts of every MoE layer.

    python -m dsv3_rl.consistency.vllm_side --model DIR --prompts FILE.json --out FILE.pt \
        [--dtype bf16|fp32] [--max-tokens 16] [--seed 0] [--fault zero_expert_bias|no_group_limit]

Runs in its own process (vLLM and megatron-core both own ``torch.distributed`` in the process that
uses them), with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and eager
execution. vLLM's routed-experts output needs its Model Runner V2 (Triton), which the CPU build
lacks; the routes are recorded per request by :mod:`dsv3_rl.consistency.vllm_routes` (the same
recorder verl's vLLM worker uses on CPU, patch 0021). The last sampled token is never fed, so a
sequence of P prompt and R response tokens has P + R - 1 routed rows, the rows that produce every
response log-prob (what verl's R3 replays; ``align_r3_router_replay_data`` pads the last).

Faults (for ``dsv3-consistency check-faults``) change what vLLM serves, not what it reports:
``zero_expert_bias`` serves every ``e_score_correction_bias`` as zeros; ``no_group_limit`` routes
without the group limit (``topk_group = n_group``).

Output (``torch.save``): ``{"sequences": [{"prompt_ids", "response_ids", "logprobs",
"routes": int16 [P+R-1, num_hidden_layers, top_k]}], "moe_layers": [...], "dtype", "fault"}``;
rows of dense layers are -1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from dsv3_rl.consistency import vllm_routes
from dsv3_rl.fs import atomic_path

FAULTS = vllm_routes.FAULTS
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _env() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of one user turn through the model's chat template (as verl's agent loop feeds it)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return [int(i) for i in ids]


def generate(model_dir: Path, prompts: list[str], dtype: str, max_tokens: int, seed: int,
             fault: str | None = None, kv_cache_bytes: int = 256 << 20, max_model_len: int | None = None) -> dict:
    """MAX_MODEL_LEN: vLLM's context (default min(512, max_position_embeddings)); the caller sizes it so that
    every prompt gets all MAX_TOKENS (``dsv3_rl.consistency.cli.check_model``); fewer is an error, not a result."""
    _env()
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    hf = AutoConfig.from_pretrained(model_dir)
    max_model_len = max_model_len or min(512, hf.max_position_embeddings)
    llm = LLM(model=str(model_dir), dtype=DTYPES[dtype], enforce_eager=True, seed=seed,
              enable_prefix_caching=False, max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes)
    if fault is not None:
        llm.collective_rpc(vllm_routes.apply_fault, args=(fault,))
    moe_layers = llm.collective_rpc(vllm_routes.install)[0]
    tok = llm.get_tokenizer()
    ids = [prompt_ids(tok, p) for p in prompts]
    # ignore_eos: every prompt yields max_tokens scored tokens (the demo's answers are 2-3 tokens long)
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=seed + i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    sequences = []
    for i, (prompt, res) in enumerate(zip(ids, outs, strict=True)):
        out = res.outputs[0]
        response = list(out.token_ids)
        if len(response) != max_tokens:  # ignore_eos: only the context length can cut it short
            raise RuntimeError(f"prompt {i}: vLLM generated {len(response)} tokens, asked for {max_tokens} "
                               f"(prompt {len(prompt)} tokens, max_model_len {max_model_len})")
        logprobs = [lp[t].logprob for lp, t in zip(out.logprobs, response, strict=True)]
        routes = llm.collective_rpc(vllm_routes.pop, args=(res.request_id,))[0]
        fed = len(prompt) + len(response) - 1
        if routes is None or routes.shape[0] != fed:
            raise RuntimeError(f"prompt {i}: vLLM recorded {None if routes is None else routes.shape[0]} route rows "
                               f"for {fed} fed tokens")
        sequences.append({"prompt_ids": prompt, "response_ids": response,
                          "logprobs": torch.tensor(logprobs, dtype=torch.float64), "routes": torch.from_numpy(routes)})
    return {"sequences": sequences, "moe_layers": moe_layers, "dtype": dtype, "fault": fault}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv3_rl.consistency.vllm_side", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True, help="JSON list of prompt strings")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", choices=FAULTS)
    ap.add_argument("--max-model-len", type=int, help="vLLM's context length (default min(512, max positions))")
    args = ap.parse_args(argv)
    prompts = json.loads(args.prompts.read_text())
    result = generate(args.model, prompts, args.dtype, args.max_tokens, args.seed, args.fault,
                      max_model_len=args.max_model_len)
    with atomic_path(args.out) as tmp:
        torch.save(result, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
