"""Per-request routed experts from vLLM's CPU build (what ``enable_return_routed_experts`` gives on GPU).

vLLM 0.31 returns routed experts only through its AuxOutput connector, which only Model Runner V2
wires up, and V2 needs Triton: the CPU build refuses (``AuxOutput Connector requires Model Runner
V2``). The routes themselves are available on every backend: each MoE router (``BaseRouter``) calls
its ``capture_fn`` with the logical top-k expert ids of the tokens it routes, before any EPLB
mapping (the hook vLLM's own capturer binds). :func:`install` binds such a hook on every router of
a worker's model and wraps the model runner's ``execute_model``: after each step the captured rows
are split by request (rows follow ``input_batch.req_ids``, each request's scheduled tokens in
order) and stored at the tokens' positions (``model_runner.positions``), so prefill chunks,
decoding and a recomputation after preemption all land on the right rows. :func:`pop` hands a
finished request's routes over as ``[num_tokens - 1, num_hidden_layers, top_k]`` (int16; -1 for
dense layers), the shape verl's R3 expects from vLLM.

Used in-process by ``dsv3-consistency`` and, through verl patch 0021, by verl's vLLM worker extension
(``collective_rpc("dsv3_install_route_capture")`` / ``("dsv3_pop_routes", request_id)``).
"""

from __future__ import annotations

import numpy as np
import torch

_ATTR = "_dsv3_route_store"
#: what :func:`apply_fault` can change in what vLLM serves
FAULTS = ("zero_expert_bias", "no_group_limit")


class RouteStore:
    """Routes per internal request id, written by position."""

    def __init__(self, num_layers: int, top_k: int) -> None:
        self.num_layers, self.top_k = num_layers, top_k
        self.step: dict[int, list[torch.Tensor]] = {}
        self.routes: dict[str, np.ndarray] = {}
        self.length: dict[str, int] = {}

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self.step.setdefault(layer_id, []).append(topk_ids.detach().to("cpu", torch.int16))

    def commit(self, req_ids: list[str], num_scheduled: dict[str, int], positions: torch.Tensor) -> None:
        """File the rows captured in this step under their requests and positions."""
        step, self.step = self.step, {}
        total = sum(int(num_scheduled.get(r, 0)) for r in req_ids)
        if not step or not total:
            return
        rows = np.full((total, self.num_layers, self.top_k), -1, dtype=np.int16)
        for layer, parts in step.items():
            ids = torch.cat(parts)
            if ids.shape[0] < total:
                raise RuntimeError(f"vLLM layer {layer} routed {ids.shape[0]} rows for {total} scheduled tokens")
            rows[:, layer] = ids[:total].numpy()
        pos = positions[:total].to("cpu").numpy().astype(np.int64)
        off = 0
        for req in req_ids:
            n = int(num_scheduled.get(req, 0))
            if not n:
                continue
            p = pos[off : off + n]
            buf = self.routes.get(req)
            need = int(p.max()) + 1
            if buf is None or buf.shape[0] < need:
                grown = np.full((max(need, 2 * (0 if buf is None else buf.shape[0])), self.num_layers, self.top_k), -1,
                                dtype=np.int16)
                if buf is not None:
                    grown[: buf.shape[0]] = buf
                buf = self.routes[req] = grown
            buf[p] = rows[off : off + n]
            self.length[req] = max(self.length.get(req, 0), need)
            off += n

    def pop(self, request_id: str) -> np.ndarray | None:
        """Routes of the request whose id is ``request_id`` or vLLM's ``request_id-<suffix>`` of it."""
        keys = [k for k in self.routes if k == request_id or k.startswith(f"{request_id}-")]
        if not keys:
            return None
        key = max(keys, key=lambda k: self.length[k])
        out = self.routes[key][: self.length[key]].copy()
        for k in keys:
            self.routes.pop(k, None)
            self.length.pop(k, None)
        return out

    def pop_all(self) -> dict[str, np.ndarray]:
        return {k: self.pop(k) for k in list(self.routes)}


def _routers(model: torch.nn.Module) -> list:
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    return [(int(m.layer_id), m.router) for m in model.modules()
            if isinstance(m, MoERunner) and isinstance(getattr(m, "router", None), BaseRouter)]


def install(worker) -> list[int]:
    """Bind route capture on ``worker``'s model and model runner (idempotent); returns the MoE layer ids."""
    runner = worker.model_runner
    store = getattr(runner, _ATTR, None)
    model = runner.get_model()
    routers = _routers(model)
    if not routers:
        raise RuntimeError("vLLM's model has no MoE router with a capture hook (BaseRouter.set_capture_fn)")
    if store is None:
        hf = runner.model_config.hf_text_config
        store = RouteStore(hf.num_hidden_layers, hf.num_experts_per_tok)
        setattr(runner, _ATTR, store)
        inner = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            store.step = {}  # rows of dummy/profile runs belong to no request
            out = inner(scheduler_output, *args, **kwargs)
            store.commit(list(runner.input_batch.req_ids), scheduler_output.num_scheduled_tokens, runner.positions)
            return out

        runner.execute_model = execute_model
    for layer_id, router in routers:
        router.set_capture_fn(lambda ids, lid=layer_id: store.capture(lid, ids))
    return sorted(lid for lid, _ in routers)


def pop(worker, request_id: str | None = None):
    """A finished request's routes (``None`` if none were recorded), or all of them when no id is given."""
    store = getattr(worker.model_runner, _ATTR, None)
    if store is None:
        raise RuntimeError("route capture is not installed on this vLLM worker (call install first)")
    return store.pop_all() if request_id is None else store.pop(request_id)


def apply_fault(worker, fault: str) -> int:
    """Change what vLLM serves, for ``dsv3-consistency check-faults``: one of :data:`FAULTS`."""
    if fault not in FAULTS:
        raise ValueError(f"unknown vLLM fault {fault!r}; allowed: {', '.join(FAULTS)}")
    n = 0
    for _layer_id, router in _routers(worker.model_runner.get_model()):
        if fault == "zero_expert_bias" and getattr(router, "e_score_correction_bias", None) is not None:
            router.e_score_correction_bias.data.zero_()
            n += 1
        elif fault == "no_group_limit" and getattr(router, "num_expert_group", None):
            router.topk_group = router.num_expert_group
            n += 1
    if not n:
        raise RuntimeError(f"fault {fault}: vLLM's routers have nothing to change (attribute names moved?)")
    return n
