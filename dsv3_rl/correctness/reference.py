"""The reference: transformers' ``DeepseekV3ForCausalLM`` on the HF checkpoint.

One forward over the whole test batch with :class:`hooks.HFCapture` attached, the training loss of
:mod:`data` (megatron's normalisation) from its logits, one backward, and every parameter's
gradient under its *hub* name (the names in the checkpoint's safetensors: transformers 5 fuses
each MoE layer's experts into ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] in
memory; their gradients are split back into ``mlp.experts.<e>.{gate,up,down}_proj.weight``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsv3_rl.correctness import data
from dsv3_rl.correctness.hooks import HFCapture


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, config_overrides: dict | None = None,
            device: str | torch.device = "cpu"):
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    config = AutoConfig.from_pretrained(path)
    for k, v in (config_overrides or {}).items():
        setattr(config, k, v)
    model = DeepseekV3ForCausalLM.from_pretrained(path, config=config, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def hub_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> fp32 gradient (CPU), with fused expert tensors split into hub per-expert names."""
    cfg = model.config
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.detach().float().cpu()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            if g.shape[1:] == (2 * inter, hidden):
                gate, up = g[:, :inter], g[:, inter:]
            elif g.shape[1:] == (hidden, 2 * inter):  # transposed storage in some transformers versions
                gate, up = g[:, :, :inter].transpose(1, 2), g[:, :, inter:].transpose(1, 2)
            else:
                raise ValueError(f"{name}: unexpected fused expert shape {tuple(g.shape)}")
            for e in range(g.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            if g.shape[1:] == (hidden, inter):
                down = g
            elif g.shape[1:] == (inter, hidden):
                down = g.transpose(1, 2)
            else:
                raise ValueError(f"{name}: unexpected fused expert shape {tuple(g.shape)}")
            for e in range(g.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()
        else:
            out[name] = g
    return out


def run_reference(model: torch.nn.Module, batch: dict[str, torch.Tensor], micro_batch_size: int,
                  grads: bool = True) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor]]:
    """(canonical records, info with loss/micro_losses, hub-name grads)."""
    dev = next(model.parameters()).device
    capture = HFCapture(model)
    model.zero_grad(set_to_none=True)
    try:
        with torch.set_grad_enabled(grads):
            out = model(input_ids=batch["tokens"].to(dev), position_ids=batch["position_ids"].to(dev), use_cache=False)
            ce = data.per_token_ce(out.logits, batch["labels"].to(dev))
            micro = data.micro_losses(ce, batch["loss_mask"].to(dev), micro_batch_size)
            loss = micro.mean()
            if grads:
                loss.backward()
    finally:
        capture.remove()
    micro = micro.detach().double().cpu()
    info = dict(micro_losses=micro, loss=float(micro.mean()))
    return capture.records, info, (hub_grads(model) if grads else {})
