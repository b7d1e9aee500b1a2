"""FP8 rollout weights in DeepSeek's own format: the expected layout, the layout of an export, and the
dequantization check.

* ``reference_layout(config)``: name -> (safetensors dtype, shape) of DeepSeek's FP8 release for a
  DeepSeek-V3 config, expanded from the header-level description in
  tests/assets/deepseek_v3_fp8_layout/layout.json (patterns over layers and experts, shapes as expressions
  over config keys, scale shapes ``[ceil(out/128), ceil(in/128)]``).
* ``stream_layout(pairs)``: the same for a ``(name, tensor)`` stream (what verl hands to vLLM).
* ``layout_differences(expected, got)``: one line per tensor that is missing, extra, or has another dtype or
  shape, naming it.
* ``dequant_errors(pairs, originals)``: dequantizes every FP8 weight with its ``_scale_inv`` using our FP8
  cast (dsv3_rl.checkpoint.fp8_kernels) and returns the tensors whose values are not within FP8 rounding of
  the BF16 originals (bound below).

FP8 rounding bound: e4m3 keeps 3 mantissa bits, so a value that lands in e4m3's normal range is rounded
with a relative error of at most 2**-4 (half a unit in the last place); the subnormal spacing is 2**-9 in
scaled units, so an absolute error of up to 2**-10 * scale_inv; the BF16 output of the dequantization adds
up to 2**-9 relative. Bound per element: ``|deq - x| <= |x| * (2**-4 + 2**-8) + scale_inv * 2**-9``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch

from dsv3_rl.errors import Dsv3Error

ASSET = Path(__file__).resolve().parents[2] / "tests" / "assets" / "deepseek_v3_fp8_layout" / "layout.json"
SCALE_SUFFIX = "_scale_inv"
BLOCK = 128
ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3"}

Layout = dict[str, tuple[str, tuple[int, ...]]]


class LayoutError(Dsv3Error, ValueError):
    pass


def load_description(path: Path = ASSET) -> dict:
    return json.loads(Path(path).read_text())


def shape_of(exprs: list[str], config: dict) -> tuple[int, ...]:
    """Evaluate shape expressions such as ``"num_attention_heads * v_head_dim"`` over CONFIG's keys."""
    out = []
    for e in exprs:
        try:
            out.append(int(eval(e, {"__builtins__": {}}, dict(config))))  # noqa: S307 (our own asset, config values)
        except NameError as err:
            raise LayoutError(f"layout expression {e!r}: config has no key {err.name!r}") from None
    return tuple(out)


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, int]:
    return (math.ceil(shape[0] / block), math.ceil(shape[1] / block))


def _layers(kind: str | None, config: dict) -> list[int | None]:
    n, mtp = config["num_hidden_layers"], config.get("num_nextn_predict_layers") or 0
    dense = config["first_k_dense_replace"]
    return {None: [None], "all": list(range(n + mtp)), "dense": list(range(min(dense, n))),
            "moe": list(range(dense, n + mtp)), "mtp": list(range(n, n + mtp))}[kind]


def reference_layout(config: dict, description: dict | None = None) -> Layout:
    """DeepSeek's FP8 release layout for CONFIG (a config.json dict); MTP layers per num_nextn_predict_layers."""
    d = description or load_description()
    out: Layout = {}
    for t in d["tensors"]:
        shape = shape_of(t["shape"], config)
        experts = range(config["n_routed_experts"]) if "{E}" in t["name"] else [None]
        for layer in _layers(t["layers"], config):
            for e in experts:
                name = t["name"].replace("{L}", str(layer)).replace("{E}", str(e))
                out[name] = (t["dtype"], shape)
                if t["dtype"] == "F8_E4M3":
                    out[name + d["scale_suffix"]] = (d["scale_dtype"], scale_shape(shape))
    return out


def stream_layout(pairs: Iterable[tuple[str, torch.Tensor]]) -> Layout:
    out: Layout = {}
    for name, t in pairs:
        out[name] = (ST_DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape))
    return out


_FLOAT = {"BF16", "F16", "F32"}


def layout_differences(expected: Layout, got: Layout, limit: int = 20, float_equivalent: bool = False) -> list[str]:
    """FLOAT_EQUIVALENT: a tensor the release keeps in BF16/F32 may come in any of BF16/F16/F32 (vLLM casts
    those at load; megatron's local spec keeps norms in FP32); FP8 weights and their scales stay strict."""
    if float_equivalent:
        got = {n: ((expected[n][0] if n in expected and d in _FLOAT and expected[n][0] in _FLOAT
                    and not n.endswith(SCALE_SUFFIX) else d), s) for n, (d, s) in got.items()}
    diffs = [f"missing {n} ({d} {list(s)})" for n, (d, s) in expected.items() if n not in got]
    diffs += [f"extra {n} ({d} {list(s)})" for n, (d, s) in got.items() if n not in expected]
    diffs += [f"{n}: {got[n][0]} {list(got[n][1])}, DeepSeek's release has {d} {list(s)}"
              for n, (d, s) in expected.items() if n in got and got[n] != (d, s)]
    return diffs[:limit] if limit else diffs


def check_layout(expected: Layout, got: Layout) -> None:
    diffs = layout_differences(expected, got, limit=0)
    if diffs:
        raise LayoutError(f"{len(diffs)} tensor(s) differ from DeepSeek's FP8 layout, first: {diffs[0]}")


def dequant_errors(pairs: Iterable[tuple[str, torch.Tensor]], originals: dict[str, torch.Tensor],
                   limit: int = 10) -> list[str]:
    """Names (with the worst excess) of the FP8 weights in PAIRS that do not dequantize to within FP8 rounding of
    ORIGINALS; non-FP8 tensors must equal their original exactly."""
    from dsv3_rl.checkpoint.fp8_kernels import dequant

    got = dict(pairs)
    bad = []
    for name, t in got.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        x = originals[name]
        if t.dtype != torch.float8_e4m3fn:
            if not torch.equal(t, x):
                bad.append(f"{name}: not FP8 and not equal to the original")
            continue
        s = got.get(name + SCALE_SUFFIX)
        if s is None:
            bad.append(f"{name}: FP8 without {name + SCALE_SUFFIX}")
            continue
        deq = dequant(t, s.float()).float()
        xf = x.float()
        s_full = s.float().repeat_interleave(BLOCK, 0)[: x.shape[0]].repeat_interleave(BLOCK, 1)[:, : x.shape[1]]
        bound = xf.abs() * (2**-4 + 2**-8) + s_full * 2**-9
        excess = ((deq - xf).abs() - bound).max().item()
        if excess > 0:
            bad.append(f"{name}: off by up to {excess:.3g} beyond the FP8 rounding bound")
    return bad[:limit] if limit else bad
