"""The refit checksum digest (dsv3_rl.refit.manifest) gives the same value on the GPU as on the CPU, and on the
GPU too a swap of two unequal words changes it (issue 29: weights distinct per position)."""

import pytest
import torch

from dsv3_rl.refit import manifest as M

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("n", [1, 3, 1000, M.CHUNK_WORDS, 20 * M.CHUNK_WORDS + 12345])  # 20 chunks: two launches
def test_digest_on_gpu_equals_cpu(n):
    x = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    assert M.digest(x.cuda()) == M.digest(x)
    b = torch.randn(n // 2 + 1).to(torch.bfloat16)
    assert M.digest(b.cuda()) == M.digest(b)


def test_digest_on_gpu_sees_swaps():
    x = torch.randint(-(1 << 31), (1 << 31) - 1, (3 * M.CHUNK_WORDS + 7,), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(1)).cuda()
    d0 = M.digest(x)
    g = torch.Generator().manual_seed(2)
    for i, j in torch.randint(0, x.numel(), (50, 2), generator=g).tolist() + [(5, M.CHUNK_WORDS + 5)]:
        if x[i] == x[j]:
            continue
        y = x.clone()
        y[i], y[j] = x[j], x[i]
        assert M.digest(y) != d0, (i, j)
