"""The test batch and the loss both sides compute.

One global batch of ``batch_size`` sequences is cut into micro-batches of ``micro_batch_size``
consecutive sequences; micro-batch ``g`` is the same sequences at every layout (data-parallel rank
``r`` of ``dp`` runs micro-batches ``r*n .. r*n+n-1``). Labels are the next tokens. The loss mask
hides a random-length prefix of every sequence (a "prompt"), so that the loss normalisation is
tested, not just assumed.

The loss is megatron's training loss, which HF's side reproduces exactly: per micro-batch the
token mean of the cross entropy over unmasked tokens, then the mean over all micro-batches of all
data-parallel ranks (megatron's schedule divides by the number of micro-batches, DDP by the
data-parallel size). It equals the global token mean only when every micro-batch has the same
number of unmasked tokens, which is why the mask is ragged.
"""

from __future__ import annotations

import torch


def make_batch(vocab_size: int, batch_size: int, seq_length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_length + 1), generator=g)
    prefix = torch.randint(0, max(1, seq_length // 2), (batch_size,), generator=g)
    pos = torch.arange(seq_length)
    return dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        loss_mask=(pos[None, :] >= prefix[:, None]).float(),
        position_ids=pos.expand(batch_size, seq_length).contiguous(),
    )


def check_divisible(batch_size: int, micro_batch_size: int, dp: int, where: str = "") -> int:
    """Micro-batches per data-parallel rank; raises naming the sizes when they do not divide."""
    if batch_size % (micro_batch_size * dp):
        raise ValueError(f"{where}batch size {batch_size} is not divisible by micro-batch size {micro_batch_size} "
                         f"x data-parallel size {dp}")
    return batch_size // (micro_batch_size * dp)


def micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int, dp_rank: int = 0, dp: int = 1) -> list[dict]:
    n = check_divisible(batch["tokens"].shape[0], micro_batch_size, dp)
    out = []
    for k in range(n):
        g = dp_rank * n + k
        sl = slice(g * micro_batch_size, (g + 1) * micro_batch_size)
        out.append({key: v[sl].contiguous() for key, v in batch.items()})
    return out


def per_token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, S, V] logits, [B, S] labels -> [B, S] cross entropy in fp32."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def micro_losses(ce: torch.Tensor, loss_mask: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """Token-mean loss of every micro-batch (in global micro-batch order)."""
    b = ce.shape[0]
    ce = ce.view(b // micro_batch_size, -1)
    mask = loss_mask.view(b // micro_batch_size, -1).to(ce.dtype)
    return (ce * mask).sum(-1) / mask.sum(-1)


def training_loss(ce: torch.Tensor, loss_mask: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """The scalar megatron's step back-propagates (see module doc)."""
    return micro_losses(ce, loss_mask, micro_batch_size).mean()


def no_tf32() -> None:
    """fp32 means fp32 on both sides: no TF32 tensor-core matmuls (10-bit mantissa) on GPUs, whatever
    a library or the environment preferred. (NVIDIA_TF32_OVERRIDE=1 in the environment would still
    force it; the report's GPU numbers are meaningless then.)"""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
