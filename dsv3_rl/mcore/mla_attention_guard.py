"""Which Transformer Engine attention backend may run Multi-Latent Attention (MLA).

megatron-core calls this module through the hooks of patch 0011
(``patches/megatron-core/0.16.1/0011-mla-fused-attention-guard.patch``): ``LanguageModule`` calls
:func:`check_config` when it sets the attention backend, ``TEDotProductAttention`` calls
:func:`check_te_attention`. The logic lives here, in the package, where linters and tests see it.

MLA (DeepSeek-V2/V3) has q/k heads of ``qk_head_dim + qk_pos_emb_head_dim`` (192) and v heads of
``v_head_dim`` (128). cuDNN's fused attention (TE's ``FusedAttention``) supports that shape only
from certain cuDNN versions on certain GPUs, and several versions in between either fail in the
backward pass or have known numerical bugs. TE's own backend selection got these rules gradually
(e.g. it could not tell training from inference before TE 2.5), so an older TE happily picks
fused attention where cuDNN cannot run it.

:func:`decide_mla_attention_backend` is a pure function of the versions, the GPU, the head dims,
the dtype, training vs inference, the requested backend and the NVTE_* environment. It returns the
backend TE will end up using and the NVTE_* variables to set, or raises
:class:`MLAAttentionBackendError` naming the versions and the fix. It never lets fused attention
run on a combination known to fail or to produce wrong numbers.

Rules for fp16/bf16 fused attention with head dims > 128 or d_qk != d_v (from TE's
``nvte_get_fused_attn_backend``, cudnn-frontend's support checks and the cuDNN release notes):

* sm90 (Hopper): forward from cuDNN 9.1, backward from cuDNN 9.5; forward also needs 9.3+ here
  (fp16/bf16 forward could return wrong softmax stats for large q/k before 9.3).
* sm100+ (Blackwell): forward from 9.9 (any head dim); backward only d_qk=192/d_v=128, from 9.11.
* sm80/86/89/120 (Ampere/Ada/consumer Blackwell): backward only for head dims <= 128; forward with
  larger dims from 9.10.2.
* cuDNN 9.10.0 and 9.10.1: known fp16/bf16 SDPA bugs; never.
* cuDNN 9.11-9.12 on Hopper, backward, 128 < d and d_qk != d_v other than 192/128: a support-check
  bug let wrong configurations through (fixed in 9.13).
* TE < 1.10 cannot take different q/k and v head dims (nor the MLA softmax scale): refused.

Environment: ``MCORE_MLA_ATTENTION_GUARD=0`` turns the guard off (you have verified your own
combination).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings
from collections.abc import Mapping, Sequence

from dsv3_rl.errors import Dsv3Error

VersionLike = str | int | Sequence[int] | None

GUARD_ENV = "MCORE_MLA_ATTENTION_GUARD"
# The cuDNN the Pai-Megatron-Patch / verl quick starts pin "to fix MLA training"; any >= 9.5 on
# Hopper except 9.10.0/9.10.1 works.
RECOMMENDED_CUDNN = "nvidia-cudnn-cu12==9.8.0.87 (or any cuDNN >= 9.5 except 9.10.0/9.10.1 on Hopper)"


class MLAAttentionBackendError(Dsv3Error, RuntimeError):
    """The requested attention backend cannot run MLA correctly with these versions."""


@dataclasses.dataclass(frozen=True)
class MLAAttentionDecision:
    """What TE will run and what to set so that it does."""

    backend: str
    """'fused', 'flash' (FlashAttention 3), 'unfused' (TE's PyTorch attention) or 'te' (not an
    MLA shape: TE decides as usual)."""
    env: Mapping[str, str]
    """NVTE_* variables to set (e.g. {'NVTE_FUSED_ATTN': '0'})."""
    fused_ok: bool
    reason: str
    """Why fused attention is (not) allowed, naming the versions."""
    warning: str | None = None


def _version_tuple(v: VersionLike) -> tuple[int, int, int] | None:
    """(major, minor, patch) from '9.8.0', '9.8.0.87', 90800 (cudnnGetVersion), (9, 8, 0)."""
    if v is None:
        return None
    if isinstance(v, int):
        return (v // 10000, (v % 10000) // 100, v % 100) if v >= 10000 else (v // 1000, (v % 1000) // 100, v % 100)
    if isinstance(v, str):
        parts = []
        for p in v.split("+")[0].split("."):
            digits = "".join(ch for ch in p if ch.isdigit())
            if not digits:
                break
            parts.append(int(digits))
            if not p.isdigit():
                break
        v = parts
    t = tuple(int(x) for x in v)[:3]
    return t + (0,) * (3 - len(t))


def _fmt(v: tuple[int, ...] | None) -> str:
    return "unknown" if v is None else ".".join(str(x) for x in v)


def _dtype_name(dtype) -> str:
    s = str(dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(s, s)


def fused_attention_support(
    cudnn_version: VersionLike,
    compute_capability: tuple[int, int],
    head_dim_qk: int,
    head_dim_v: int,
    dtype,
    training: bool,
) -> tuple[bool, str]:
    """Whether cuDNN fused attention runs (fp16/bf16) correctly for these head dims: (ok, reason)."""
    cudnn = _version_tuple(cudnn_version)
    cc = tuple(compute_capability)
    sm = cc[0] * 10 + cc[1]
    what = (
        f"cuDNN fused attention ({'training' if training else 'inference'}, head_dim_qk={head_dim_qk}, "
        f"head_dim_v={head_dim_v}, {_dtype_name(dtype)}) on sm{sm} with cuDNN {_fmt(cudnn)}"
    )
    if _dtype_name(dtype) not in ("bf16", "fp16"):
        return False, f"{what}: TE uses fused attention for fp16/bf16 only"
    if cudnn is None:
        return False, f"{what}: cuDNN version unknown"
    if cc < (8, 0):
        return False, f"{what}: needs sm80 or newer"
    if head_dim_qk % 8 or head_dim_v % 8:
        return False, f"{what}: head dims must be multiples of 8"
    if cudnn[:2] == (9, 10) and cudnn[2] < 2:
        return False, f"{what}: cuDNN 9.10.0/9.10.1 have known fp16/bf16 SDPA bugs (TE excludes them)"
    if head_dim_qk <= 128 and head_dim_v <= 128:
        if cudnn < (8, 9, 3) and sm not in (80, 90):
            return False, f"{what}: needs cuDNN 8.9.3+ on this GPU"
        return True, f"{what}: supported"
    if max(head_dim_qk, head_dim_v) > 256:
        if training or cudnn < (9, 10, 2):
            return False, f"{what}: head dims > 256 need cuDNN 9.10.2+ and inference"
        return True, f"{what}: supported (inference)"
    mla_192_128 = (head_dim_qk, head_dim_v) == (192, 128)
    if sm == 90:
        if training:
            if cudnn < (9, 5, 0):
                return False, f"{what}: the backward pass with head dims > 128 needs cuDNN 9.5+ on Hopper"
            if (9, 11, 0) <= cudnn < (9, 13, 0) and head_dim_qk != head_dim_v and not mla_192_128:
                return False, f"{what}: cuDNN 9.11-9.12 Hopper backward support-check bug for these head dims (fixed in 9.13)"
            return True, f"{what}: supported"
        if cudnn < (9, 3, 0):
            return False, f"{what}: head dims > 128 need cuDNN 9.1+ and fp16/bf16 forward gave wrong softmax stats before 9.3"
        return True, f"{what}: supported (inference)"
    if sm >= 100 and cc[0] < 12:
        if training:
            if mla_192_128 and cudnn >= (9, 11, 0):
                return True, f"{what}: supported"
            return False, f"{what}: Blackwell backward with head dims > 128 needs d_qk=192/d_v=128 and cuDNN 9.11+"
        if cudnn >= (9, 9, 0):
            return True, f"{what}: supported (inference)"
        return False, f"{what}: Blackwell forward with head dims > 128 needs cuDNN 9.9+"
    # sm80/86/89, sm120
    if training:
        return False, f"{what}: cuDNN's backward supports head dims <= 128 only on this GPU"
    if cudnn >= (9, 10, 2):
        return True, f"{what}: supported (inference)"
    return False, f"{what}: head dims > 128 on this GPU need cuDNN 9.10.2+"


def flash_attention_3_supports(compute_capability: tuple[int, int], head_dim_qk: int, head_dim_v: int, dtype) -> bool:
    """TE's FlashAttention-3 filter for MLA shapes (sm90 only)."""
    if tuple(compute_capability) != (9, 0) or _dtype_name(dtype) not in ("bf16", "fp16"):
        return False
    if head_dim_qk > 256:
        return False
    if head_dim_qk == head_dim_v:
        return True
    return (128 < head_dim_qk <= 192 and 96 < head_dim_v <= 128) or (head_dim_qk <= 64 and head_dim_v <= 512)


