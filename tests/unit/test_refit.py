"""Refit export bench (bench/bench_refit.py), verl's bucketing (dsv3_rl.refit.buckets) and the checksum
manifest (dsv3_rl.refit.manifest), on CPU. See docs/refit.md."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv3_rl.refit.buckets import fill_buckets
from dsv3_rl.refit.manifest import Manifest, ManifestMismatch, digest
from test_refit_fp8 import one_rank  # noqa: F401 (fixture: the one-rank gloo group verl's FP8 quantizer needs)

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "bench_refit.py"

# What the GPU box lacks: the bench must run with these unimportable (and verl's __init__ pulls in Ray).
_BLOCKED = ("ray", "vllm", "transformer_engine", "tensordict", "omegaconf", "zmq", "uvicorn", "fastapi")
_RUN_BLOCKED = f"""
import runpy, sys
for name in {_BLOCKED!r}:  # as if not installed: import raises ModuleNotFoundError, find_spec returns None
    sys.modules[name] = None
sys.argv = [{str(BENCH)!r}] + sys.argv[1:]
runpy.run_path({str(BENCH)!r}, run_name="__main__")
"""


def _tiny_hf_tensors(overrides: dict | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF checkpoint names, shapes and kinds of the tiny preset (what mini_model writes and the HF loaders read)."""
    from dsv3_rl.minimodel.mini_model import tensor_specs
    from dsv3_rl.models.presets import preset_kwargs

    return {s.name: (tuple(s.shape), s.kind) for s in tensor_specs(preset_kwargs("tiny", overrides))}


def _run_bench(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    from dsv3_rl.launch.run import TE_ATTENTION_ENV

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", *TE_ATTENTION_ENV)}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.run([sys.executable, "-c", _RUN_BLOCKED, "--device", "cpu", "--model", "tiny", *extra],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


def test_bench_cpu_smoke_without_ray(tmp_path):
    """The bench runs with Ray, vLLM, TE, tensordict, omegaconf and zmq unimportable (the GPU box), prints
    its line and writes the JSON; the export produced exactly transformers' tensor names for the model."""
    out = tmp_path / "refit.json"
    r = _run_bench(tmp_path, "--iters", "1", "--manifest", "--fp8", "--json", str(out))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("refit bench: ")]
    assert len(lines) == 1, r.stdout[-2000:]
    assert re.search(r"= [\d.]+ GB/s, [\d.]+x copy [\d.]+ GB/s; peak extra n/a \(CPU\); with manifest [\d.]+ GB/s; "
                     r"fp8 export [\d.]+ GB/s out, DeepSeek FP8 layout, quantize kernel [\d.]+ GB/s = [\d.]+x copy$", lines[0]), lines[0]
    res = json.loads(out.read_text())
    assert {"device", "preset", "params", "bucket_bytes", "copy_GBps", "export", "export_manifest", "export_fp8",
            "fp8_kernel", "verl_light_import"} <= set(res)
    assert res["verl_light_import"] is True
    for key in ("seconds", "tensors", "bytes", "buckets", "GBps", "peak_extra_bytes", "ratio_to_copy"):
        assert key in res["export"], key
    hf = _tiny_hf_tensors()
    assert res["export"]["tensors"] == len(hf)
    total = sum(torch.Size(s).numel() for s, _k in hf.values())
    # BF16 except the router's score-correction bias and (megatron's local spec) the norms, kept in FP32
    fp32 = sum(torch.Size(s).numel() for s, k in hf.values() if k in ("bias", "norm"))
    assert res["export"]["elements_by_dtype"] == {"bfloat16": total - fp32, "float32": fp32}
    assert res["export"]["bytes"] == sum(res["export"]["bytes_by_dtype"].values())
    assert res["export_manifest"]["tensors"] == len(hf)
    # verl's FP8 quantizer over the real export: DeepSeek's release layout (tests/unit/test_refit_fp8.py)
    assert res["export_fp8"]["fp8_layout_differences"] == 0, res["export_fp8"]["fp8_layout_first_differences"]
    assert res["export_fp8"]["tensors"] == len(hf) + sum(k == "linear" for _s, k in hf.values())


