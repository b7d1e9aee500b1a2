"""The MLA attention-backend probe (``dsv3_rl.mcore.te_attention_probe``) without Transformer Engine: argument
parsing, the layouts (thd packed, sbhd, bshd padded) and the comparison against transformers' eager attention
with a stand-in backend (torch SDPA per sequence) that must PASS, and its planted faults (no causal mask, packed
sequences attended as one, wrong softmax scale) that must FAIL; the guard verdicts on faked TE results (and their
twins); the refusal when TE is absent (one line, exit 2). The real backends run on the GPU (gpu_session.sh te)."""

from __future__ import annotations

import subprocess

import pytest

from dsv3_rl.mcore import te_attention_probe as probe

SCALE = probe.mla_softmax_scale()
SEQLENS, SEQ, HEADS = [48, 20, 1], 32, 2


def test_parse_args_defaults_and_lists():
    a = probe.parse_args([])
    assert a.backends == list(probe.BACKENDS) and a.formats == list(probe.FORMATS)
    a = probe.parse_args(["--backends", "fused,unfused", "--formats", "thd", "--seqlens", "7,3"])
    assert a.backends == ["fused", "unfused"] and a.formats == ["thd"] and a.seqlens == [7, 3]


@pytest.mark.parametrize("argv", [["--backends", "cudnn"], ["--formats", "bshd"], ["--seqlens", "4,0"],
                                  ["--seqlens", "x"], ["--heads", "0"]])
def test_parse_args_refuses_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as e:
        probe.parse_args(argv)
    assert e.value.code == 2
    assert "error: " in capsys.readouterr().err.strip().splitlines()[-1]


def _case(fmt, attn):
    seqs = probe.make_case(fmt, SEQLENS, SEQ, HEADS, seed=0)
    ref = probe.reference(seqs, SCALE)
    return probe.run_case(attn, fmt, seqs, ref, HEADS, SCALE, "cpu", tol=1e-2)


@pytest.mark.parametrize("fmt", probe.FORMATS)
def test_stand_in_backend_matches_transformers_eager(fmt):
    r = _case(fmt, probe.sdpa_attention(SCALE))
    assert r["ok"], r
    assert 0 < r["max_err"] < 1e-2, r  # bf16 rounding, not zero: the comparison is not against itself


@pytest.mark.parametrize("fmt,fault", [(f, "no-causal") for f in probe.FORMATS] + [(f, "scale") for f in probe.FORMATS]
                         + [("thd", "one-sequence")])
# (bshd-padded with the padding ignored is no fault: with right padding and a causal mask a real token never
# sees a padded one, which is why TE's padding_causal needs right padding.)
def test_planted_faults_fail(fmt, fault):
    r = _case(fmt, probe.sdpa_attention(SCALE, fault=fault))
    assert not r["ok"], r
    assert r["max_err"] > 5e-2, r


def test_layouts_round_trip():
    import torch

    for fmt in probe.FORMATS:
        seqs = probe.make_case(fmt, SEQLENS, SEQ, HEADS, seed=1)
        q, k, v, dout, kw = probe.pack(fmt, seqs, "cpu")
        back = probe.unpack(fmt, q, [s[0].shape[0] for s in seqs], HEADS)
        assert all(torch.equal(b, s[0].float()) for b, s in zip(back, seqs)), fmt
        assert kw["qkv_format"] == {"thd": "thd", "sbhd": "sbhd", "bshd-padded": "bshd"}[fmt]
    _, _, _, _, kw = probe.pack("thd", probe.make_case("thd", SEQLENS, SEQ, HEADS, 0), "cpu")
    assert kw["cu_seqlens_q"].tolist() == [0, 48, 68, 69] and kw["max_seqlen_q"] == 48


def _fake(backend, cudnn, cases, fa3=False):
    return {"backend_requested": backend, "te_version": "2.11.0", "cudnn_te": list(cudnn), "cudnn_torch": 91900,
            "gpu": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0], "flash_attn_3": fa3, "cases": cases}


def _ran(fmt, sel, err=3e-3, case=None):
    return {"format": fmt, "case": case or fmt, "selected": sel, "ok": err <= 1e-2, "max_err": err}


def _none(fmt, case=None):
    return {"format": fmt, "case": case or fmt, "selected": "none", "ok": None, "error": "No dot product attention backend"}