def _env_flag(env: Mapping[str, str], name: str) -> bool | None:
    v = env.get(name)
    if v is None or v == "":
        return None
    return v.strip() not in ("0", "false", "False")


def decide_mla_attention_backend(
    te_version: VersionLike,
    cudnn_version: VersionLike,
    compute_capability: tuple[int, int],
    head_dim_qk: int,
    head_dim_v: int,
    dtype,
    training: bool = True,
    requested: str = "auto",
    env: Mapping[str, str] | None = None,
    flash_attn_3: bool = False,
) -> MLAAttentionDecision:
    """Decide the TE attention backend for MLA, or raise :class:`MLAAttentionBackendError`.

    ``requested`` is megatron's ``attention_backend`` name (auto, fused, flash, unfused, local,
    sdpa). ``env`` holds the NVTE_* variables the *user* set (unset = TE's default, enabled).
    """
    env = dict(env or {})
    requested = getattr(requested, "name", requested)
    te = _version_tuple(te_version)
    if te is None or requested in ("local", "sdpa", "unfused"):
        return MLAAttentionDecision("te" if te else "none", {}, False, "TE attention not in use")
    if str(env.get(GUARD_ENV, "1")).strip() == "0":
        return MLAAttentionDecision("te", {}, True, f"{GUARD_ENV}=0: guard disabled by the user")
    if te < (1, 10, 0) and head_dim_qk != head_dim_v:
        raise MLAAttentionBackendError(
            f"Transformer Engine {_fmt(te)} cannot run MLA: it takes one head dim for q, k and v and no "
            f"softmax scale (head_dim_qk={head_dim_qk}, head_dim_v={head_dim_v}), so megatron-core would "
            f"build the wrong attention and the wrong (non-yarn) softmax scale. Install transformer-engine "
            f">= 1.10 (2.5+ recommended), or use the local spec (attention_backend=local)."
        )
    if head_dim_qk == head_dim_v and head_dim_qk <= 128:
        return MLAAttentionDecision("te", {}, True, "head dims <= 128: TE decides as usual")

    fused_ok, reason = fused_attention_support(cudnn_version, compute_capability, head_dim_qk, head_dim_v, dtype, training)
    fa3 = flash_attn_3 and flash_attention_3_supports(compute_capability, head_dim_qk, head_dim_v, dtype)
    user_fused = _env_flag(env, "NVTE_FUSED_ATTN")
    user_flash = _env_flag(env, "NVTE_FLASH_ATTN")
    fix = (
        f"Fix: install {RECOMMENDED_CUDNN} (and a TE built against it), or choose another backend: "
        f"attention_backend=unfused (TE's PyTorch attention; memory ~ seq^2) or the local spec with "
        f"attention_backend=local/sdpa (no TE), or flash with FlashAttention-3 on Hopper. "
        f"{GUARD_ENV}=0 skips this check."
    )
    # auto in fp32: TE never fuses it, whatever NVTE_FUSED_ATTN says (megatron's auto
    # mode writes NVTE_FUSED_ATTN=1 into os.environ, and a process it spawns inherits it as if the user had set it)
    if requested == "auto" and _dtype_name(dtype) not in ("bf16", "fp16"):
        return MLAAttentionDecision("unfused", {}, False, reason)
    if requested == "fused" or (requested == "auto" and user_fused is True and not fused_ok):
        if fused_ok:
            return MLAAttentionDecision("fused", {}, True, reason)
        forced = "attention_backend=fused" if requested == "fused" else "NVTE_FUSED_ATTN=1"
        raise MLAAttentionBackendError(f"{forced} asks for {reason}. {fix}")
    if requested == "flash":
        if fa3:
            return MLAAttentionDecision("flash", {}, fused_ok, reason)
        raise MLAAttentionBackendError(
            f"attention_backend=flash cannot run MLA (head_dim_qk={head_dim_qk}, head_dim_v={head_dim_v}) "
            f"on sm{compute_capability[0]}{compute_capability[1]}: FlashAttention 2 does not support "
            f"different q/k and v head dims and FlashAttention 3 ({'installed' if flash_attn_3 else 'not installed'}) "
            f"supports them on Hopper only. {fix}"
        )
    # auto
    if fused_ok and user_fused is not False:
        return MLAAttentionDecision("fused", {}, True, reason)
    backend = "flash" if (fa3 and user_flash is not False) else "unfused"
    if user_fused is False:
        return MLAAttentionDecision(backend, {}, fused_ok, "NVTE_FUSED_ATTN=0 set by the user")
    warning = (
        f"MLA attention: not using {reason}. Transformer Engine will run "
        f"{'FlashAttention 3' if backend == 'flash' else 'its unfused PyTorch attention (slow, memory ~ seq^2)'} "
        f"instead (NVTE_FUSED_ATTN=0). {fix}"
    )
    return MLAAttentionDecision(backend, {"NVTE_FUSED_ATTN": "0"}, False, reason, warning)