def test_bench_bad_input_is_one_error_line(tmp_path):
    r = _run_bench(tmp_path, "--set", "no_such_key=1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --model/--set: override 'no_such_key'"), r.stderr


@pytest.mark.parametrize("args, last", [
    (("--iters", "0"), "argument --iters: '0' is not an integer >= 1"),
    (("--bucket-mb", "0"), "argument --bucket-mb: '0' is not an integer >= 1"),  # was silently 64 MiB
    (("--kernel-shape", "0,4"), "argument --kernel-shape: '0,4' is not M,N (two integers >= 1)"),
    (("--set", "hidden_size=-4"), "error: --model/--set: model preset 'tiny' with overrides {'hidden_size': -4}: "
                                  "hidden_size = -4; expected an integer >= 1"),
])
def test_bench_refuses_bad_flags_by_name(tmp_path, args, last):
    """Issue 29: --iters 0 and --set hidden_size=-4 were 'unexpected ... (a bug)' (exit 1), --bucket-mb 0 became 64."""
    r = _run_bench(tmp_path, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(last), r.stderr
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr


# ------------------------------------------------------------------------------------- bucketing


def _stream(n: int = 14, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and odd sizes, so that alignment and bucket boundaries matter."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        dtype = (torch.bfloat16, torch.float32, torch.float8_e4m3fn)[i % 3]
        t = torch.randn(301 + 97 * i, 67, generator=g).to(dtype)
        out.append((f"model.layers.{i}.w", t))
    return out


def _verl_buckets(stream, bucket_mb: int) -> list[list[tuple[str, int]]]:
    """verl's own BucketedWeightSender, with a stand-in for its zmq socket: (name, offset) per bucket."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    class Socket:
        def __init__(self):
            self.sent = []

        def send_pyobj(self, obj):
            self.sent.append(obj)

        def recv(self):
            return b""

        def close(self):
            pass

    sender = BucketedWeightSender("ipc:///tmp/dsv3-refit-test-unused.sock", bucket_size_mb=bucket_mb, use_shm=True)
    sock = Socket()
    sender._init_socket = lambda: setattr(sender, "socket", sock)
    sender._init_buffer = lambda: setattr(sender, "buffer", torch.empty(sender.bucket_size, dtype=torch.uint8))
    asyncio.run(sender.async_send_weights(iter(stream)))
    return [[(n, m["offset"]) for n, m in msg["bucket_meta"].items()] for msg in sock.sent]


def _our_buckets(stream, bucket_bytes: int) -> list[list[tuple[str, int]]]:
    got = []
    fill_buckets(stream, torch.empty(bucket_bytes, dtype=torch.uint8),
                 lambda b, _buf: got.append([(n, o) for n, _s, _d, o in b.items]))
    return got


@pytest.fixture
def verl_cpu(monkeypatch):
    """verl's CPU platform for this test only (a process-wide singleton, as in test_verl_cpu_weight_sync.py)."""
    from verl.plugin.platform import platform_manager as pm
    from verl.plugin.platform.platform_cpu import PlatformCPU

    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.setattr(pm, "_current_platform", PlatformCPU())


def test_buckets_match_verl_sender(verl_cpu):
    stream = _stream()
    theirs = _verl_buckets(stream, 1)
    assert len(theirs) >= 3
    assert _our_buckets(stream, 1 << 20) == theirs


def test_buckets_comparison_bites(verl_cpu):
    """Planted faults: a packer without verl's alignment, or with a smaller bucket, and the comparison sees it."""
    stream = _stream()
    theirs = _verl_buckets(stream, 1)
    assert _our_buckets(stream, 3 << 18) != theirs
    unaligned = [(n, t.view(torch.uint8).reshape(-1)) for n, t in stream]  # every tensor 1-byte aligned
    assert [[n for n, _ in b] for b in _our_buckets(unaligned, 1 << 20)] == [[n for n, _ in b] for b in theirs]
    assert _our_buckets(unaligned, 1 << 20) != theirs  # same cuts, different offsets: caught


# --------------------------------------------------------------------------------------- manifest


WIDER = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128}  # ~8 MB: several 1 MiB buckets


def _hf_stream(seed: int = 0, overrides: dict | None = None) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's HF names and shapes, random BF16 values."""
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, (s, _k) in _tiny_hf_tensors(overrides).items()]


