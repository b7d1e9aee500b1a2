"""Planner inputs and outputs as dataclasses (the API the launcher's ``--dry-run`` uses).

Inputs: :class:`Cluster`, :class:`GRPOShape`, :class:`Options`, and a candidate
:class:`dsv3_rl.layout.Layout` (trainer) + :class:`RolloutLayout` (vLLM). Outputs: :class:`Evaluation` per
candidate and :class:`PlanResult` (see :mod:`dsv3_rl.planner.search`).

Unknown keys are errors: :func:`from_dict` raises naming the key and the allowed ones.
"""

from __future__ import annotations

import dataclasses

from dsv3_rl.layout import Layout, from_dict  # noqa: F401 - the planner's layout is the package's one
from dsv3_rl.recipes.train_precision import RECIPES

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GPUType:
    """A GPU model: memory as ``torch.cuda.get_device_properties().total_memory`` reports it,
    dense BF16 peak, and per-GPU unidirectional bandwidth of the scale-up (NVLink) and scale-out
    (InfiniBand/RoCE NIC) fabrics."""

    name: str
    memory_gib: float
    bf16_tflops: float
    nvlink_gbs: float
    network_gbs: float
    hbm_tbs: float = 3.35
    pcie_gbs: float = 25.0


#: Catalog; ``Cluster(gpu_memory_gib=...)`` overrides the memory of any entry. Bandwidths are
#: per GPU, one direction, nominal (used only for the ranking estimate).
GPUS: dict[str, GPUType] = {
    "H100": GPUType("H100-SXM5-80GB", 79.1, 989.0, 450.0, 50.0, 3.35),
    "H200": GPUType("H200-SXM-141GB", 139.8, 989.0, 450.0, 50.0, 4.8),
    "H20": GPUType("H20-96GB", 95.0, 148.0, 450.0, 50.0, 4.0),
    "H800": GPUType("H800-SXM5-80GB", 79.1, 989.0, 200.0, 50.0, 3.35),
    "A100": GPUType("A100-SXM4-80GB", 79.2, 312.0, 300.0, 25.0, 2.0),
    "B200": GPUType("B200-180GB", 178.0, 2250.0, 900.0, 50.0, 8.0),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: str = "H100"
    """key of :data:`GPUS`"""
    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory_gib: float | None = None
    """override the catalog's usable memory per GPU"""

    def __post_init__(self):
        if self.gpu not in GPUS:
            raise ValueError(f"cluster.gpu={self.gpu!r}; known GPU types: {sorted(GPUS)}")
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"cluster needs gpus_per_node >= 1 and nodes >= 1 (got {self.gpus_per_node}, {self.nodes})")
        m = self.gpu_memory_gib
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < float("inf")):
            raise ValueError(f"cluster.gpu_memory_gib (--gpu-memory-gib) must be a number of GiB > 0 (got {m!r})")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def gpu_type(self) -> GPUType:
        return GPUS[self.gpu]

    @property
    def memory_bytes(self) -> float:
        return (self.gpu_memory_gib if self.gpu_memory_gib is not None else GPUS[self.gpu].memory_gib) * GIB