# --------------------------------------------------------------------------- runtime glue


def runtime_versions() -> dict:
    """TE version, cuDNN version (as TE sees it), compute capability and FlashAttention-3 presence
    of this process; TE version None when transformer_engine is not installed."""
    out = {"te_version": None, "cudnn_version": None, "compute_capability": (0, 0), "flash_attn_3": False}
    if importlib.util.find_spec("transformer_engine") is None:
        return out
    try:
        from megatron.core.utils import get_te_version

        out["te_version"] = str(get_te_version())
    except Exception:  # noqa: BLE001 - TE present but unusable (its import fails in many ways): versions unknown
        return out
    import torch

    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        out["cudnn_version"] = tuple(get_cudnn_version())
    except Exception:  # noqa: BLE001 - an older TE without get_cudnn_version (or one that fails): torch's view
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        out["cudnn_version"] = v
    if torch.cuda.is_available():
        out["compute_capability"] = tuple(torch.cuda.get_device_capability())
    out["flash_attn_3"] = any(
        importlib.util.find_spec(m) is not None for m in ("flash_attn_3", "flash_attn_interface")
    )
    return out


def mla_head_dims(config) -> tuple[int, int] | None:
    """(head_dim_qk, head_dim_v) of an MLA config whose q/k and v head dims differ, else None."""
    if not getattr(config, "multi_latent_attention", False):
        return None
    qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    v = config.v_head_dim
    return (qk, v) if qk != v or qk > 128 else None