def _refit(stream, bucket_bytes: int, manifest: Manifest, receive=None) -> int:
    """Trainer: tap the manifest while bucketing; receiver: check every tensor of every bucket."""
    checked = []

    def on_bucket(bucket, buf):
        pairs = receive(bucket, buf) if receive else bucket.tensors(buf)
        for name, t in pairs:
            manifest.check(name, t)
            checked.append(name)

    fill_buckets(manifest.tap(stream), torch.empty(bucket_bytes, dtype=torch.uint8), on_bucket)
    return len(checked)


def test_manifest_clean_refit_passes():
    stream = _hf_stream()
    m = Manifest()
    assert _refit(stream, 64 << 10, m) == len(stream)
    assert Manifest.from_json(m.to_json()).verify(stream) == len(stream)


def test_manifest_catches_swapped_experts():
    """Planted fault: routed experts 0 and 1 of the first MoE layer trade weights on the way."""
    stream = _hf_stream()
    a, b = "model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.1.gate_proj.weight"
    m = Manifest()
    list(m.tap(stream))
    swapped = dict(stream)
    swapped[a], swapped[b] = swapped[b], swapped[a]
    with pytest.raises(ManifestMismatch, match=re.escape(repr(a)) + ".*digest"):
        m.verify(swapped.items())


def test_manifest_catches_stale_bucket():
    """Planted fault: after an update, the receiver reads bucket 1 as it was at the previous refit."""
    bucket_bytes = 64 << 10
    old = _hf_stream(seed=0)
    kept = {}
    _refit(old, bucket_bytes, Manifest(),
           receive=lambda b, buf: kept.setdefault(b.index, [(n, t.clone()) for n, t in b.tensors(buf)]))
    new = _hf_stream(seed=1)
    stale_names = [n for n, _ in kept[1]]
    with pytest.raises(ManifestMismatch, match=re.escape(repr(stale_names[0])) + ".*digest"):
        _refit(new, bucket_bytes, Manifest(), receive=lambda b, buf: kept[1] if b.index == 1 else b.tensors(buf))


def test_manifest_catches_missing_extra_and_shape():
    stream = _hf_stream()
    m = Manifest()
    list(m.tap(stream))
    with pytest.raises(ManifestMismatch, match="sent but not received, first 'model.embed_tokens.weight'"):
        m.verify(stream[1:])
    with pytest.raises(ManifestMismatch, match="'model.layers.9.x' is not in the trainer's manifest"):
        m.verify(stream + [("model.layers.9.x", torch.zeros(2))])
    name, t = stream[0]
    with pytest.raises(ManifestMismatch, match=re.escape(repr(name)) + " differs from what the trainer sent: shape"):
        m.check(name, t.reshape(-1))


def test_digest_is_position_sensitive_and_value_deterministic():
    x = torch.randn(64, 64).to(torch.bfloat16)
    assert digest(x) == digest(x.clone()) == digest(x.t().contiguous().t())  # same bytes in the same order
    assert digest(x) != digest(x.t().contiguous())  # same values, transposed
    y = x.clone()
    y.view(torch.int16)[3, 5] ^= 1  # one bit
    assert digest(x) != digest(y)
    big = torch.randn(3 << 20).to(torch.bfloat16)  # more than one chunk: chunks swapped must differ
    swapped = torch.cat([big[1 << 21:], big[: 1 << 21]])
    assert digest(big) != digest(swapped)
    assert digest(torch.ones(3, dtype=torch.uint8)) != digest(torch.ones(4, dtype=torch.uint8)[:3].clone() * 2)


