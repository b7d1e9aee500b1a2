"""DeepSeek-V3 blockwise FP8 (e4m3fn, 128x128 blocks, float32 ``scale_inv``) <-> BF16, bit-exact.

The formula (DeepSeek's ``inference/kernel.py::weight_dequant`` with bf16 as default dtype)::

    bf16[i, j] = round_to_nearest_even_bf16( float32(fp8[i, j]) * scale_inv[i // 128, j // 128] )

``dequant_reference`` is that formula written out plainly. ``dequant`` computes the same bits faster:

* CPU: torch's fp8->fp32 conversion is scalar (~0.2 GB/s on 2 cores). Instead the fp8 byte is
  re-packed into an fp16 bit pattern with two integer ops (sign to bit 15, exponent+mantissa to
  bits 13..7): that fp16 equals ``fp8 / 256`` exactly for every finite e4m3fn value, subnormals
  included. ``fp16 * (scale_inv * 256)`` (computed in fp32, one rounding to bf16 on store) is then
  the same real product as ``fp8 * scale_inv``, so the result is bit-identical. ``scale_inv * 256``
  is exact in fp32 (a power-of-two multiply) unless it overflows (checked per call), and NaN codes
  (0x7f/0xff) do not survive the re-packing (checked per 128-row block); both take the formula.
* CUDA: a Triton kernel (one 128-aligned tile per program, scalar scale load, fp32 multiply,
  rounding cast to bf16); the eager formula where Triton is missing.

``quantize`` is the inverse in DeepSeek's format: per 128x128 block, ``scale_inv`` from the block's
absolute max, ``fp8 = saturate(x / scale_inv)``. ``scale_fmt="pow2"`` (default) rounds ``scale_inv`` up
to a power of two (DeepSeek-V3.1's UE8M0 choice): then ``x / scale_inv`` is exact, and every block
whose values are FP8-representable up to a power-of-two block scale round-trips bit-exactly
through ``quantize`` and ``dequant``. ``scale_fmt="amax"`` uses ``amax / 448`` (V3-0324's float scales).
"""

from __future__ import annotations

import math
import threading

import torch

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn
SCALE_FMTS = ("pow2", "amax")


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int = BLOCK) -> tuple[int, int]:
    m, n = shape
    return (math.ceil(m / block), math.ceil(n / block))


def _expand(s: torch.Tensor, m: int, n: int, block: int = BLOCK) -> torch.Tensor:
    return s.repeat_interleave(block, dim=0)[:m].repeat_interleave(block, dim=1)[:, :n]


