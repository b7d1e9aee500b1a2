"""The trainer side of a consistency run: the megatron-core GPTModel, with verl's router replay.

For every sequence vLLM generated, three passes run on the same weights, each recording the
routes the model actually used (a forward hook on every ``TopKRouter``: the top-k expert *set* of
each token from the ``routing_map`` it hands the dispatcher) and the log-prob of each response token:

* ``native``: no replay (what the trainer computes on its own);
* ``logprob``: verl's ``compute_log_prob`` pass: ``REPLAY_FORWARD`` with the rollout's routes given
  to verl's ``set_router_replay_data`` (R3), forward only;
* ``update``: verl's actor-update pass: training mode, forward + backward, ``REPLAY_FORWARD`` again.

Replay goes through verl's own code: ``apply_router_replay_patch`` (as verl's MegatronEngine applies
it), ``moe_enable_routing_replay`` on the TransformerConfig, ``RouterReplay`` actions and
``align_r3_router_replay_data`` / ``set_router_replay_data`` on the rollout's jagged routes.

Faults (``dsv3-consistency check-faults``): ``shift_routes`` replays the rollout's routes one token
late; ``replay_logprob_only`` replays in the log-prob pass but not in the update.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

FAULTS = ("shift_routes", "replay_logprob_only")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class RouteHook:
    """Records, per MoE layer (0-based global index), the top-k expert ids each token was sent to."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.rows: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self.handles.append(module.register_forward_hook(self._hook(module.layer_number - 1)))
        if not self.handles:
            raise RuntimeError("the megatron model has no TopKRouter to record")

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            routing_map = output[1]
            k = int(routing_map[0].sum())
            ids = torch.sort(routing_map.float().topk(k, dim=-1).indices, dim=-1).values
            self.rows.setdefault(layer, []).append(ids.detach().to("cpu", torch.int16))
        return hook

    def pop_layers(self) -> dict[int, torch.Tensor]:
        """Everything recorded since the last call, ``{layer: [rows, top_k]}`` (rows of all forwards, in order)."""
        out = {lid: torch.cat(parts) for lid, parts in self.rows.items()}
        self.rows = {}
        return out

    def take(self, num_layers: int, top_k: int) -> torch.Tensor:
        """:meth:`pop_layers` as one ``[rows, num_layers, top_k]`` tensor, -1 for layers without a router."""
        by_layer = self.pop_layers()
        rows = next(iter(by_layer.values())).shape[0] if by_layer else 0
        out = torch.full((rows, num_layers, top_k), -1, dtype=torch.int16)
        for lid, ids in by_layer.items():
            out[:, lid, : ids.shape[1]] = ids
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-prob of each response token (positions prompt_len..) from the logits of the row before it."""
    lp = torch.log_softmax(logits[0, prompt_len - 1 : -1].float(), dim=-1)
    return lp.gather(-1, tokens[0, prompt_len:].unsqueeze(-1)).squeeze(-1)


def _replay(model, tf_config, routes: torch.Tensor, tokens: torch.Tensor) -> None:
    """Hand the rollout's routes to verl's router replay for this forward (as MegatronEngine does)."""
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, set_router_replay_data

    jagged_routes = torch.nested.as_nested_tensor([routes.long()], layout=torch.jagged)
    jagged_ids = torch.nested.as_nested_tensor([tokens[0]], layout=torch.jagged)
    aligned = align_r3_router_replay_data(jagged_routes, jagged_ids)
    dense = aligned.to_padded_tensor(0)
    set_router_replay_data(dense, torch.ones_like(tokens, dtype=torch.bool), tf_config, 0, model=model)


class Trainer:
    """The megatron model of ``model_dir`` (converted by our HF -> mcore converter), built once with
    verl's router replay; :meth:`passes` runs the three passes for a rollout record."""

    def __init__(self, model_dir: Path, dtype: str) -> None:
        self.model_dir, self.dtype = Path(model_dir), dtype

    def __enter__(self) -> Trainer:
        from transformers import AutoConfig

        from dsv3_rl.convert import weights
        from dsv3_rl.correctness.assemble import single_process_megatron
        from dsv3_rl.mcore import layout_check, runtime

        self.hf = AutoConfig.from_pretrained(self.model_dir)
        self._tmp = tempfile.TemporaryDirectory(prefix="dsv3-consistency-")
        ckpt = Path(self._tmp.name) / "mcore"
        weights.hf_to_mcore(self.model_dir, ckpt, dtype=self.dtype, progress=False)
        if not torch.cuda.is_available():
            os.environ.setdefault("VERL_PLATFORM", "cpu")  # verl's CPU platform (patch 0010)
        self._ctx = single_process_megatron()
        self._ctx.__enter__()
        from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction, apply_router_replay_patch

        self.RouterReplay, self.Action = RouterReplay, RouterReplayAction
        apply_router_replay_patch()  # as verl's MegatronEngine does when router_replay.mode is R2 or R3
        chunks = runtime.build_model(self.hf, dtype=DTYPES[self.dtype], config_overrides={"moe_enable_routing_replay": True})
        layout_check.load(chunks, ckpt)
        self.model = chunks[0]
        self.hook = RouteHook(chunks)
        return self

    def __exit__(self, *exc) -> None:
        self.hook.remove()
        self.RouterReplay.clear_global_indices()
        self.RouterReplay.clear_global_router_replay_action()
        self._ctx.__exit__(*exc)
        self._tmp.cleanup()

    def passes(self, rollout: dict, fault: str | None = None) -> dict:
        """Route and log-prob records of the three passes for every sequence of ``rollout``."""
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown trainer fault {fault!r}; allowed: {', '.join(FAULTS)}")
        try:
            seqs = [_one(self.model, self.model.config, self.hook, self.hf, seq, fault, self.RouterReplay, self.Action)
                    for seq in rollout["sequences"]]
        finally:
            self.hook.rows = {}
            self.RouterReplay.clear_global_indices()
            self.RouterReplay.clear_global_router_replay_action()
            self.model.eval()
        return {"sequences": seqs, "dtype": self.dtype, "fault": fault}