def _box(cudnn=(9, 19, 0), fused_runs=True):
    fused = [_ran(f, "fused (sub-backend 1)") if fused_runs else _none(f) for f in probe.FORMATS]
    return {
        "auto": _fake("auto", cudnn, [_ran(f, "fused (sub-backend 1)" if fused_runs else "unfused") for f in probe.FORMATS]),
        "fused": _fake("fused", cudnn, fused + [_none("sbhd", "sbhd-fp32")]),
        "flash": _fake("flash", cudnn, [_none(f) for f in probe.FORMATS]),
        "unfused": _fake("unfused", cudnn, [_ran(f, "unfused") for f in probe.FORMATS]),
    }


def test_guard_verdicts_on_the_expected_box():
    res = _box()
    v = probe.guard_verdicts(res)
    assert {x["case"]: (x["must"], x["ok"]) for x in v} == {
        "fused bf16": ("pass", True), "fused fp32": ("catch", True), "flash bf16": ("catch", True)}, v
    line, ok = probe.summarize(res, v, probe.parse_args([]))
    assert ok and line.endswith("| PASS") and "\n" not in line, line
    assert line.startswith("te_mla_attention: TE 2.11.0, NVIDIA H100 80GB HBM3, cuDNN 9.19.0"), line


def test_guard_verdict_twins_fail():
    # TE had no fused backend where the guard allows it (cuDNN 9.19 on Hopper): the guard is wrong -> FAIL
    v = probe.guard_verdicts(_box(fused_runs=False))
    assert not next(x for x in v if x["case"] == "fused bf16")["ok"], v
    # TE ran fused correctly on cuDNN 9.4 where the guard refuses: the guard is wrong the other way -> FAIL
    res = _box(cudnn=(9, 4, 0))
    v = probe.guard_verdicts(res)
    assert not next(x for x in v if x["case"] == "fused bf16")["ok"], v
    assert not probe.summarize(res, v, probe.parse_args([]))[1]


def test_summary_fails_on_wrong_numbers_or_wrong_backend():
    res = _box()
    res["auto"]["cases"][0] = _ran("thd", "fused (sub-backend 1)", err=0.3)
    assert not probe.summarize(res, probe.guard_verdicts(res), probe.parse_args([]))[1]
    res = _box()
    res["unfused"]["cases"][1] = _ran("sbhd", "fused (sub-backend 1)")  # forced unfused, TE ran something else
    assert not probe.summarize(res, probe.guard_verdicts(res), probe.parse_args([]))[1]
    res = _box()
    res["auto"]["cases"][2] = _none("bshd-padded")  # TE's own choice found nothing
    assert not probe.summarize(res, probe.guard_verdicts(res), probe.parse_args([]))[1]


def test_refuses_without_te(monkeypatch, capsys):
    from dsv3_rl.mcore import te_env

    monkeypatch.setattr(te_env, "installed_te_version", lambda: None)
    assert probe.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: Transformer Engine is not installed"), err


def test_cudnn_mismatch_in_a_child_stops_the_probe(monkeypatch):
    line = "error: cuDNN mismatch: torch 2.11.0 was built against cuDNN 9.19.0 but this process loaded 9.14.0 (...)"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 2, "", line + "\n"))
    with pytest.raises(probe.ProbeError, match="cuDNN mismatch"):
        probe.run_children(probe.parse_args(["--backends", "auto"]))


def test_selected_backend_read_from_tes_record(monkeypatch):
    import sys
    import types

    assert probe.te_selected_backend() == "-"  # TE not loaded
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.attention",
             "transformer_engine.pytorch.attention.dot_product_attention",
             "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"]
    mods = {n: types.ModuleType(n) for n in names}
    for parent, child in zip(names, names[1:]):
        setattr(mods[parent], child.rsplit(".", 1)[1], mods[child])
    rec = mods[names[-1]]._attention_backends = {"use_flash_attention": False, "use_fused_attention": True,
                                                 "fused_attention_backend": 1, "use_unfused_attention": False}
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    assert probe.te_selected_backend() == "fused (sub-backend 1)"
    rec.update(use_fused_attention=False, use_unfused_attention=True)
    assert probe.te_selected_backend() == "unfused"
    rec.update(use_unfused_attention=False)
    assert probe.te_selected_backend() == "none"
