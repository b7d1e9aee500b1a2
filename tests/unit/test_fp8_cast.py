"""The FP8 -> BF16 checkpoint cast (dsv3_rl.checkpoint.fp8): bit-exact, resumable, clear errors."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsv3_rl import errors
from dsv3_rl.checkpoint import fp8
from dsv3_rl.checkpoint.fp8 import CheckpointError, cast_checkpoint, quantize_checkpoint
from dsv3_rl.checkpoint.fp8_kernels import dequant_reference
from dsv3_rl.checkpoint.safetensors_io import read_header, write_tensors
from dsv3_rl.minimodel.mini_model import write_mini_model

REPO = Path(__file__).resolve().parents[2]
# tiny-vllm with widths that are not multiples of 128 on both axes (kv_a_proj 576x160, dense 300x160,
# o_proj 160x128, q_b_proj 384x64), 1 dense + 1 MoE layer + the MTP layer, in 4 release-style shards.
OVERRIDES = {"num_hidden_layers": 2, "hidden_size": 160, "intermediate_size": 300}
QUIET = dict(progress=False, log=lambda *_: None)


def digests(d: Path, pattern: str = "*.safetensors") -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob(pattern))}


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def cast_mismatches(src: Path, dst: Path, drop_mtp: bool = True) -> list[str]:
    """Every problem with DST as the cast of SRC, checked with the safetensors library (not our reader)."""
    ins, outs = load_dir(src), load_dir(dst)
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    want = {n for n in ins if not n.endswith("_scale_inv")}
    if drop_mtp:
        want = {n for n in want if not n.startswith(f"model.layers.{n_layers}.")}
    problems = [f"missing {n}" for n in sorted(want - set(outs))] + [f"extra {n}" for n in sorted(set(outs) - want)]
    for n in sorted(want & set(outs)):
        w = ins[n]
        ref = dequant_reference(w, ins[n + "_scale_inv"]) if w.dtype == torch.float8_e4m3fn else w
        got = outs[n]
        if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(
                got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)):
            problems.append(f"value {n}")
    index = json.loads((dst / fp8.INDEX).read_text())
    on_disk = {n: f.name for f in dst.glob("*.safetensors") for n in read_header(f).tensors}
    if index["weight_map"] != on_disk:
        problems.append("index weight_map != shard contents")
    if index["metadata"]["total_size"] != sum(t.numel() * t.element_size() for t in outs.values()):
        problems.append("index total_size")
    return problems


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_mini_model("tiny-vllm", tmp_path_factory.mktemp("fp8") / "release", fmt="fp8-release",
                           overrides=OVERRIDES)


@pytest.fixture(scope="module")
def cast_dir(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "out"
    summary = cast_checkpoint(src, out, workers=2, chunk_mb=1, **QUIET)
    assert summary.shards_skipped == 0 and summary.dropped > 0
    return out


@pytest.fixture
def src_copy(src, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(src, d)
    return d


# ------------------------------------------------------------------------------- correctness


def test_source_has_the_hard_cases(src):
    hdr = {n: i for f in src.glob("*.safetensors") for n, i in read_header(f).tensors.items()}
    assert hdr["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 160)
    assert hdr["model.layers.0.mlp.down_proj.weight"].shape == (160, 300)
    assert "model.layers.2.eh_proj.weight" in hdr  # MTP layer
    assert len(list(src.glob("*.safetensors"))) == 4


def test_cast_is_bit_exact(src, cast_dir):
    assert cast_mismatches(src, cast_dir) == []


def test_bit_exact_check_catches_a_flipped_byte(src, cast_dir, tmp_path):
    """Planted fault: one changed byte in one output tensor must fail the check above."""
    bad = tmp_path / "bad"
    shutil.copytree(cast_dir, bad)
    shard = bad / json.loads((bad / fp8.INDEX).read_text())["weight_map"]["model.layers.1.mlp.experts.3.up_proj.weight"]
    info = read_header(shard).tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    data = bytearray(shard.read_bytes())
    data[info.begin + 101] ^= 0x01
    shard.write_bytes(bytes(data))
    assert cast_mismatches(src, bad) == ["value model.layers.1.mlp.experts.3.up_proj.weight"]


def test_output_checkpoint(src, cast_dir):
    cfg = json.loads((cast_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_nextn_predict_layers"] == 0
    assert cfg["topk_method"] == "noaux_tc"
    index = json.loads((cast_dir / fp8.INDEX).read_text())["weight_map"]
    assert not any(n.endswith("_scale_inv") or n.startswith("model.layers.2.") for n in index)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        assert (cast_dir / f).read_bytes() == (src / f).read_bytes(), f
    assert not list(cast_dir.glob("*.tmp-*"))
    manifest = json.loads((cast_dir / fp8.MANIFEST).read_text())
    assert manifest["complete"] and set(manifest["shards"]) == set(index.values())
    for name, rec in manifest["shards"].items():
        assert rec["sha256"] == hashlib.sha256((cast_dir / name).read_bytes()).hexdigest()


def test_cast_loads_in_transformers(cast_dir):
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(cast_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.isfinite(model(torch.tensor([[0, 7, 11]])).logits).all()


def test_keep_mtp(src, tmp_path):
    out = tmp_path / "mtp"
    cast_checkpoint(src, out, drop_mtp=False, **QUIET)
    assert cast_mismatches(src, out, drop_mtp=False) == []
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_single_worker_and_chunking_give_the_same_bytes(src, cast_dir, tmp_path):
    out = tmp_path / "w1"
    cast_checkpoint(src, out, workers=1, chunk_mb=64, **QUIET)
    assert digests(out) == digests(cast_dir)


# ------------------------------------------------------------------------------------ resume


def test_interrupted_cast_resumes(src, cast_dir, tmp_path, monkeypatch):
    out = tmp_path / "resume"
    shards = [s.name for s in fp8.plan_cast(src, out).shards]
    assert len(shards) >= 2
    real_run = fp8._Worker.run

    def dies_on_second(self, shard):
        if shard.name == shards[1]:
            raise KeyboardInterrupt
        return real_run(self, shard)

    monkeypatch.setattr(fp8._Worker, "run", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        cast_checkpoint(src, out, workers=1, **QUIET)
    manifest = json.loads((out / fp8.MANIFEST).read_text())
    assert list(manifest["shards"]) == [shards[0]] and not manifest["complete"]
    assert not (out / fp8.INDEX).exists() and not (out / "config.json").exists()
    assert not list(out.glob("*.tmp-*"))
    (out / f"{shards[1]}.tmp-99999").write_bytes(b"half a shard from a killed run")

    monkeypatch.setattr(fp8._Worker, "run", real_run)
    summary = cast_checkpoint(src, out, **QUIET)
    assert summary.shards_skipped == 1
    assert digests(out) == digests(cast_dir)
    assert not list(out.glob("*.tmp-*"))
    assert cast_mismatches(src, out) == []
    # a finished run reruns as a no-op
    assert cast_checkpoint(src, out, **QUIET).shards_skipped == len(shards)


def test_verify_existing_redoes_a_tampered_shard(src, cast_dir, tmp_path):
    out = tmp_path / "tamper"
    shutil.copytree(cast_dir, out)
    victim = sorted(out.glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size: the default size check cannot see it
    victim.write_bytes(bytes(data))
    assert cast_checkpoint(src, out, **QUIET).shards_skipped == len(digests(cast_dir))
    summary = cast_checkpoint(src, out, verify_existing=True, **QUIET)
    assert summary.shards_skipped == len(digests(cast_dir)) - 1
    assert digests(out) == digests(cast_dir)


def test_changed_source_shard_is_redone(src_copy, tmp_path):
    out = tmp_path / "o"
    cast_checkpoint(src_copy, out, **QUIET)
    first = sorted(src_copy.glob("*.safetensors"))[0]
    os.utime(first, ns=(1, 1))
    assert cast_checkpoint(src_copy, out, **QUIET).shards_skipped == len(digests(out)) - 1


def test_other_options_in_the_same_output_dir_are_refused(src, cast_dir, tmp_path):
    out = tmp_path / "opts"
    shutil.copytree(cast_dir, out)
    with pytest.raises(CheckpointError, match="drop_mtp.*Use the same options, an empty dir, or --force"):
        cast_checkpoint(src, out, drop_mtp=False, **QUIET)
    cast_checkpoint(src, out, drop_mtp=False, overwrite=True, **QUIET)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


# -------------------------------------------------------------------------------- bad inputs


def expect_error(src_dir, out, match, **kw):
    with pytest.raises(CheckpointError, match=match):
        cast_checkpoint(src_dir, out, **QUIET, **kw)
    assert not out.exists() or not any(out.iterdir()), "a failed cast must not write output"


def rewrite_shard(d: Path, tensor: str, edit) -> Path:
    """Apply EDIT(dict of tensors) to the shard holding TENSOR, keeping the index in sync."""
    index_path = d / fp8.INDEX
    index = json.loads(index_path.read_text())
    shard = d / index["weight_map"][tensor]
    tensors = load_file(shard)
    edit(tensors)
    write_tensors(shard, tensors)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard.name or n in tensors}
    index["weight_map"].update({n: shard.name for n in tensors})
    index_path.write_text(json.dumps(index))
    return shard


def test_not_an_fp8_checkpoint(tmp_path):
    bf16 = write_mini_model("tiny", tmp_path / "bf16", overrides={"num_hidden_layers": 2})
    expect_error(bf16, tmp_path / "o", r"is not an FP8 checkpoint: none of its \d+ tensors .*\(dtypes: BF16, F32\)"
                                       r".*skip this step.*dsv3_rl.checkpoint.hf_config")


def test_fp8_tensor_without_scale(src_copy, tmp_path):
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    rewrite_shard(src_copy, name, lambda t: t.pop(name + "_scale_inv"))
    expect_error(src_copy, tmp_path / "o", f"FP8 tensor '{name}' has no scale: '{name}_scale_inv' is missing")


def _requantize(name: str):
    """An edit for rewrite_shard: NAME (BF16 in the release) stored as FP8 with its scale_inv, as a re-quantized
    DeepSeek-V3 variant ships it."""
    from dsv3_rl.checkpoint.fp8_kernels import quantize

    def edit(t):
        t[name], t[name + "_scale_inv"] = quantize(t[name].float(), "amax")
    return edit


@pytest.mark.parametrize("name", ["model.layers.2.eh_proj.weight", "model.embed_tokens.weight"])
def test_fp8_weight_with_scale_is_dequantized_whatever_its_name(src_copy, tmp_path, name):
    """Issue 29: every FP8 weight with its weight_scale_inv is dequantized, as DeepSeek's fp8_cast_bf16.py does
    (the MTP layer's eh_proj, FP8 in a re-quantized variant, was refused: 'allowed for it: BF16, F16, F32')."""
    rewrite_shard(src_copy, name, _requantize(name))
    assert load_dir(src_copy)[name].dtype == torch.float8_e4m3fn
    out = tmp_path / "keep"
    cast_checkpoint(src_copy, out, drop_mtp=False, **QUIET)
    assert cast_mismatches(src_copy, out, drop_mtp=False) == []
    got, ins = load_dir(out)[name], load_dir(src_copy)
    assert got.dtype == torch.bfloat16 and torch.equal(got, dequant_reference(ins[name], ins[name + "_scale_inv"]))
    cast_checkpoint(src_copy, tmp_path / "drop", **QUIET)  # the default drops the MTP layer: never refused
    assert cast_mismatches(src_copy, tmp_path / "drop") == []


def test_fp8_weight_without_scale_is_refused_whatever_its_name(src_copy, tmp_path):
    """Twin: the same FP8 eh_proj without its scale is refused by name (nothing to dequantize it with)."""
    name = "model.layers.2.eh_proj.weight"

    def edit(t):
        _requantize(name)(t)
        del t[name + "_scale_inv"]
    rewrite_shard(src_copy, name, edit)
    expect_error(src_copy, tmp_path / "o", f"FP8 tensor '{name}' has no scale: '{name}_scale_inv' is missing")


def test_scale_with_wrong_shape(src_copy, tmp_path):
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    rewrite_shard(src_copy, name, lambda t: t.update({name + "_scale_inv": torch.ones(4, 2)}))
    expect_error(src_copy, tmp_path / "o", rf"scale '{name}_scale_inv' \(model-\d+-of-\d+\.safetensors\) has shape "
                                           rf"\[4, 2\]; expected \[5, 2\] .* shape \[576, 160\]")


def test_orphan_scale(src_copy, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    rewrite_shard(src_copy, name, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    expect_error(src_copy, tmp_path / "o", f"scale '{name}_scale_inv' .* has no FP8 weight")


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:-1000], "truncated: the header describes"),
    (lambda b: b[:6], "truncated or not a safetensors file"),
    (lambda b: b[:8] + b"\x00not json" + b[17:], "corrupt header"),
    (lambda b: b + b"junk", r"corrupt \(trailing bytes\)"),
])
def test_truncated_or_corrupt_shard(src_copy, tmp_path, damage, match):
    shard = sorted(src_copy.glob("*.safetensors"))[1]
    shard.write_bytes(damage(shard.read_bytes()))
    expect_error(src_copy, tmp_path / "o", f"{shard.name}: {match}")