@dataclasses.dataclass(frozen=True)
class GRPOShape:
    """verl keys in brackets."""

    prompts_per_step: int = 256
    """[data.train_batch_size]"""
    n_samples: int = 8
    """[actor_rollout_ref.rollout.n]"""
    max_prompt_len: int = 2048
    """[data.max_prompt_length]"""
    max_response_len: int = 8192
    """[data.max_response_length]"""
    ppo_mini_batch_size: int | None = None
    """prompts per optimizer step [actor.ppo_mini_batch_size]; default = prompts_per_step"""
    micro_batch_size: int = 1
    """sequences per micro-batch per GPU when dynamic_batch is off [actor.ppo_micro_batch_size_per_gpu]"""
    dynamic_batch: bool = True
    """[actor.use_dynamic_bsz]: micro-batches packed up to max_token_len_per_gpu tokens"""
    max_token_len_per_gpu: int | None = None
    """[actor.ppo_max_token_len_per_gpu]; default = max_prompt_len + max_response_len"""
    ppo_epochs: int = 1
    mean_length_fraction: float = 0.6
    """mean (prompt+response) length / max length, for throughput and volume estimates only
    (memory always assumes the maximum)"""

    def __post_init__(self):
        for k in ("prompts_per_step", "n_samples", "max_prompt_len", "max_response_len", "micro_batch_size", "ppo_epochs"):
            if getattr(self, k) < 1:
                raise ValueError(f"grpo.{k} must be >= 1 (got {getattr(self, k)})")
        if self.max_token_len_per_gpu is not None and self.max_token_len_per_gpu < 1:
            raise ValueError(f"grpo.max_token_len_per_gpu must be >= 1 (got {self.max_token_len_per_gpu})")
        if self.ppo_mini_batch_size is not None and not 1 <= self.ppo_mini_batch_size <= self.prompts_per_step:
            raise ValueError(f"grpo.ppo_mini_batch_size must be in [1, prompts_per_step={self.prompts_per_step}] "
                             f"(got {self.ppo_mini_batch_size})")
        if not 0 < self.mean_length_fraction <= 1:
            raise ValueError(f"grpo.mean_length_fraction must be in (0, 1] (got {self.mean_length_fraction})")

    @property
    def seq_len(self) -> int:
        return self.max_prompt_len + self.max_response_len

    @property
    def mini_batch_prompts(self) -> int:
        return self.ppo_mini_batch_size or self.prompts_per_step

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens of one micro-batch on one GPU before CP splits it (the packed maximum)."""
        if self.dynamic_batch:
            return self.max_token_len_per_gpu or self.seq_len
        return self.micro_batch_size * self.seq_len


#: megatron-core 0.16.1 ``fp8_recipe`` values a Hopper GPU runs: the run presets' list (one list for both)
FP8_RECIPES = RECIPES

#: Options.attention values and the transformer_impl each applies to.
ATTENTION = {"auto": ("transformer_engine", "local"), "fused": ("transformer_engine",), "sdpa": ("local",),
             "unfused": ("local",)}

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""megatron-core 0.16.1 allowed recompute_modules (transformer/transformer_config.py:1198-1211)"""

#: What ``recompute="auto"`` tries per layout, least recompute first (time factor: rough extra
#: compute of the backward pass, used only for ranking).
RECOMPUTE_LADDER = (
    ("none", (), 1.0),
    ("selective", ("core_attn",), 1.02),
    ("selective", ("core_attn", "mla_up_proj", "layernorm", "moe_act", "mlp"), 1.10),
    ("selective", ("core_attn", "mla_up_proj", "layernorm", "moe", "mlp"), 1.20),
    ("full", (), 1.33),
)