def _reference_digest(t: torch.Tensor) -> str:
    """The documented formula, written out with numpy's wrapping uint64 arithmetic and explicit per-word weights
    (word i = c * CHUNK + p weighs perm[p] + c * CHUNK): the independent reference of ``digest``."""
    import numpy as np

    from dsv3_rl.refit import manifest as M

    words = t.contiguous().reshape(-1).view(torch.uint8)
    words = torch.cat([words, words.new_zeros((-words.numel()) % 4)]).view(torch.int32)
    perm = M._chunk_weights(torch.device("cpu")).numpy().astype(np.uint64)
    i = np.arange(words.numel(), dtype=np.uint64)
    w = perm[(i % M.CHUNK_WORDS).astype(np.int64)] + (i // M.CHUNK_WORDS) * np.uint64(M.CHUNK_WORDS)
    x = words.numpy().astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        return f"{int(x.sum(dtype=np.uint64)):016x}{int((x * w).sum(dtype=np.uint64)):016x}"


def test_digest_matches_the_documented_formula():
    from dsv3_rl.refit.manifest import CHUNK_WORDS

    for n in (1, 5, CHUNK_WORDS + 12345):
        x = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
        assert digest(x) == _reference_digest(x), n
    assert digest(torch.ones(3, dtype=torch.uint8)) == _reference_digest(torch.ones(3, dtype=torch.uint8))


def _old_chunk_weights(device) -> torch.Tensor:
    """The weights before issue 29: drawn WITH replacement, so ~250 positions per chunk share a weight."""
    from dsv3_rl.refit.manifest import CHUNK_WORDS

    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, 1 << 31, (CHUNK_WORDS,), generator=g, dtype=torch.int64).to(device)