def test_index_lists_a_missing_file(src_copy, tmp_path):
    shard = sorted(src_copy.glob("*.safetensors"))[2]
    shard.unlink()
    expect_error(src_copy, tmp_path / "o", rf"lists shard '{shard.name}' \(\d+ tensors, e.g. .*does not exist")


def test_index_lists_a_tensor_the_shard_lacks(src_copy, tmp_path):
    index = json.loads((src_copy / fp8.INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.0.ghost.weight"] = first
    (src_copy / fp8.INDEX).write_text(json.dumps(index))
    expect_error(src_copy, tmp_path / "o", f"lists tensor 'model.layers.0.ghost.weight' in {first}")


def test_output_dir_is_the_input_dir(src_copy, tmp_path):
    before = digests(src_copy)
    with pytest.raises(CheckpointError, match="is the input dir"):
        cast_checkpoint(src_copy, src_copy, **QUIET)
    link = tmp_path / "link"
    link.symlink_to(src_copy)
    with pytest.raises(CheckpointError, match="is the input dir"):
        cast_checkpoint(src_copy, link, **QUIET)
    assert digests(src_copy) == before and not list(src_copy.glob(fp8.MANIFEST))


def test_not_enough_disk_space(src, tmp_path, monkeypatch):
    monkeypatch.setattr(errors, "free_bytes", lambda path: 5_000_000)
    expect_error(src, tmp_path / "o", r"not enough disk space for 2 shards to write: need \d+\.\d+ GB, "
                                      r"0\.01 GB free")
    cast_checkpoint(src, tmp_path / "o", skip_space_check=True, **QUIET)


def test_output_dir_with_foreign_files(src, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's")
    with pytest.raises(CheckpointError, match="is not empty .*'model.safetensors'.* not an output of this tool"):
        cast_checkpoint(src, out, **QUIET)


def test_missing_config_and_empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    expect_error(tmp_path / "empty", tmp_path / "o", "config.json not found")
    expect_error(tmp_path / "nope", tmp_path / "o", "does not exist")


def test_non_deepseek_config_refused(src_copy, tmp_path):
    cfg = json.loads((src_copy / "config.json").read_text())
    cfg.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    (src_copy / "config.json").write_text(json.dumps(cfg))
    expect_error(src_copy, tmp_path / "o", "not a DeepSeek-V3-family config")


# ------------------------------------------------------------------------- inverse, CLI, wrapper


def test_quantize_round_trip(tmp_path):
    """BF16 -> FP8 (pow2) -> BF16 -> FP8 -> BF16: the second cast reproduces the first exactly."""
    bf16 = write_mini_model("tiny-vllm", tmp_path / "bf16", overrides=OVERRIDES)
    quantize_checkpoint(bf16, tmp_path / "f1", **QUIET)
    cfg = json.loads((tmp_path / "f1" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    f1 = load_dir(tmp_path / "f1")
    assert f1["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert f1["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # router stays BF16
    cast_checkpoint(tmp_path / "f1", tmp_path / "b1", **QUIET)
    assert cast_mismatches(tmp_path / "f1", tmp_path / "b1") == []
    quantize_checkpoint(tmp_path / "b1", tmp_path / "f2", **QUIET)
    cast_checkpoint(tmp_path / "f2", tmp_path / "b2", **QUIET)
    assert digests(tmp_path / "b2") == digests(tmp_path / "b1")
    f2 = load_dir(tmp_path / "f2")
    assert all(torch.equal(f2[n].view(torch.uint8), f1[n].view(torch.uint8)) for n in f1 if f1[n].dtype.itemsize == 1)
    with pytest.raises(CheckpointError, match="already FP8"):
        quantize_checkpoint(tmp_path / "f1", tmp_path / "f3", **QUIET)


def test_cli_seed_flags_and_errors(src, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = fp8.main(["--input-fp8-hf-path", str(src), "--output-bf16-hf-path", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "config: num_nextn_predict_layers: 1 -> 0" in printed
    n = len(fp8.plan_cast(src, out).shards)
    assert f"fp8_to_bf16: {n} shards (0 already done)" in printed
    assert "GB/s in" in printed
    assert fp8.main(["cast", str(src), str(src), "--no-progress"]) == 2
    assert "is the input dir" in capsys.readouterr().err


def test_seed_compatible_script(src, tmp_path):
    out = tmp_path / "seed"
    script = REPO / "toolkits" / "model_checkpoints_convertor" / "deepseek" / "fp8_cast_bf16.py"
    r = subprocess.run([sys.executable, str(script), "--input-fp8-hf-path", str(src), "--output-bf16-hf-path",
                        str(out), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "GB/s" in r.stdout
    assert cast_mismatches(src, out) == []
    r = subprocess.run([sys.executable, str(script), "--input-fp8-hf-path", str(tmp_path / "nope"),
                        "--output-bf16-hf-path", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "does not exist" in r.stderr
