"""The FP8 block (de)quantization kernels are bit-exact with DeepSeek's formula (CPU)."""

import pytest
import torch

from dsv3_rl.checkpoint import fp8_kernels as K

FINITE_CODES = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def formula(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek's formula, element by element over 128x128 blocks (independent of dequant_reference)."""
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blk = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            out[blk] = (w[blk].to(torch.float32) * s[bi, bj].to(torch.float32)).to(torch.bfloat16)
    return out


def random_case(m, n, seed, exp_range=(-30, 10)):
    g = torch.Generator().manual_seed(seed)
    w = FINITE_CODES[torch.randint(0, len(FINITE_CODES), (m, n), generator=g)].view(K.FP8)
    sm, sn = K.scale_shape((m, n))
    e = torch.randint(*exp_range, (sm, sn), generator=g).float()
    s = torch.exp2(e) * (1 + torch.rand(sm, sn, generator=g))
    return w, s


@pytest.mark.parametrize("m, n", [(1, 1), (40, 64), (128, 128), (576, 160), (300, 7), (129, 257), (2048, 96)])
def test_reference_is_the_formula(m, n):
    w, s = random_case(m, n, seed=m * 7 + n)
    assert bits_equal(K.dequant_reference(w, s), formula(w, s))


@pytest.mark.parametrize("m, n", [(1, 1), (40, 64), (128, 128), (576, 160), (300, 7), (129, 257), (2048, 96)])
def test_fast_cpu_dequant_bit_exact(m, n):
    w, s = random_case(m, n, seed=m + 3 * n)
    assert bits_equal(K.dequant(w, s), formula(w, s))


def test_every_code_every_exponent():
    """All 254 finite e4m3fn codes against scales spanning fp32's exponent range (subnormal products
    included), and mantissas that make bf16 rounding ties likely."""
    w = FINITE_CODES.repeat(128)[: 128 * 254].view(128, 254).view(K.FP8)
    for e in range(-149, 120, 3):
        for mant in (1.0, 1.00390625, 1.5, 1.99609375, 1.2345678):
            s = torch.full(K.scale_shape(w.shape), mant) * 2.0 ** e
            assert bits_equal(K.dequant(w, s), K.dequant_reference(w, s)), (e, mant)


def test_nan_codes_and_huge_scales_fall_back_to_the_formula():
    w = torch.tensor([[0x7F, 0x01, 0xFF, 0x38]], dtype=torch.uint8).view(K.FP8)
    s = torch.tensor([[3.0]])
    got, ref = K.dequant(w, s), K.dequant_reference(w, s)
    assert bits_equal(got, ref) and torch.isnan(got[0, 0]) and torch.isnan(got[0, 2])
    w3, s3 = random_case(400, 300, seed=4)  # one NaN in the third row block; the others take the fast path
    w3.view(torch.uint8)[300, 7] = 0xFF
    assert bits_equal(K.dequant(w3, s3), K.dequant_reference(w3, s3)) and torch.isnan(K.dequant(w3, s3)[300, 7])
    w2, _ = random_case(64, 64, seed=1)
    for big in (2.0**119, 3e38, float("inf")):
        s2 = torch.tensor([[big]])
        assert bits_equal(K.dequant(w2, s2), K.dequant_reference(w2, s2))


def test_planted_faults_are_caught():
    w, s = random_case(300, 260, seed=5)
    ref = formula(w, s)
    # one ulp in one element
    bad = ref.clone()
    bad.view(torch.int16)[17, 200] += 1
    assert not bits_equal(bad, ref)
    # rounding twice (multiply in bf16) and a transposed scale grid: plausible bugs, must not pass
    bf16_mul = (w.to(torch.bfloat16) * K._expand(s.to(torch.bfloat16), 300, 260)).to(torch.bfloat16)
    assert not bits_equal(bf16_mul, ref)
    s_sq, _ = random_case(256, 256, seed=6)
    sq = torch.rand(2, 2) + 0.5
    assert not bits_equal(K.dequant(s_sq, sq.t().contiguous()), formula(s_sq, sq))


def test_shape_checks():
    w, s = random_case(200, 130, seed=2)
    with pytest.raises(ValueError, match=r"scale_inv shape \[1, 2\], expected \[2, 2\]"):
        K.dequant(w, s[:1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        K.dequant(w.to(torch.bfloat16), s)


def test_pow2_round_trip_is_exact():
    """Values FP8-representable up to a power-of-two block scale survive quantize -> dequant."""
    g = torch.Generator().manual_seed(0)
    q = FINITE_CODES[torch.randint(0, len(FINITE_CODES), (300, 260), generator=g)].view(K.FP8)
    s = torch.exp2(torch.randint(-20, 5, K.scale_shape(q.shape), generator=g).float())
    x = K.dequant_reference(q, s)  # exactly q * s in bf16
    q2, s2 = K.quantize(x, "pow2")
    assert bits_equal(K.dequant(q2, s2), x)
    # and plain FP8 values (scale 1)
    y = q.to(torch.bfloat16)
    assert bits_equal(K.dequant(*K.quantize(y, "pow2")), y)
    # planted fault: amax scales (amax/448) are not exact once a block's max is not 448 * 2**k
    small = (q.float().clamp(-320, 320) * 2.0**-8).to(torch.bfloat16)
    assert bits_equal(K.dequant(*K.quantize(small, "pow2")), small)
    assert not bits_equal(K.dequant(*K.quantize(small, "amax")), small)


def test_quantize_scales_and_error_bounds():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(257, 300, generator=g) * 0.02).to(torch.bfloat16)
    x[:128, :128] = 0  # an all-zero block
    for fmt in ("pow2", "amax"):
        q, s = K.quantize(x, fmt)
        assert q.dtype == K.FP8 and s.dtype == torch.float32 and s.shape == (3, 3)
        assert s[0, 0] == 1.0 and torch.equal(K.dequant(q, s)[:128, :128].float(), torch.zeros(128, 128))
        amax = K.block_amax(x.float())
        ratio = (amax / s)[1:, 1:]  # block (0, 0) is all zero
        assert (ratio <= 448 * (1 + 2**-23)).all()
        assert (ratio > 224).all() if fmt == "pow2" else torch.allclose(ratio, torch.full_like(ratio, 448.0))
        err = (K.dequant(q, s).float() - x.float()).abs()
        # e4m3: 3 mantissa bits (relative 2**-4 half-ulp); subnormals: absolute 2**-10 * scale
        assert (err <= x.float().abs() * 2**-3 + K._expand(s, 257, 300) * 2**-9).all()
        if fmt == "pow2":
            m, e = torch.frexp(s)
            assert (m == 0.5).all()
    with pytest.raises(ValueError, match="NaN or Inf"):
        K.quantize(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="allowed: pow2, amax"):
        K.quant_scales(torch.ones(1, 1), "e8m0")


def test_self_check(monkeypatch):
    assert K.self_check("cpu") is None
    # planted fault: a kernel that rounds by truncation must be reported
    def truncating(w, s, out):
        prod = w.to(torch.float32) * K._expand(s, *w.shape)
        out.copy_((prod.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16))
        return out

    monkeypatch.setattr(K, "_dequant_cpu", truncating)
    assert K.self_check("cpu") == "result differs from the formula"
