"""Forward hooks that record the same intermediate activations on both sides.

Canonical records (what :mod:`compare` sees) are keyed ``L<i>/<component>`` with HF's 0-based
layer index ``i``, plus ``logits``; every tensor is ``[batch, seq, ...]`` over the whole test batch:

==============  ===================================================  ==============================
component       HF module (transformers DeepseekV3)                  megatron-core module
==============  ===================================================  ==============================
attn            ``layers[i].self_attn`` output (o_proj, pre-residual) ``layers[j].self_attention`` out
router_scores   sigmoid(``mlp.gate`` logits) [.., E]                 sigmoid(``mlp.router.gating``)
topk            selected experts, bool [.., E]                       ``mlp.router`` routing_map
router_probs    top-k weights (normalised, x routed_scaling_factor)  ``mlp.router`` probs
routed          ``mlp.experts`` output                               ``token_dispatcher.combine_postprocess``
shared          ``mlp.shared_experts`` output                        ``mlp.shared_experts`` output
mlp             dense ``mlp`` output (first_k_dense_replace layers)  dense ``mlp`` output
layer           decoder layer output (after both residuals)          TransformerLayer output
logits          ``lm_head`` output [.., V]                           ``output_layer`` output
==============  ===================================================  ==============================

Megatron-side records are per rank, per call (one call per micro-batch), in megatron's
``[seq, batch, ...]`` layout and possibly sharded (sequence-parallel: the sequence dim over TP
ranks; the output layer: the vocab dim over TP ranks); :mod:`assemble` puts them back together.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

SECTIONS = {
    "attn": "MLA",
    "router_scores": "MOE",
    "topk": "MOE",
    "router_probs": "MOE",
    "routed": "MOE",
    "shared": "MOE",
    "mlp": "MLP",
    "layer": "Layer",
    "logits": "Final",
}
ROUTER_KEYS = ("router_scores", "topk", "router_probs")


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class HFCapture:
    """Hooks on a transformers ``DeepseekV3ForCausalLM``; one forward over the whole batch."""

    def __init__(self, model: torch.nn.Module):
        self.records: dict[str, torch.Tensor] = {}
        self.handles = []
        self.batch_shape: tuple[int, int] | None = None
        cfg = model.config
        self.num_experts = getattr(cfg, "n_routed_experts", None)
        for i, layer in enumerate(model.model.layers):
            self._hook(layer.self_attn, f"L{i}/attn")
            self._hook(layer, f"L{i}/layer")
            mlp = layer.mlp
            if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
                self.handles.append(mlp.gate.register_forward_hook(self._gate_hook(i)))
                self.handles.append(mlp.experts.register_forward_hook(self._experts_hook(i), with_kwargs=True))
                self._hook(mlp.shared_experts, f"L{i}/shared")
            else:
                self._hook(mlp, f"L{i}/mlp")
        self._hook(model.lm_head, "logits")
        self.handles.append(model.model.register_forward_pre_hook(self._shape_hook, with_kwargs=True))

    def _shape_hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.batch_shape = tuple(ids.shape)

    def _put(self, key: str, t: torch.Tensor) -> None:
        if key in self.records:
            raise RuntimeError(f"HF hook {key} fired twice: run one forward per capture")
        self.records[key] = _keep(t)

    def _hook(self, module: torch.nn.Module, key: str) -> None:
        self.handles.append(module.register_forward_hook(lambda m, a, o: self._put(key, _first(o))))

    def _tokens(self, t: torch.Tensor) -> torch.Tensor:
        b, s = self.batch_shape
        return t.reshape(b, s, *t.shape[1:])

    def _gate_hook(self, i: int):
        def hook(module, args, output):
            self._put(f"L{i}/router_scores", self._tokens(torch.sigmoid(_first(output).float())))
        return hook

    def _experts_hook(self, i: int):
        def hook(module, args, kwargs, output):
            names = ("hidden_states", "top_k_index", "top_k_weights")
            vals = dict(zip(names, args, strict=False))
            vals.update({k: v for k, v in kwargs.items() if k in names})
            idx, w = vals["top_k_index"], vals["top_k_weights"]
            n = self.num_experts
            sel = torch.zeros(idx.shape[0], n, dtype=torch.bool, device=idx.device).scatter_(1, idx, True)
            probs = torch.zeros(idx.shape[0], n, dtype=torch.float32, device=idx.device).scatter_(1, idx, w.float())
            self._put(f"L{i}/topk", self._tokens(sel))
            self._put(f"L{i}/router_probs", self._tokens(probs))
            self._put(f"L{i}/routed", self._tokens(_first(output)))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class MCoreCapture:
    """Hooks on this rank's megatron GPTModel chunk(s). Records per call, in call order."""

    def __init__(self, chunks: list[torch.nn.Module]):
        from dsv3_rl.mcore.runtime import unwrap

        self.records: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
        self.handles = []
        self._restore = []
        for chunk in chunks:
            model = unwrap(chunk)
            for layer in model.decoder.layers:
                i = layer.layer_number - 1  # megatron numbers layers globally from 1
                self._hook(layer.self_attention, f"L{i}/attn")
                self._hook(layer, f"L{i}/layer")
                mlp = layer.mlp
                if hasattr(mlp, "router"):
                    self._wrap(mlp.router, "gating", lambda out, i=i: self._put(f"L{i}/router_scores", torch.sigmoid(out.float())))
                    self.handles.append(mlp.router.register_forward_hook(self._router_hook(i)))
                    self._wrap(mlp.token_dispatcher, "combine_postprocess", lambda out, i=i: self._put(f"L{i}/routed", _first(out)))
                    if getattr(mlp, "shared_experts", None) is not None:
                        self._hook(mlp.shared_experts, f"L{i}/shared")
                else:
                    self._hook(mlp, f"L{i}/mlp")
            if getattr(model, "post_process", False) and getattr(model, "output_layer", None) is not None:
                self._hook(model.output_layer, "logits")

    def _put(self, key: str, t: torch.Tensor) -> None:
        self.records[key].append(_keep(t))

    def _hook(self, module: torch.nn.Module, key: str) -> None:
        self.handles.append(module.register_forward_hook(lambda m, a, o: self._put(key, _first(o))))

    def _wrap(self, obj: Any, name: str, record) -> None:
        orig = getattr(obj, name)

        def wrapper(*args, **kwargs):
            out = orig(*args, **kwargs)
            record(out)
            return out

        setattr(obj, name, wrapper)
        self._restore.append((obj, name))

    def _router_hook(self, i: int):
        def hook(module, args, output):
            probs, routing_map = output
            self._put(f"L{i}/router_probs", probs.float())
            self._put(f"L{i}/topk", routing_map.bool())
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for obj, name in self._restore:
            if name in vars(obj):
                delattr(obj, name)
        self._restore.clear()
