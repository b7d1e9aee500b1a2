"""Host memory of the trainer (dsv3_rl/planner/memory.py ``trainer_host_memory``) and the launcher's check of it
against this machine's RAM (dsv3_rl/launch/checks.py ``host_memory_check``, called by ``cli.here_findings``).

Reference: the measurement, not the model: proxy_1xH100 on a 1xH100 box with MemTotal 125.85 GiB was killed by Ray's
memory monitor with its trainer process at 101.45 GiB (docs/results/2026-12-07-gpu-proxy1/README.md, raw log
attempt1/main_ppo.log.gz). Each check has
a twin that must fail: an estimate without the CPU optimizer state, and the check with the estimate zeroed."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv3_rl.planner import Layout, Options, load_model
from dsv3_rl.planner import memory as mem
from dsv3_rl.planner.pipeline import split_layers
from dsv3_rl.planner.spec import GIB

BOX_MEMTOTAL = 135129055232  # Ray's "limit" in the same report: MemTotal, 125.85 GiB

RESULTS = Path(__file__).resolve().parents[2] / "docs/results/2026-12-07-gpu-proxy1"


def _ray_report() -> str:
    import gzip

    return gzip.decompress((RESULTS / "attempt1/main_ppo.log.gz").read_bytes()).decode(errors="replace")


def _measured_gib() -> float:
    """The trainer process's memory in Ray's OOM report (its "GB" are GiB: the limit it names, 135129055232 B, is
    125.85 of them), read from the raw log the results page quotes."""
    log = _ray_report()
    m = re.search(r"^\d+\t(\d+\.\d+)\tray::WorkerDict", log, re.M)
    assert m, f"{RESULTS}/attempt1/main_ppo.log.gz has no trainer line in Ray's memory report"
    assert f"of {BOX_MEMTOTAL}B limit" in log
    return float(m.group(1))


PROXY_OPTIONS = Options(param_offload=True, optimizer_offload=True, optimizer_cpu_offload_fraction=1.0,
                        precision_aware_optimizer=True, ref_model=False)


def _estimate(opt: Options) -> mem.HostMemory:
    m = load_model("proxy")
    split, _ = split_layers(m.num_layers, 1, None)
    return mem.trainer_host_memory(m, split, Layout(tp=1, pp=1, ep=1, recompute="full"), opt, world=1, gpus_per_node=1)


def _within(est: float, ref: float, tol: float = 0.10) -> bool:
    return abs(est - ref) <= tol * ref


def test_proxy_1xh100_estimate_is_within_10_percent_of_the_measured_trainer():
    ref = _measured_gib()
    assert ref == pytest.approx(101.45)
    hm = _estimate(PROXY_OPTIONS)
    assert hm.processes_per_node == 1 and hm.per_node == hm.per_process
    assert _within(hm.per_node / GIB, ref), (hm.per_node / GIB, hm.gib())
    # the terms the code allocates (5.24B params): Adam's two fp32 moments are the biggest, the pinned copies next
    g = hm.gib()
    assert g["hdo_adam_fp32"] == pytest.approx(8 * 5.2446e9 / GIB, rel=1e-3)
    assert g["hdo_master_fp32"] == pytest.approx(4 * 5.2446e9 / GIB, rel=1e-3)
    assert g["param_offload"] >= 2 * 5.2446e9 / GIB and g["hdo_grads_fp32"] >= 4 * 5.2446e9 / GIB


def test_twin_an_estimate_without_the_cpu_optimizer_state_is_not_within_10_percent():
    no_hdo = dataclasses.replace(PROXY_OPTIONS, optimizer_cpu_offload_fraction=0.0, optimizer_offload=False)
    assert not _within(_estimate(no_hdo).per_node / GIB, _measured_gib())


def test_pinned_allocations_round_up_to_a_power_of_two():
    assert mem._pinned(3 * 2**30) == 4 * 2**30 and mem._pinned(2**20) == 2**20 and mem._pinned(2**20 + 1) == 2**21


# --- the launcher's check ----------------------------------------------------------------------


def _resolve(tmp_path_factory, preset: str):
    import os

    from dsv3_rl.launch import run as launch_run

    old = os.environ.get("WORK_DIR")
    os.environ["WORK_DIR"] = str(tmp_path_factory.mktemp("work"))
    try:
        return launch_run.resolve(preset, [], validate=False)
    finally:
        if old is None:
            os.environ.pop("WORK_DIR", None)
        else:
            os.environ["WORK_DIR"] = old


@pytest.fixture(scope="module")
def proxy_launch(tmp_path_factory):
    """The run that was killed (attempt 1): proxy_1xH100 on the 4-layer `proxy`, resolved once (no validation)."""
    from dsv3_rl.recipes.presets import PRESET_DIR

    f = tmp_path_factory.mktemp("preset") / "proxy_1xH100_attempt1.yaml"
    f.write_text(f"extends: {PRESET_DIR / 'proxy_1xH100.yaml'}\nmodel: proxy\nweights: {{name: dsv3-proxy}}\n")
    return _resolve(tmp_path_factory, str(f))


def test_the_preset_as_it_is_now_fits_the_125_gib_box(tmp_path_factory, monkeypatch):
    (f,) = _here(_resolve(tmp_path_factory, "proxy_1xH100"), monkeypatch, BOX_MEMTOTAL)
    assert f.level == "info" and f.message.startswith("fits"), f


def _here(launch, monkeypatch, mem_total, *, dry_run=False):
    from dsv3_rl.launch import cli, platform

    monkeypatch.setattr(platform, "local_gpus", lambda: 1)
    monkeypatch.setattr(platform, "mem_total_bytes", lambda path="/proc/meminfo": mem_total)
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    return [f for f in cli.here_findings(launch, dry_run=dry_run) if f.check == "host_memory"]


def test_here_check_refuses_proxy_1xh100_on_the_125_gib_box_and_runs_it_on_512_gb(proxy_launch, monkeypatch):
    (f,) = _here(proxy_launch, monkeypatch, BOX_MEMTOTAL)
    assert f.level == "error", f
    assert "MemTotal 125.85 GiB x RAY_memory_usage_threshold 0.95 = 119.6 GiB" in f.message, f.message
    assert "refused before anything starts" in f.message
    (ok,) = _here(proxy_launch, monkeypatch, 512e9)
    assert ok.level == "info" and ok.message.startswith("fits"), ok
    (dry,) = _here(proxy_launch, monkeypatch, BOX_MEMTOTAL, dry_run=True)  # planned for another machine: info
    assert dry.level == "info" and "would not fit" in dry.message


def test_twin_with_the_estimate_zeroed_the_125_gib_box_is_not_refused(proxy_launch, monkeypatch):
    zero = mem.HostMemory(terms={"process": 0.0}, processes_per_node=1)
    monkeypatch.setattr(mem, "trainer_host_memory", lambda *a, **k: zero)
    assert all(f.level != "error" for f in _here(proxy_launch, monkeypatch, BOX_MEMTOTAL))


def test_cpu_presets_are_not_checked():
    from dsv3_rl.launch.checks import host_memory_check

    cpu = SimpleNamespace(preset=SimpleNamespace(is_cpu=True, planner=None), sizes=object(), cfg=object())
    assert host_memory_check(cpu, 1.0, 0.95, dry_run=False) == []


def test_mem_total_reads_proc_meminfo(tmp_path):
    from dsv3_rl.launch.platform import mem_total_bytes

    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       131962000 kB\nMemFree:        1 kB\n")
    assert mem_total_bytes(str(p)) == 131962000 * 1024
    assert mem_total_bytes(str(tmp_path / "absent")) is None