def _config_dtype(config):
    if getattr(config, "fp8", None) and getattr(config, "fp8_dot_product_attention", False):
        return "fp8"
    if config.bf16:
        return "bf16"
    if config.fp16:
        return "fp16"
    return _dtype_name(config.params_dtype)


_warned = set()
# NVTE_* values megatron-core itself wrote into os.environ (LanguageModule._set_attention_backend);
# anything else found there was set by the user.
MCORE_SET_ENV: dict = {}
_NVTE = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def user_env(environ: Mapping[str, str] | None = None) -> dict:
    """The NVTE_* attention variables (and the guard switch) the user set, i.e. os.environ minus
    what megatron-core wrote there for an earlier model of this process."""
    environ = os.environ if environ is None else environ
    out = {k: environ[k] for k in _NVTE if k in environ and MCORE_SET_ENV.get(k) != environ[k]}
    if GUARD_ENV in environ:
        out[GUARD_ENV] = environ[GUARD_ENV]
    return out


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=2)


def check_config(config, requested=None, env: Mapping[str, str] | None = None,
                 versions: dict | None = None, training: bool = True) -> MLAAttentionDecision | None:
    """Apply the guard to a megatron config (None when it is not an MLA config or TE is absent).

    ``env`` defaults to :func:`user_env`. Raises MLAAttentionBackendError; warns once per
    distinct warning."""
    dims = mla_head_dims(config)
    if dims is None:
        return None
    versions = runtime_versions() if versions is None else versions
    if versions.get("te_version") is None:
        return None
    dtype = _config_dtype(config)
    if dtype == "fp8":
        return None  # FP8 attention has its own TE rules (d=128 only for training on Hopper)
    requested = requested if requested is not None else config.attention_backend
    decision = decide_mla_attention_backend(
        versions["te_version"], versions["cudnn_version"], versions["compute_capability"], dims[0], dims[1],
        dtype, training=training, requested=requested, env=user_env() if env is None else env,
        flash_attn_3=versions.get("flash_attn_3", False),
    )
    if decision.warning:
        _warn_once(decision.warning)
    return decision


