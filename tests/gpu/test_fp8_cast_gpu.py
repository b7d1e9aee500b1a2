"""GPU FP8 dequant (Triton kernel) is bit-identical to DeepSeek's formula computed on the CPU."""

import hashlib

import pytest
import torch

from dsv3_rl.checkpoint import fp8_kernels as K

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FINITE_CODES = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def random_case(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    w = FINITE_CODES[torch.randint(0, len(FINITE_CODES), (m, n), generator=g)].view(K.FP8)
    sm, sn = K.scale_shape((m, n))
    s = torch.exp2(torch.randint(-30, 10, (sm, sn), generator=g).float()) * (1 + torch.rand(sm, sn, generator=g))
    return w, s


def test_triton_is_available_and_passes_the_self_check():
    assert K._get_triton_kernel() is not None, "Triton missing: the GPU cast would fall back to the eager formula"
    assert K.self_check("cuda") is None


@pytest.mark.parametrize("m, n", [(1, 1), (40, 64), (128, 128), (576, 7168), (300, 7), (129, 257),
                                  (2048, 7168), (7168, 2048), (18432, 7168), (24576, 1536)])
def test_triton_dequant_bit_exact(m, n):
    w, s = random_case(m, n, seed=m * 31 + n)
    ref = K.dequant_reference(w, s)
    assert bits_equal(K.dequant(w.cuda(), s.cuda(), backend="triton"), ref)
    assert bits_equal(K.dequant(w.cuda(), s.cuda(), backend="reference"), ref)


def test_every_code_every_exponent_on_gpu():
    w = FINITE_CODES.repeat(128)[: 128 * 254].view(128, 254).view(K.FP8)
    wc = w.cuda()
    for e in range(-149, 120, 3):
        for mant in (1.0, 1.00390625, 1.5, 1.99609375, 1.2345678):
            s = torch.full(K.scale_shape(w.shape), mant) * 2.0 ** e
            assert bits_equal(K.dequant(wc, s.cuda()), K.dequant_reference(w, s)), (e, mant)


def test_planted_fault_is_caught_on_gpu():
    w, s = random_case(256, 256, seed=3)
    out = K.dequant(w.cuda(), s.cuda())
    out.view(torch.int16)[100, 100] += 1
    assert not bits_equal(out, K.dequant_reference(w, s))


def test_large_tensor_offsets():
    """More than 2**31 elements: the kernel's 64-bit offsets."""
    m, n = 65536 + 128, 32768
    w = torch.randint(0, 0x7E, (m, n), dtype=torch.uint8, device="cuda").view(K.FP8)
    s = torch.rand(K.scale_shape((m, n)), device="cuda") + 0.5
    out = K.dequant(w, s)
    tail = slice(m - 256, m)  # the last two 128-row scale blocks
    assert bits_equal(out[tail], K.dequant_reference(w[tail].cpu(), s[-2:].cpu()))


def test_gpu_cast_matches_cpu_cast(tmp_path):
    from dsv3_rl.checkpoint.fp8 import cast_checkpoint
    from dsv3_rl.minimodel.mini_model import write_mini_model

    src = write_mini_model("tiny-vllm", tmp_path / "src", fmt="fp8-release",
                           overrides={"num_hidden_layers": 2, "hidden_size": 160, "intermediate_size": 300})
    quiet = dict(progress=False, log=lambda *_: None)
    cast_checkpoint(src, tmp_path / "cpu", device="cpu", **quiet)
    summary = cast_checkpoint(src, tmp_path / "gpu", device="cuda", **quiet)
    assert summary.device.startswith("cuda")

    def digests(d):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))}

    assert digests(tmp_path / "gpu") == digests(tmp_path / "cpu")