def dequant_reference(w: torch.Tensor, s: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The formula, plainly: fp8 -> fp32, times the block's fp32 scale_inv, one rounding to bf16."""
    m, n = w.shape
    return (w.to(torch.float32) * _expand(s.to(torch.float32), m, n, block)).to(torch.bfloat16)


# --------------------------------------------------------------------------------------- CPU


def _dequant_cpu(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    m, n = w.shape
    s32 = s.to(torch.float32)
    if m == 0 or n == 0:
        return out
    if not bool(torch.isfinite(s32).all()) or float(s32.abs().max()) >= 2.0**119:
        out.copy_(dequant_reference(w, s32))
        return out
    i8 = w.view(torch.int8)
    srows = (s32 * 256.0).repeat_interleave(BLOCK, dim=1)[:, :n]  # [ceil(m/128), n]
    rows = min(BLOCK, m)
    buf = torch.empty((rows, n), dtype=torch.int16)
    f32 = torch.empty((rows, n), dtype=torch.float32)
    for r0 in range(0, m, BLOCK):  # one 128-row block at a time: the buffers stay in cache
        r1 = min(r0 + BLOCK, m)
        blk = i8[r0:r1]
        # e4m3fn NaN codes 0x7f / 0xff are the int8 max (127) / the uint8 max (255): the re-packing
        # below would turn them into 480 * scale, so such a block takes the formula.
        if int(blk.max()) == 127 or int(blk.view(torch.uint8).max()) == 255:
            out[r0:r1] = dequant_reference(w[r0:r1], s32[r0 // BLOCK: r0 // BLOCK + 1])
            continue
        b, f = buf[: r1 - r0], f32[: r1 - r0]
        b.copy_(blk)  # sign-extends: bits 15..8 = sign
        b.bitwise_left_shift_(7).bitwise_and_(-16385)  # 0xBFFF: clear bit 14 (a sign copy) -> fp16 = fp8 / 256
        f.copy_(b.view(torch.float16)).mul_(srows[r0 // BLOCK])  # exact fp32 operands, one fp32 rounding
        out[r0:r1].copy_(f)  # one rounding to bf16 (nearest-even)
    return out


# -------------------------------------------------------------------------------------- CUDA

_triton_kernel = None
_triton_lock = threading.Lock()


def _get_triton_kernel():
    """The Triton dequant kernel, or None where Triton is not importable."""
    global _triton_kernel
    with _triton_lock:
        if _triton_kernel is None:
            try:
                import triton
                import triton.language as tl
            except ImportError:
                _triton_kernel = False
                return None

            @triton.jit
            def _dequant_kernel(x_ptr, s_ptr, y_ptr, M, N, SN, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
                # One BLOCK_M x BLOCK_N tile inside one 128x128 scale block: one scalar scale load.
                pid_m = tl.program_id(0)
                pid_n = tl.program_id(1)
                offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
                offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
                s = tl.load(s_ptr + ((pid_m * BLOCK_M) // 128) * SN + (pid_n * BLOCK_N) // 128)
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                y = x * s
                tl.store(y_ptr + offs, y.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)

            _triton_kernel = _dequant_kernel
        return _triton_kernel or None


# BLOCK_M x BLOCK_N must tile a 128x128 scale block; 32x128 with 4 warps keeps ~1.8k programs
# on a 2048x7168 expert weight and 16-byte fp8 loads / 32-byte bf16 stores per thread.
TRITON_BLOCK_M = 32
TRITON_BLOCK_N = 128
TRITON_NUM_WARPS = 4


def _dequant_triton(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    kernel = _get_triton_kernel()
    m, n = w.shape
    if m == 0 or n == 0:
        return out
    s32 = s.to(torch.float32).contiguous()
    grid = (math.ceil(m / TRITON_BLOCK_M), math.ceil(n / TRITON_BLOCK_N))
    kernel[grid](w.contiguous(), s32, out, m, n, s32.shape[1],
                 BLOCK_M=TRITON_BLOCK_M, BLOCK_N=TRITON_BLOCK_N, num_warps=TRITON_NUM_WARPS)
    return out


def disable_triton() -> None:
    """Make ``dequant(backend="auto")`` use the eager formula on CUDA from now on."""
    global _triton_kernel
    with _triton_lock:
        _triton_kernel = False


def self_check(device: torch.device | str) -> str | None:
    """Dequant every finite FP8 code over partial 128-blocks on DEVICE with the backend ``auto`` picks,
    and compare bit for bit with the formula on the CPU. None if identical, else what went wrong."""
    g = torch.Generator().manual_seed(0)
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    w = codes[torch.randint(0, len(codes), (200, 300), generator=g)]
    w[:2].copy_(codes.repeat(3)[:600].view(2, 300))
    w = w.view(FP8)
    s = torch.exp2(torch.randint(-40, 20, scale_shape(w.shape), generator=g).float()) * (
        1 + torch.rand(scale_shape(w.shape), generator=g))
    try:
        got = dequant(w.to(device), s.to(device)).cpu()
    except Exception as e:  # noqa: BLE001 - e.g. Triton without fp8 support on this GPU: reported, not raised
        return f"{type(e).__name__}: {str(e)[:300]}"
    if not torch.equal(got.view(torch.int16), dequant_reference(w, s).view(torch.int16)):
        return "result differs from the formula"
    return None


def _check(w: torch.Tensor, s: torch.Tensor, block: int) -> None:
    if w.dtype != FP8:
        raise TypeError(f"dequant: weight dtype {w.dtype}, expected {FP8}")
    if w.dim() != 2:
        raise ValueError(f"dequant: weight must be 2-D, got shape {list(w.shape)}")
    if tuple(s.shape) != scale_shape(w.shape, block):
        raise ValueError(f"dequant: scale_inv shape {list(s.shape)}, expected {list(scale_shape(w.shape, block))} "
                         f"for weight {list(w.shape)}")


def dequant(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Bit-exact fast ``dequant_reference`` on W's device. backend: auto | reference | cpu | triton."""
    _check(w, s, BLOCK)
    if out is None:
        out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    if backend == "auto":
        if w.device.type == "cpu":
            backend = "cpu"
        elif w.device.type == "cuda" and _get_triton_kernel() is not None:
            backend = "triton"
        else:
            backend = "reference"
    if backend == "cpu":
        return _dequant_cpu(w, s, out)
    if backend == "triton":
        return _dequant_triton(w, s.to(w.device), out)
    if backend == "reference":
        out.copy_(dequant_reference(w, s.to(w.device)))
        return out
    raise ValueError(f"unknown dequant backend {backend!r} (allowed: auto, reference, cpu, triton)")


# ---------------------------------------------------------------------------------- quantize


def block_amax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per 128x128 block max |x| in fp32, shape scale_shape(x.shape)."""
    m, n = x.shape
    sm, sn = scale_shape(x.shape, block)
    a = x.abs().to(torch.float32)
    a = torch.nn.functional.pad(a, (0, sn * block - n, 0, sm * block - m))
    return a.view(sm, block, sn, block).amax(dim=(1, 3))


def quant_scales(amax: torch.Tensor, scale_fmt: str = "pow2") -> torch.Tensor:
    """scale_inv per block from its amax; all-zero blocks get 1.0."""
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r} (allowed: {', '.join(SCALE_FMTS)})")
    s = amax / FP8_MAX
    if scale_fmt == "pow2":
        # smallest power of two p with amax / p <= 448 (x / p is then exact)
        mant, exp = torch.frexp(s)
        exp = exp - (mant == 0.5).to(exp.dtype)  # s already a power of two: 2**(exp-1)
        p = torch.ldexp(torch.ones_like(s), exp)
        p = torch.where(amax / p > FP8_MAX, p * 2, p)
        s = p
    return torch.where(amax > 0, s, torch.ones_like(s))


def quantize(x: torch.Tensor, scale_fmt: str = "pow2", block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16/FP32 [M, N] -> (float8_e4m3fn [M, N], float32 scale_inv [ceil(M/128), ceil(N/128)])."""
    if x.dim() != 2:
        raise ValueError(f"quantize: expected a 2-D tensor, got shape {list(x.shape)}")
    x32 = x.to(torch.float32)
    if not bool(torch.isfinite(x32).all()):
        raise ValueError("quantize: tensor has NaN or Inf values")
    s = quant_scales(block_amax(x32, block), scale_fmt)
    m, n = x.shape
    q = (x32 / _expand(s, m, n, block)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s