def _missed_swaps(x: torch.Tensor, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs of (unequal) words whose swap leaves ``digest`` unchanged."""
    d0, missed = digest(x), []
    for i, j in pairs:
        assert x[i] != x[j]
        x[i], x[j] = x[j].clone(), x[i].clone()
        if digest(x) == d0:
            missed.append((i, j))
        x[i], x[j] = x[j].clone(), x[i].clone()
    assert digest(x) == d0
    return missed


def _swap_pairs(x: torch.Tensor) -> list[tuple[int, int]]:
    """Random pairs, pairs at positions whose old weights are equal, same offset in two chunks, sign-bit words."""
    from dsv3_rl.refit.manifest import CHUNK_WORDS

    g = torch.Generator().manual_seed(7)
    n = x.numel()
    pairs = [tuple(int(v) for v in torch.randint(0, n, (2,), generator=g)) for _ in range(60)]
    old = _old_chunk_weights("cpu")
    order = torch.argsort(old, stable=True)
    same = (old[order[1:]] == old[order[:-1]]).nonzero().flatten()[:40]
    pairs += [(int(order[k]), int(order[k + 1])) for k in same]
    pairs += [(p, CHUNK_WORDS + p) for p in (0, 17, 4095)]  # the same offset in chunk 0 and chunk 1
    x[5], x[CHUNK_WORDS + 5] = 0, -(1 << 31)  # words differing by 2**31 (the largest power of two a difference has)
    pairs.append((5, CHUNK_WORDS + 5))
    return [(i, j) for i, j in pairs if x[i] != x[j]]


def test_digest_sees_every_swap_of_two_unequal_words():
    """Issue 29: any two unequal words swapped change the digest (random pairs, and the pairs the old weights,
    drawn with replacement, weighed equally)."""
    from dsv3_rl.refit.manifest import CHUNK_WORDS

    x = torch.randint(-(1 << 31), (1 << 31) - 1, (CHUNK_WORDS + 50_000,), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(3))
    pairs = _swap_pairs(x)
    assert len(pairs) > 90
    assert _missed_swaps(x, pairs) == []


def test_digest_swap_test_bites_with_the_old_weights(monkeypatch):
    """Planted fault: the old per-position weights (drawn with replacement) miss the swaps at equal weights."""
    from dsv3_rl.refit import manifest as M

    monkeypatch.setattr(M, "_weights", {torch.device("cpu"): _old_chunk_weights("cpu")})
    x = torch.randint(-(1 << 31), (1 << 31) - 1, (M.CHUNK_WORDS + 50_000,), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(3))
    missed = _missed_swaps(x, _swap_pairs(x))
    assert len(missed) >= 30, missed


def test_manifest_names_a_tensor_recorded_twice_by_its_side():
    t = torch.ones(4)
    sent = Manifest()
    sent.add("w", t)
    with pytest.raises(ManifestMismatch, match="tensor 'w' exported twice in one refit"):
        sent.add("w", t)
    with pytest.raises(ManifestMismatch, match="tensor 'w' received twice in one refit"):
        sent.verify([("w", t), ("w", t)])
    got = Manifest(role="received")
    got.add("w", t)
    with pytest.raises(ManifestMismatch, match="received twice"):
        got.add("w", t)


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a JSON list; expected an object"),
    ('{"w": ["float32", [4], "abc"]}', "entry of tensor 'w' is .*32-hex-digit digest"),
    ('{"w": ["float32", [-1], "' + "0" * 32 + '"]}', "entry of tensor 'w'"),
    ('{"w": 3}', "entry of tensor 'w' is 3"),
])
def test_manifest_from_json_names_what_is_wrong(text, match):
    from dsv3_rl.refit.manifest import ManifestFormatError

    with pytest.raises(ManifestFormatError, match="^the refit manifest: " + match):
        Manifest.from_json(text)
    with pytest.raises(ManifestFormatError, match="^/x/m.json: "):
        Manifest.from_json(text, source="/x/m.json")
    m = Manifest()
    m.add("w", torch.ones(4))
    assert Manifest.from_json(m.to_json()).entries == m.entries


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("yes", True), ("ON", True), ("0", False),
                                       ("no", False), ("off", False), ("n", False)])
def test_manifest_switch_reads_yes_and_no_words(monkeypatch, value, on):
    from dsv3_rl.refit import manifest as M

    if value is None:
        monkeypatch.delenv(M.ENV, raising=False)
    else:
        monkeypatch.setenv(M.ENV, value)
    assert M.enabled() is on


@pytest.mark.parametrize("value", ["disable", "none", "nope", "2"])
def test_manifest_switch_refuses_an_unknown_word(monkeypatch, value):
    """Issue 29: DSV3_REFIT_MANIFEST=disable (or none) left the manifest on without a word."""
    from dsv3_rl.cliargs import UsageError
    from dsv3_rl.refit import manifest as M

    monkeypatch.setenv(M.ENV, value)
    with pytest.raises(UsageError, match=f"DSV3_REFIT_MANIFEST='{value}' is not a yes/no value"):
        M.enabled()


# ------------------------------------------- the manifest inside verl's weight sync (verl patch 0031)


def _sync(stream, bucket_mb: int, on_bucket) -> BaseException | None:
    """verl's BucketedWeightSender -> BucketedWeightReceiver over a real zmq socket and shared memory (the CPU
    demo's path), the receiver in a thread calling ON_BUCKET(index, weights) as vLLM's loader. Returns what the
    receiver raised."""
    import threading
    import uuid

    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import (
        BucketedWeightReceiver,
        BucketedWeightSender,
    )

    handle = f"ipc:///tmp/dsv3-refit-test-{uuid.uuid4().hex[:12]}.sock"
    sender = BucketedWeightSender(handle, bucket_size_mb=bucket_mb, use_shm=True)
    receiver = BucketedWeightReceiver(handle, torch.device("cpu"), use_shm=True)
    index = [0]
    error: list[BaseException] = []

    def load(weights, _is_last):
        on_bucket(index[0], weights)
        index[0] += 1

    def receive():
        try:
            receiver.receive_weights(on_bucket_received=load)
        except BaseException as e:  # noqa: BLE001 (whatever the receiver thread raises is the test's result)
            error.append(e)

    t = threading.Thread(target=receive, daemon=True)  # a sender that fails leaves it waiting: not the process
    t.start()
    asyncio.run(sender.async_send_weights(iter(stream)))
    t.join(timeout=120)
    assert not t.is_alive(), "receiver hung"
    return error[0] if error else None


def test_weight_sync_manifest_clean_passes(verl_cpu):
    stream = _hf_stream()
    loaded = {}
    err = _sync(stream, 1, lambda _i, ws: loaded.update((n, t.clone()) for n, t in ws))
    assert err is None, err
    assert loaded.keys() == dict(stream).keys()
    assert all(torch.equal(loaded[n], t) for n, t in stream)


def test_weight_sync_manifest_catches_loader_swapping_experts(verl_cpu):
    """Planted fault: a loader that swaps two experts' weights in place in the bucket it was handed."""
    a, b = "model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.1.gate_proj.weight"

    def swap(_i, ws):
        d = dict(ws)
        if a in d and b in d:
            tmp = d[a].clone()
            d[a].copy_(d[b])
            d[b].copy_(tmp)

    err = _sync(_hf_stream(), 1, swap)
    assert isinstance(err, ManifestMismatch), err
    assert repr(a) in str(err) and "digest" in str(err)


def test_weight_sync_manifest_catches_stale_bucket(verl_cpu, monkeypatch):
    """Planted fault: the receiver ends up with bucket 1 of the previous refit. With DSV3_REFIT_MANIFEST=0 (the
    check off, as before patch 0031) the same fault goes through unnoticed."""
    old, new = _hf_stream(seed=0, overrides=WIDER), _hf_stream(seed=1, overrides=WIDER)
    kept = {}
    assert _sync(old, 1, lambda i, ws: kept.setdefault(i, [(n, t.clone()) for n, t in ws])) is None
    assert len(kept) >= 3

    def stale(i, ws):
        if i == 1:
            for (_n, t), (_m, prev) in zip(ws, kept[1], strict=True):
                t.copy_(prev)

    err = _sync(new, 1, stale)
    assert isinstance(err, ManifestMismatch), err
    assert repr(kept[1][0][0]) in str(err)
    monkeypatch.setenv("DSV3_REFIT_MANIFEST", "0")
    assert _sync(new, 1, stale) is None


# FP8 rollout (rollout.quantization=fp8): the trainer sends BF16, vLLM's worker quantizes each received weight into
# float8_e4m3fn + <name>_scale_inv (verl's load_quanted_weights) and hands those to its loader. The checksum covers
# them too (patch 0031: dsv3_rl.refit.manifest.LoaderFeed).


def _fp8_engine(fp8_names, stream, fault=None):
    """A stand-in for vLLM's model with FP8 rollout: each weight DeepSeek's FP8 release keeps in FP8 (FP8_NAMES) is
    a vLLM LinearBase with an FP8 ``weight`` and an FP32 ``weight_scale_inv`` (what verl's quantizer selects by),
    the rest plain parameters. ``load_weights`` takes the stream verl hands it, applies FAULT(name, tensor) to each
    tensor first (a loader that alters what it is handed) and copies it into the parameter."""
    from vllm.model_executor.layers.linear import LinearBase

    from dsv3_rl.refit.fp8_layout import scale_shape

    class Fp8Linear(LinearBase):
        def __init__(self, shape):
            torch.nn.Module.__init__(self)
            self.weight = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.weight_scale_inv = torch.nn.Parameter(torch.zeros(scale_shape(shape)), requires_grad=False)

    class Engine(torch.nn.Module):
        packed_modules_mapping: dict = {}

        def load_weights(self, weights):
            params, got = dict(self.named_parameters()), []
            for name, t in weights:
                if fault is not None:
                    fault(name, t)
                params[name].copy_(t)
                got.append((name, t.clone()))
            self.handed.extend(got)
            return {n for n, _ in got}

    root = Engine()
    root.handed = []
    for name, t in stream:
        *path, leaf = name.split(".")
        m = root
        for i, part in enumerate(path):
            if part not in m._modules:
                last = i == len(path) - 1
                m.add_module(part, Fp8Linear(t.shape) if last and name in fp8_names else torch.nn.Module())
            m = m._modules[part]
        if name not in fp8_names:
            m.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    return root


def _fp8_sync(stream, fault=None, drafter_fault=None):
    """verl's sender -> receiver (_sync) with verl's vLLM worker extension as the loader (_update_weights, the FP8
    branch: load_quanted_weights for the model and for an MTP drafter). Returns (error, model, drafter)."""
    from types import SimpleNamespace

    from test_refit_fp8 import CFG
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from dsv3_rl.refit.fp8_layout import reference_layout
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    fp8_names = {n for n, (d, _s) in reference_layout(CFG).items() if d == "F8_E4M3"}
    model, drafter = _fp8_engine(fp8_names, stream, fault), _fp8_engine(fp8_names, stream, drafter_fault)
    worker = object.__new__(vLLMColocateWorkerExtension)  # the extension's methods, without a vLLM worker
    worker.model_runner = SimpleNamespace(model=model, drafter=SimpleNamespace(model=drafter), vllm_config=SimpleNamespace(
        quant_config=Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                               weight_block_size=[128, 128]),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
        speculative_config=SimpleNamespace(method="mtp", draft_model_config=None)))
    # 2 MiB buckets: the embedding (1.3 MB) fits, the 12 MB stream takes several
    err = _sync(stream, 2, lambda _i, ws: worker._update_weights(ws, peft_config=None, base_sync_done=False))
    return err, model, drafter