def _one(model, tf_config, hook, hf, seq, fault, RouterReplay, RouterReplayAction) -> dict:
    ids = seq["prompt_ids"] + seq["response_ids"]
    from dsv3_rl.mcore import runtime

    tokens = torch.tensor([ids], device=runtime.device())
    pos = torch.arange(len(ids), device=tokens.device).unsqueeze(0)
    P = len(seq["prompt_ids"])
    L, K = hf.num_hidden_layers, hf.num_experts_per_tok
    routes = seq["routes"]
    if fault == "shift_routes":
        routes = torch.cat([routes[:1], routes[:-1]])
    rec = {}

    model.eval()
    RouterReplay.clear_global_router_replay_action()
    with torch.no_grad():
        logits = model(tokens, pos, attention_mask=None)
    rec["native"] = {"routes": hook.take(L, K)[:-1], "logprobs": _logprobs(logits, tokens, P).double().cpu()}

    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _replay(model, tf_config, routes, tokens)
    with torch.no_grad():
        logits = model(tokens, pos, attention_mask=None)
    rec["logprob"] = {"routes": hook.take(L, K)[:-1], "logprobs": _logprobs(logits, tokens, P).double().cpu()}
    RouterReplay.clear_global_indices()

    model.train()
    if fault == "replay_logprob_only":
        RouterReplay.clear_global_router_replay_action()
    else:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        _replay(model, tf_config, routes, tokens)
    logits = model(tokens, pos, attention_mask=None)
    lp = _logprobs(logits, tokens, P)
    (-lp.sum()).backward()
    model.zero_grad(set_to_none=True)
    rec["update"] = {"routes": hook.take(L, K)[:-1], "logprobs": lp.detach().double().cpu()}
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    model.eval()
    return rec

