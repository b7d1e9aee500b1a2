"""Load a megatron checkpoint at a parallel layout and check the model's logits against HF's.

    dsv3-convert verify --mcore-dir MCORE --hf-dir HF --out DIR                  # TP1, one process
    torchrun --nproc-per-node 2 -m dsv3_rl.convert.verify --mcore-dir MCORE --hf-dir HF --layout tp=2 --out DIR

The weights are loaded the way verl loads ``actor.megatron.dist_checkpointing_path``
(``verl.utils.model.load_mcore_dist_weights``: the model's own ``sharded_state_dict()`` and an
in-place ``dist_checkpointing.load(..., strict=ASSUME_OK_UNEXPECTED)``), then a forward pass runs
through megatron's pipeline schedule on fixed tokens; the vocab-parallel logits are gathered over
TP. Rank 0 writes ``DIR/logits.pt`` and, with ``--hf-dir``, compares against
``DeepseekV3ForCausalLM.from_pretrained(HF)`` on the same tokens (fp32 both), prints one line
with the max abs / relative difference and exits 1 when it exceeds ``--atol``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from dsv3_rl.cliargs import add_layout
from dsv3_rl.errors import cli_main


def tokens(vocab: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def load_like_verl(chunks: list, path: Path) -> None:
    """What ``verl.utils.model.load_mcore_dist_weights`` does (kept here so the check needs no verl import)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import StrictHandling

    from dsv3_rl.mcore.runtime import unwrap

    for model in chunks:
        ssd = unwrap(model).sharded_state_dict(prefix="")
        dist_checkpointing.load(ssd, str(path), strict=StrictHandling.ASSUME_OK_UNEXPECTED)


def megatron_logits(hf_config, parallel, path: Path, toks: torch.Tensor, use_verl_loader: bool = False,
                    save_dir: Path | None = None) -> torch.Tensor | None:
    """Full logits [b, s, V] on the rank that has them (last PP stage, TP rank 0, DP rank 0), else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from dsv3_rl.mcore import runtime
    from dsv3_rl.mcore.runtime import unwrap

    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not torch.distributed.is_initialized():
        # one process: no TCP rendezvous to race for a port
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    runtime.init_distributed(parallel, seed=1234)
    chunks = runtime.build_model(hf_config, parallel, dtype=torch.float32)
    if use_verl_loader:
        from verl.utils.model import load_mcore_dist_weights

        load_mcore_dist_weights(chunks, str(path))
    else:
        load_like_verl(chunks, path)
    if save_dir is not None:  # re-save at this layout with megatron's own writer, as training does
        from megatron.core import dist_checkpointing

        sd = {}
        for c in chunks:
            sd.update(unwrap(c).sharded_state_dict())
        if torch.distributed.get_rank() == 0:
            save_dir.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(sd, str(save_dir))
    for c in chunks:
        c.eval()
    b, s = toks.shape
    pos = torch.arange(s).expand(b, s).contiguous()
    out: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch[0], batch[1], attention_mask=None)

        def loss_func(output):
            out.append(gather_from_tensor_model_parallel_region(output.float()).detach().cpu())
            return output.sum() * 0.0, {}

        return logits, loss_func

    # one sequence per micro-batch (the interleaved schedule needs several micro-batches)
    data = [(toks[i:i + 1], pos[i:i + 1]) for i in range(b)]
    iters = [iter(data) for _ in chunks]
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
                                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=b, seq_length=s,
                                    micro_batch_size=1, forward_only=True)
    mine = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0)
    return torch.cat(out, 0) if mine and out else None


def hf_logits(hf_dir: Path, toks: torch.Tensor) -> torch.Tensor:
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(toks).logits.float()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mcore-dir", type=Path, required=True)
    ap.add_argument("--hf-dir", type=Path, default=None, help="compare with this HF model (rank 0)")
    ap.add_argument("--hf-config", type=Path, default=None, help="HF config dir (default: --hf-dir, else MCORE/hf_meta)")
    ap.add_argument("--out", type=Path, required=True, help="logits.pt and compare.json go here")
    add_layout(ap, help="the layout to load at; the world size comes from torchrun")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--verl-loader", action="store_true", help="load through verl.utils.model.load_mcore_dist_weights")
    ap.add_argument("--save-dir", type=Path, default=None,
                    help="after loading, save the model again with dist_checkpointing.save at this layout")


@cli_main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv3-convert verify", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    cfg_dir = args.hf_config or args.hf_dir or args.mcore_dir / "hf_meta"
    hf_config = AutoConfig.from_pretrained(cfg_dir)
    parallel = args.layout
    toks = tokens(hf_config.vocab_size, args.batch, args.seq)
    logits = megatron_logits(hf_config, parallel, args.mcore_dir, toks, args.verl_loader, args.save_dir)
    rc = 0
    if logits is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(logits, args.out / "logits.pt")
        layout = (f"tp{parallel.tp} pp{parallel.pp} ep{parallel.ep} etp{parallel.etp_}"
                  + (f" vpp{parallel.vpp}" if parallel.vpp else ""))
        if args.hf_dir:
            ref = hf_logits(args.hf_dir, toks)
            diff = (logits - ref).abs().max().item()
            rel = ((logits - ref).norm() / ref.norm()).item()
            (args.out / "compare.json").write_text(json.dumps({"layout": layout, "max_abs": diff, "rel": rel}))
            ok = diff <= args.atol
            print(f"[verify] {layout}: logits vs HF max|diff| {diff:.3e} rel {rel:.3e} -> {'OK' if ok else 'MISMATCH'} "
                  f"(atol {args.atol:g})", flush=True)
            rc = 0 if ok else 1
        else:
            print(f"[verify] {layout}: logits {list(logits.shape)} written to {args.out / 'logits.pt'}", flush=True)
    from dsv3_rl.mcore import runtime

    torch.distributed.barrier()
    runtime.destroy()
    return rc


if __name__ == "__main__":
    sys.exit(main())