FP8_SCALE = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"
FP8_WEIGHT = "model.layers.1.mlp.experts.3.down_proj.weight"


def _double_last_scale_block(name, t):
    if name == FP8_SCALE:
        t[-1, -1] *= 2


@pytest.mark.usefixtures("verl_cpu", "one_rank")
def test_weight_sync_manifest_fp8_clean_passes():
    """Clean FP8 sync: passes; what vLLM's loader took has DeepSeek's FP8 release layout and dequantizes (our FP8
    cast) to within FP8 rounding of the BF16 the trainer sent; the model and the MTP drafter got the same."""
    from test_refit_fp8 import CFG, _bf16_export

    from dsv3_rl.refit.fp8_layout import dequant_errors, layout_differences, reference_layout, stream_layout

    stream = _bf16_export()
    assert len(stream) > 20
    err, model, drafter = _fp8_sync(stream)
    assert err is None, err
    assert layout_differences(reference_layout(CFG), stream_layout(model.handed)) == []
    assert dequant_errors(model.handed, dict(stream), limit=0) == []
    loaded = dict(model.named_parameters())
    assert torch.equal(loaded[FP8_SCALE], dict(model.handed)[FP8_SCALE])
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for (_n, a), (_m, b) in zip(model.handed, drafter.handed, strict=True))