@dataclasses.dataclass(frozen=True)
class Options:
    placement: str = "colocated"
    """colocated (verl hybrid engine: trainer and vLLM share every GPU, the trainer is offloaded
    while rolling out) | separate (disjoint rollout pool; verl's one-step-off / fully-async
    trainers, ``rollout.nnodes > 0``)"""
    rollout_gpus: int | None = None
    """separate placement: GPUs of the rollout pool (default: searched over whole nodes)"""
    param_offload: bool = True
    """[actor.megatron.param_offload]: params + grad buffers leave the GPU while inactive"""
    optimizer_offload: bool = True
    """[actor.megatron.optimizer_offload]: optimizer states leave the GPU while inactive"""
    optimizer_cpu_offload_fraction: float = 0.0
    """megatron HybridDeviceOptimizer (optim.override_optimizer_config.optimizer_offload_fraction):
    that fraction of fp32 main params + Adam states lives and steps on the CPU"""
    ref_model: bool = True
    """GRPO with a KL loss keeps a reference policy (forward only) on the trainer GPUs"""
    ref_param_offload: bool | None = None
    """[ref.megatron.param_offload]; default = param_offload"""
    recompute: str = "auto"
    """auto | none | selective | full"""
    recompute_modules: tuple[str, ...] | None = None
    """selective: megatron recompute_modules (default ("core_attn",))"""
    recompute_num_layers: int = 1
    recompute_method: str = "uniform"
    distributed_optimizer: bool = True
    dtype: str = "bf16"
    grad_reduce_in_fp32: bool = True
    """verl's default DDP config (verl/utils/megatron_utils.py:104)"""
    precision_aware_optimizer: bool = False
    exp_avg_dtype: str = "fp32"
    """precision-aware optimizer: fp32 | bf16 for Adam m and v"""
    main_grads_dtype: str = "fp32"
    """precision-aware optimizer: fp32 | bf16 grad buffer (verl then turns grad_reduce_in_fp32
    off: workers/engine/megatron/transformer_impl.py:455-460)"""
    rollout: bool = True
    """plan the vLLM rollout too (False: trainer only, e.g. to check a pre-training recipe)"""
    transformer_impl: str = "transformer_engine"
    """transformer_engine (production: TE spec, flash/fused attention, fused SwiGLU) | local
    (megatron's local spec without TE: torch norms, unfused SwiGLU; attention per ``attention``)"""
    attention: str = "auto"
    """core attention kernel: auto (what megatron-core 0.16.1 + our patches pick: TE's flash/fused
    attention on the TE spec; on the local spec torch SDPA, which patch 0012 selects when TE is not
    installed) | fused (TE flash/cuDNN fused attention; TE spec) | sdpa (torch SDPA with a fused
    flash/cuDNN/memory-efficient kernel, local spec with patch 0012: q, k, v, out + fp32 logsumexp
    saved, nothing S x S) | unfused (megatron's matmul + softmax DotProductAttention, local spec
    with attention_backend=unfused or with TE installed: fp32 softmax + bf16 probs S x S saved).
    Resolved value: ``Options.attention_impl``"""
    moe_grouped_gemm: bool = True
    loss: str = "verl"
    """verl (vocab-parallel log-prob, fp32) | fused (verl use_fused_kernels, chunked) | megatron_ce"""
    mtp: bool = False
    """keep the MTP layer in training (verl disables MTP for RL)"""
    rollout_tp: int | None = None
    """vLLM tensor_model_parallel_size (default: searched)"""
    rollout_dp: int | None = None
    """vLLM data_parallel_size (attention data parallel); default: searched"""
    rollout_ep: bool | None = None
    """vLLM expert parallel (verl requires expert_parallel_size == tp * dp); default: searched"""
    rollout_max_instance_gpus: int = 64
    """largest vLLM engine (TP * DP GPUs) searched"""
    rollout_gpu_memory_utilization: float | None = None
    """vLLM gpu_memory_utilization (default: the largest of 0.5..0.9 that fits)"""
    rollout_quantization: str = "none"
    """[rollout.quantization] none (BF16 rollout weights) | fp8 (verl's blockwise FP8: the tensors DeepSeek's FP8
    release keeps in FP8 cost 1 byte + fp32 128x128-block scales, the rest stays BF16;
    :func:`dsv3_rl.planner.memory.rollout_weight_bytes`). A preset sets it with ``rollout_quantization``"""
    rollout_enforce_eager: bool = False
    rollout_max_num_batched_tokens: int = 8192
    reserve_gib: float | None = None
    """per GPU memory not visible to torch's allocator statistics: CUDA context, NCCL
    communicators and buffers, allocator fragmentation. None (default): the measured rule
    :func:`dsv3_rl.planner.memory.non_torch_reserve` (9.64 GiB, 10.51 with PP; was a flat 5.0 before the
    4xH100 measurements of 2026-11-26)"""
    max_tp: int | None = None
    """largest trainer TP searched (default: GPUs per node, TP stays on NVLink)"""
    max_pp: int = 64
    tp_choices: tuple[int, ...] | None = None
    pp_choices: tuple[int, ...] | None = None
    ep_choices: tuple[int, ...] | None = None
    cp_choices: tuple[int, ...] = (1,)
    vpp_choices: tuple[int | None, ...] = (None, 2, 4)
    etp_choices: tuple[int, ...] = (1,)
    remove_padding: bool = True
    """[model.use_remove_padding] True: verl packs each micro-batch's sequences (THD, the TE spec); False: BSHD,
    every micro-batch padded to the longest sequence of the DP rank's mini-batch (verl's default
    ``pad_bshd_to_minibatch_max``), what the local spec runs: activations and compute scale with the padded tokens
    (:func:`dsv3_rl.planner.phases.micro_batches`)"""
    train_precision: str = "bf16"
    """bf16 | fp8: FP8 GEMMs in training through Transformer Engine (megatron-core ``fp8="e4m3"``, needs
    ``transformer_impl=transformer_engine``); master params, grads and optimizer states stay as in bf16. Memory:
    :func:`dsv3_rl.planner.memory.fp8_weight_cache_bytes_per_param` and the FP8-saved GEMM inputs of
    :func:`dsv3_rl.planner.memory._layer_parts` (docs/planner.md, "FP8 training")"""
    fp8_recipe: str = "blockwise"
    """megatron-core 0.16.1 ``fp8_recipe`` on Hopper: delayed | tensorwise (per-tensor scaling) | blockwise
    (DeepSeek-style: 128x128 weight blocks, 1x128 activation tiles; TE >= 2.3); mxfp8 is Blackwell-only"""
    fp8_param: bool = False
    """megatron-core ``fp8_param`` (primary weights kept in FP8 instead of BF16 + an FP8 cache)"""
    mfu: float = 0.35
    """assumed model-FLOPs utilisation for the (ranking-only) step time estimate"""
    optimizer_impl: str = "fused"
    """fused (TE FusedAdam / apex: no step-time temporaries) | torch (megatron's fallback
    torch.optim Adam(W), foreach on CUDA: one fp32 temporary per main param during step())"""
    top_k: int = 10
    """rows of the ranked table"""
    tight_fraction: float = 0.9
    """a layout whose predicted torch-allocated peak exceeds this fraction of (GPU memory -
    reserve) is flagged 'tight' and ranked after the others (the model is validated to 15%)"""

    @property
    def attention_impl(self) -> str:
        """The attention kernel the memory model uses: fused | sdpa | unfused (``auto`` resolved the
        way megatron-core 0.16.1 with patch 0012 resolves attention_backend=auto without TE)."""
        if self.attention != "auto":
            return self.attention
        return "fused" if self.transformer_impl == "transformer_engine" else "sdpa"

    def __post_init__(self):
        allowed = {
            "placement": ("colocated", "separate"),
            "recompute": ("auto", "none", "selective", "full"),
            "dtype": ("bf16", "fp16"),
            "exp_avg_dtype": ("fp32", "bf16"),
            "main_grads_dtype": ("fp32", "bf16"),
            "transformer_impl": ("transformer_engine", "local"),
            "loss": ("verl", "fused", "megatron_ce"),
            "recompute_method": ("uniform", "block"),
            "optimizer_impl": ("fused", "torch"),
            "rollout_quantization": tuple(_rollout_quantization_modes()),
            "train_precision": ("bf16", "fp8"),
            "fp8_recipe": FP8_RECIPES,
        }
        for k, vals in allowed.items():
            if getattr(self, k) not in vals:
                raise ValueError(f"options.{k}={getattr(self, k)!r}; allowed: {vals}")
        if self.attention not in ATTENTION:
            raise ValueError(f"options.attention={self.attention!r}; allowed: {tuple(ATTENTION)}")
        if self.attention != "auto" and self.transformer_impl not in ATTENTION[self.attention]:
            raise ValueError(f"options.attention={self.attention!r} needs transformer_impl in "
                             f"{ATTENTION[self.attention]} (got {self.transformer_impl!r}; TE's own unfused backend "
                             f"is not modelled)")
        if self.train_precision == "fp8" and self.transformer_impl != "transformer_engine":
            raise ValueError("options.train_precision='fp8' needs transformer_impl='transformer_engine' (FP8 GEMMs are "
                             f"Transformer Engine's; got {self.transformer_impl!r})")
        if self.fp8_param and self.train_precision != "fp8":
            raise ValueError("options.fp8_param=True needs train_precision='fp8' (megatron-core: 'fp8_param must be used "
                             "together with fp8 mode')")
        if self.recompute_modules is not None:
            bad = sorted(set(self.recompute_modules) - set(RECOMPUTE_MODULES))
            if bad:
                raise ValueError(f"options.recompute_modules has {bad}; megatron-core 0.16.1 allows {RECOMPUTE_MODULES}")
        if not 0 <= self.optimizer_cpu_offload_fraction <= 1:
            raise ValueError(f"options.optimizer_cpu_offload_fraction must be in [0, 1] (got {self.optimizer_cpu_offload_fraction})")
        u = self.rollout_gpu_memory_utilization
        if u is not None and not 0 < u < 1:
            raise ValueError(f"options.rollout_gpu_memory_utilization must be in (0, 1) (got {u})")


def _rollout_quantization_modes():
    from dsv3_rl.recipes.rollout_quantization import MODES  # the preset key's values: one list

    return MODES


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """One vLLM layout: ``instances`` engines of ``tp * dp`` GPUs each."""

    tp: int
    gpus: int
    dp: int = 1
    ep: int = 1
    gpu_memory_utilization: float = 0.6

    @property
    def instance_gpus(self) -> int:
        return self.tp * self.dp

    @property
    def instances(self) -> int:
        return self.gpus // self.instance_gpus

    def short(self) -> str:
        s = f"vLLM TP{self.tp}"
        if self.dp > 1:
            s += f" DP{self.dp}"
        if self.ep > 1:
            s += f" EP{self.ep}"
        return s + f" x{self.instances} util={self.gpu_memory_utilization:.2f}"