def check_te_attention(config, k_channels, v_channels, versions: dict | None = None,
                       environ: Mapping[str, str] | None = None) -> None:
    """TEDotProductAttention's own check, for models not built through LanguageModule (which sets
    NVTE_FUSED_ATTN=0 itself in auto mode): refuse TE < 1.10 for MLA dims, and refuse fused
    attention on a known-bad combination where TE cannot tell by itself (TE < 2.5 has no
    training/inference distinction); with TE >= 2.5 TE avoids those combinations, so only warn."""
    if k_channels is None or v_channels is None or (k_channels == v_channels and k_channels <= 128):
        return
    environ = os.environ if environ is None else environ
    if str(environ.get(GUARD_ENV, "1")).strip() == "0":
        return
    versions = runtime_versions() if versions is None else versions
    te = _version_tuple(versions.get("te_version"))
    if te is None:
        return
    dtype = _config_dtype(config)
    if dtype == "fp8":
        return
    if te < (1, 10, 0) and k_channels != v_channels:
        decide_mla_attention_backend(te, versions.get("cudnn_version"), versions.get("compute_capability", (0, 0)),
                                     k_channels, v_channels, dtype)  # raises
    if str(environ.get("NVTE_FUSED_ATTN", "1")).strip() == "0":
        return
    ok, reason = fused_attention_support(versions.get("cudnn_version"), versions.get("compute_capability", (0, 0)),
                                         k_channels, v_channels, dtype, training=True)
    if ok:
        return
    msg = (f"Fused attention is enabled (NVTE_FUSED_ATTN={environ.get('NVTE_FUSED_ATTN', 'unset')}) for "
           f"{reason}. Set NVTE_FUSED_ATTN=0, or install {RECOMMENDED_CUDNN}. {GUARD_ENV}=0 skips this check.")
    if te < (2, 5, 0):
        raise MLAAttentionBackendError(
            f"Transformer Engine {_fmt(te)} would select cuDNN fused attention here (it cannot tell training "
            f"from inference; backward then fails or, with cuDNN 9.10.0/9.10.1, computes wrong values). {msg}")
    _warn_once(f"Transformer Engine {_fmt(te)} will pick another attention backend by itself: {msg}")