@pytest.mark.usefixtures("verl_cpu", "one_rank")
def test_weight_sync_manifest_fp8_catches_altered_scale_block():
    """Planted fault: the loader alters one 128 x 128 block's scale of the FP8 weight it is handed (so the engine
    holds it). With the tap where it was before (the BF16 the worker received, before its quantizer) it goes
    through unnoticed."""
    from test_refit_fp8 import _bf16_export

    from dsv3_rl.refit import manifest as M

    stream = _bf16_export()
    err, model, _d = _fp8_sync(stream, fault=_double_last_scale_block)
    assert isinstance(err, ManifestMismatch), err
    assert str(err).startswith(f"tensor {FP8_SCALE!r} differs after the load from what the rollout worker's "
                               f"quantizer handed vLLM's loader: digest "), err
    clean_err, clean, _d = _fp8_sync(stream)
    assert clean_err is None
    assert not torch.equal(dict(model.named_parameters())[FP8_SCALE], dict(clean.named_parameters())[FP8_SCALE])

    untapped = pytest.MonkeyPatch()
    untapped.setattr(M, "tap_loader_feed", lambda stream, _received, _scope="model": stream)
    try:
        assert _fp8_sync(stream, fault=_double_last_scale_block)[0] is None
    finally:
        untapped.undo()


@pytest.mark.usefixtures("verl_cpu", "one_rank")
def test_weight_sync_manifest_fp8_catches_flipped_weight_byte():
    """Planted fault: one byte of an FP8 expert weight flipped by the loader, in the model and (separately) in the
    MTP drafter's load; each fails naming the weight (and the drafter)."""
    from test_refit_fp8 import _bf16_export

    def flip(name, t):
        if name == FP8_WEIGHT:
            assert t.dtype == torch.float8_e4m3fn
            t.view(torch.uint8)[0, 0] ^= 0x01

    stream = _bf16_export()
    err = _fp8_sync(stream, fault=flip)[0]
    assert isinstance(err, ManifestMismatch), err
    assert str(err).startswith(f"tensor {FP8_WEIGHT!r} differs after the load from what the rollout worker's "
                               f"quantizer handed vLLM's loader: digest "), err
    err = _fp8_sync(stream, drafter_fault=flip)[0]
    assert isinstance(err, ManifestMismatch), err
    assert f"tensor {FP8_WEIGHT!r} differs after the load from what the rollout worker's quantizer handed the MTP " \
           f"drafter's loader" in str(err), err


def test_export_at_one_pipeline_stage_makes_no_per_tensor_collectives(monkeypatch):
    """verl patch 0032: with PP=1 the export hands each tensor and name through unchanged instead of an object
    all-gather + broadcast per tensor (on one H100 they were ~90% of the export time: 47 -> 444 GB/s)."""
    import torch.distributed as dist

    from dsv3_rl.correctness.assemble import single_process_megatron
    from dsv3_rl.refit.verl_export import import_module

    mu = import_module("verl.utils.megatron_utils")
    with single_process_megatron():
        calls = []
        for fn in ("all_gather_object", "broadcast", "broadcast_object_list"):
            monkeypatch.setattr(dist, fn, lambda *a, _fn=fn, **k: calls.append(_fn))
        t = torch.ones(3)
        assert mu.broadcast_from_megatron_pp(t) is t
        assert mu.broadcast_str_from_megatron_pp("decoder.layers.0.mlp.router.weight") == "decoder.layers.0.mlp.router.weight"
        assert calls == []  # with the patch reverted: all_gather_object + broadcast per call


def _tp1_export_storage(monkeypatch, cat_always_copies: bool) -> tuple[int, int]:
    """Export the tiny model at TP1 in this process through verl's per_tensor_generator; returns how many exported
    tensors share storage with a model parameter, and how many were exported."""
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.correctness.assemble import single_process_megatron
    from dsv3_rl.mcore import runtime
    from dsv3_rl.models import presets
    from dsv3_rl.refit import verl_export

    monkeypatch.setenv("VERL_PLATFORM", "cpu")  # verl's device helpers: cpu, as the bench sets it on CPU
    monkeypatch.syspath_prepend(str(BENCH.parent))
    import bench_refit

    v = verl_export.load()  # the real verl package, as the rest of this process imports it
    mu = verl_export.import_module("verl.utils.megatron_utils")
    if cat_always_copies:  # planted fault: verl 0.9.1's torch.cat of a one-element list (a full copy)
        monkeypatch.setattr(mu, "_cat", lambda tensors, dim: torch.cat(tensors, dim=dim))
    hf = presets.hf_config("tiny", {})
    with single_process_megatron():
        chunks = runtime.build_model(hf, Parallel(), dtype=torch.bfloat16)
        storages = {p.untyped_storage().data_ptr() for p in chunks[0].parameters()}
        exported = list(bench_refit.export_stream(v, hf, chunks, fp8=False))
        shared = sum(t.untyped_storage().data_ptr() in storages for _, t in exported)
    return shared, len(exported)


def test_export_at_tp1_copies_no_weight(monkeypatch):
    """verl patch 0033: with one TP/ETP shard every exported tensor is a view of the model's parameter (or buffer),
    so the bucket fill is the export's only copy (one H100, proxy: 444 -> ~700-970 GB/s, 0.30x -> 0.5-0.66x copy)."""
    shared, n = _tp1_export_storage(monkeypatch, cat_always_copies=False)
    assert n > 100 and shared >= n - 8, (shared, n)  # the expert_bias buffers come from state_dict() copies


def test_export_at_tp1_copies_no_weight_twin(monkeypatch):
    """Twin: torch.cat of a single shard (verl 0.9.1) copies every TP-sharded weight; the check sees it."""
    shared, n = _tp1_export_storage(monkeypatch, cat_always_copies=True)
    assert shared < n // 2, (shared, n)
