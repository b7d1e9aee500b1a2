"""Platform environment parsing (PAI-DLC, MLP-style, Slurm, local), job specs, the shell launcher, and
pipeline stage skipping. Fast: no verl, no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3_rl.launch import platform, specs
from dsv3_rl.launch.platform import PlatformError
from dsv3_rl.recipes.presets import REPO, load_preset
from dsv3_rl.launch.stages import Stage, StageError

DLC = {"MASTER_ADDR": "dlc1a2b3c-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "64", "RANK": "5",
       "KUBERNETES_CONTAINER_RESOURCE_GPU": "8"}


def test_dlc_pytorchjob_environment():
    n = platform.parse(DLC)
    assert (n.platform, n.nnodes, n.node_rank, n.head_addr, n.master_port, n.gpus_per_node, n.is_head) == \
        ("dlc", 64, 5, "dlc1a2b3c-master-0", 23456, 8, False)
    assert n.ray_port == 6379 and "WORLD_SIZE" in n.sources
    head = platform.parse({**DLC, "RANK": "0", "RAY_PORT": "7000"})
    assert head.is_head and head.ray_port == 7000


def test_mlp_worker_variables_win_over_dlc_ones():
    env = {**DLC, "MLP_WORKER_NUM": "2", "MLP_ROLE_INDEX": "1", "MLP_WORKER_0_HOST": "10.0.0.7",
           "MLP_WORKER_0_PORT": "9999", "MLP_WORKER_GPU": "4"}
    n = platform.parse(env)
    assert (n.nnodes, n.node_rank, n.head_addr, n.master_port, n.gpus_per_node) == (2, 1, "10.0.0.7", 9999, 4)
    assert platform.parse({**env, "MLP_WORKER_0_PRIMARY_HOST": "10.0.0.8"}).head_addr == "10.0.0.8"


@pytest.mark.parametrize("env, text", [
    ({**DLC, "RANK": "64"}, r"RANK=64 but WORLD_SIZE=64"),
    ({**DLC, "WORLD_SIZE": "sixty-four"}, r"WORLD_SIZE='sixty-four' is not an integer"),
    ({"MLP_WORKER_NUM": "2"}, r"no node rank .*; no head address"),
    ({**DLC, "KUBERNETES_CONTAINER_RESOURCE_GPU": "-1"}, r"KUBERNETES_CONTAINER_RESOURCE_GPU=-1 must be >= 0"),
    ({"DSV3_PLATFORM": "k8s"}, r"DSV3_PLATFORM='k8s'; allowed: dlc, slurm, local"),
])
def test_bad_platform_environment_names_the_variable(env, text):
    with pytest.raises(PlatformError, match=text):
        platform.parse(env)


def test_single_dsw_container_is_local():
    n = platform.parse({"KUBERNETES_CONTAINER_RESOURCE_GPU": "8"})
    assert (n.platform, n.nnodes, n.node_rank, n.gpus_per_node) == ("local", 1, 0, 8)
    assert platform.parse({}).platform == "local"


def test_slurm_environment():
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "16", "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "gpu[003-010,012],cpu1",
           "SLURM_GPUS_ON_NODE": "8"}
    n = platform.parse(env)
    assert (n.platform, n.nnodes, n.node_rank, n.head_addr, n.gpus_per_node) == ("slurm", 16, 3, "gpu003", 8)
    assert platform.parse({**env, "MASTER_ADDR": "gpu099"}).head_addr == "gpu099"
    assert platform.parse({**env, "SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:8"}).gpus_per_node == 8
    with pytest.raises(PlatformError, match="SLURM_NODEID=16 but SLURM_NNODES=16"):
        platform.parse({**env, "SLURM_NODEID": "16"})
    with pytest.raises(PlatformError, match="cannot find the head node"):
        platform.parse({k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"})


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("a[1-4]", "a1"), ("gpu[007,009]", "gpu007"),
                                             ("x-[010-020],y[1]", "x-010")])
def test_slurm_first_host(nodelist, first):
    assert platform.first_host(nodelist) == first


# --------------------------------------------------------------------------------------- specs


def test_dlc_spec_for_512_gpus():
    p = load_preset("671b_512xH100")
    env = {"DLC_IMAGE": "registry/img:1", "DLC_WORKSPACE_ID": "ws1", "DLC_RESOURCE_ID": "quota1",
           "DLC_DATA_SOURCES": "d1,d2", "WORK_DIR": "/mnt/data/dsv3", "DLC_CODE_DIR": "/mnt/data/dsv3-rl"}
    s = specs.dlc_spec(p, env, ["trainer.total_epochs=2"])
    assert not s.missing
    body = s.body()
    assert body["JobType"] == "PyTorchJob" and body["JobSpecs"][0]["PodCount"] == 64
    assert body["JobSpecs"][0]["ResourceConfig"]["GPU"] == "8" and body["Envs"]["WORK_DIR"] == "/mnt/data/dsv3"
    assert body["DataSources"] == [{"DataSourceId": "d1"}, {"DataSourceId": "d2"}]
    assert s.command == ("cd /mnt/data/dsv3-rl && bash examples/deepseek_v3/run_mcore_deepseek_verl.sh "
                         "--preset 671b_512xH100 trainer.total_epochs=2")
    cli = s.cli()
    assert cli.startswith("dlc submit pytorchjob") and "--workers=64" in cli and "--worker_gpu=8" in cli
    kv = dict(line.split("=", 1) for line in s.job_file().splitlines())
    assert kv["workers"] == "64" and kv["worker_image"] == "registry/img:1" and kv["command"] == s.command
    assert json.loads(s.render("json")) == body
    import yaml

    assert yaml.safe_load(s.render("yaml")) == body


def test_dlc_spec_lists_missing_site_values():
    s = specs.dlc_spec(load_preset("671b_96xH20"), {})
    assert set(s.missing) == {"DLC_IMAGE", "DLC_WORKSPACE_ID", "DLC_RESOURCE_ID"}
    assert s.workers == 12 and "<DLC_IMAGE>" in s.cli()


def test_sbatch_line_matches_the_preset():
    line = specs.sbatch_command(load_preset("671b_512xH100"), ["data.train_batch_size=128"])
    assert "--nodes=64" in line and "--gpus-per-node=8" in line and "PRESET=671b_512xH100" in line
    assert line.endswith("run_mcore_deepseek_verl.sbatch data.train_batch_size=128")
    sb = (REPO / specs.SBATCH).read_text()
    assert "srun" in sb and "--ntasks-per-node=1" in sb and "run_mcore_deepseek_verl.sh" in sb


def test_shell_launcher_is_thin():
    sh = (REPO / specs.LAUNCHER).read_text()
    code = [ln for ln in sh.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert any('-m dsv3_rl.launch run "$@"' in ln for ln in code)
    assert len(code) < 30
    for forbidden in ("pkill", "killall", "MODEL_SIZE", "A37B", "tensor_model_parallel_size", "$1"):
        assert forbidden not in sh, forbidden
    r = subprocess.run(["bash", str(REPO / specs.LAUNCHER), "--list"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "671b_512xH100" in r.stdout, r.stderr


def test_env_presets_keep_caller_values():
    for name in ("h100", "h20", "cpu"):
        f = REPO / "examples" / "deepseek_v3" / "env" / f"{name}.sh"
        out = subprocess.run(["bash", "-c", f'NCCL_DEBUG=INFO; set -a; source "{f}"; echo "$NCCL_DEBUG|$NCCL_NVLS_ENABLE"'],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == "INFO|0", (name, out)


# -------------------------------------------------------------------------------------- stages


def _stage(tmp: Path, src: Path, argv_extra=()) -> Stage:
    out = tmp / "out"
    argv = [sys.executable, "-c", "import pathlib,sys; pathlib.Path(sys.argv[1]).mkdir(exist_ok=True); "
            "(pathlib.Path(sys.argv[1])/'result.txt').write_text(open(sys.argv[2]).read())", str(out), str(src),
            *argv_extra]
    return Stage("copy", needed=True, why="", argv=argv, out_dir=out, outputs=[out / "result.txt"], inputs=[src])


def test_stage_runs_once_then_skips_and_reruns_on_change(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a")
    st = _stage(tmp_path, src)
    assert st.status()[0] == "run"
    st.run({}, log=lambda *_: None)
    assert st.ran and st.status() == ("done", "verified output exists")
    again = _stage(tmp_path, src)
    again.run({}, log=lambda *_: None)
    assert not again.ran  # skipped
    src.write_text("bb")  # input changed -> rerun
    assert _stage(tmp_path, src).status() == ("run", "inputs changed since the last run")
    assert _stage(tmp_path, src, ["--x"]).status() == ("run", "options changed since the last run")
    (tmp_path / "out" / "result.txt").unlink()  # output gone -> rerun
    assert _stage(tmp_path, src).status()[0] == "run"


def test_stage_failure_and_unverified_output_are_errors(tmp_path):
    st = Stage("bad", needed=True, why="", argv=[sys.executable, "-c", "raise SystemExit(3)"], out_dir=tmp_path,
               outputs=[tmp_path / "x"], inputs=[])
    with pytest.raises(StageError, match="exit status 3"):
        st.run({}, log=lambda *_: None)
    st2 = Stage("nothing", needed=True, why="", argv=[sys.executable, "-c", "pass"], out_dir=tmp_path,
                outputs=[tmp_path / "x"], inputs=[])
    with pytest.raises(StageError, match="did not write"):
        st2.run({}, log=lambda *_: None)


def test_fp8_and_convert_stages_trust_the_tools_manifests(tmp_path):
    from dsv3_rl.launch.run import Paths
    from dsv3_rl.checkpoint.outputs import CONVERT_TOOL, FP8_TOOL, write_manifest
    from dsv3_rl.launch.stages import build_stages

    p = load_preset("671b_512xH100")
    model, hf, mcore = tmp_path / "m", tmp_path / "m-BF16", tmp_path / "mc"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    paths = Paths(tmp_path, model, hf, mcore, tmp_path / "raw", tmp_path / "data", tmp_path / "ck", tmp_path / "lg")
    by = {s.name: s for s in build_stages(p, paths, max_prompt_length=2048, model_cfg={})}
    assert by["fp8_cast"].needed and by["fp8_cast"].status()[0] == "run"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    write_manifest(hf, FP8_TOOL, {"complete": False, "input": str(model)})
    assert by["fp8_cast"].status()[0] == "run"  # incomplete cast: resume
    write_manifest(hf, FP8_TOOL, {"complete": True, "input": str(tmp_path / "other")})
    assert "not of" in by["fp8_cast"].status()[1]  # a cast of another checkpoint
    write_manifest(hf, FP8_TOOL, {"complete": True, "input": str(model)})
    assert by["fp8_cast"].status()[0] == "done"
    mcore.mkdir()
    write_manifest(mcore, CONVERT_TOOL, {"complete": True, "direction": "hf->mcore", "source": str(hf)})
    by = {s.name: s for s in build_stages(p, paths, max_prompt_length=2048, model_cfg={})}
    assert by["convert"].status()[0] == "done"
    write_manifest(mcore, CONVERT_TOOL, {"complete": True, "direction": "hf->mcore", "source": "/x"})
    by = {s.name: s for s in build_stages(p, paths, max_prompt_length=2048, model_cfg={})}
    assert by["convert"].status()[0] == "run"  # rerun the converter (no "not in this checkout" error any more)


# ------------------------------------------------------------------------ multi-node dispatch


class _FakeLaunch:
    """What cli.execute reads from a resolved launch."""

    def __init__(self, tmp: Path, nnodes: int = 2, gpn: int = 8):
        from types import SimpleNamespace

        self.sizes = SimpleNamespace(nnodes=nnodes, gpus_per_node=gpn)
        from omegaconf import OmegaConf

        self.preset = SimpleNamespace(is_cpu=False, hardware_name=f"{nnodes * gpn}xH100", checks=None,
                                      run={"verify_checkpoints": "structure"})
        self.paths = SimpleNamespace(logs=tmp, ckpt=tmp / "ckpt")
        self.cfg = OmegaConf.create({"trainer": {"resume_mode": "auto", "max_actor_ckpt_to_keep": 2}})
        self.stages = []
        self.argv = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name=ppo_megatron_trainer"]

    def full_env(self):
        return dict(self._env)


def _execute(monkeypatch, tmp_path, env, **kw):
    from dsv3_rl.errors import run_main
    from dsv3_rl.launch import cli, ray_cluster

    calls = {}
    monkeypatch.setattr(ray_cluster, "run_head", lambda spec, n, e, before, cmd, t, log_path=None: calls.update(
        head=(spec, n, cmd, e)) or 0)
    monkeypatch.setattr(ray_cluster, "run_worker", lambda spec, e, t, log_path=None: calls.update(worker=(spec, e)) or 0)
    monkeypatch.setattr(ray_cluster, "resolve_host", lambda h: "10.1.2.3")
    launch = _FakeLaunch(tmp_path, **kw)
    launch._env = env
    for k in [k for k in __import__("os").environ if k.startswith(("RAY_", "MLP_", "SLURM_"))]:
        monkeypatch.delenv(k, raising=False)
    # as `dsv3-launch` runs it: a PlatformError becomes one `error:` line and exit 2 (cli_main)
    rc = run_main(lambda argv: cli.execute(launch), [])
    return rc, calls


def test_execute_makes_rank0_the_head_and_others_workers(monkeypatch, tmp_path):
    env = {**DLC, "WORLD_SIZE": "2", "RANK": "0"}
    rc, calls = _execute(monkeypatch, tmp_path, env)
    spec, n, cmd, e = calls["head"]
    assert rc == 0 and spec.head and spec.port == 6379 and spec.num_gpus == 8 and n == 2 and cmd[2] == "verl.trainer.main_ppo"
    assert e["RAY_AUTH_MODE"] == "disabled"  # no shared token: Ray's default token auth would lock workers out
    rc, calls = _execute(monkeypatch, tmp_path, {**env, "RANK": "1", "RAY_AUTH_TOKEN": "ab" * 32})
    spec, e = calls["worker"]
    assert rc == 0 and not spec.head and spec.head_addr == "10.1.2.3" and e["RAY_AUTH_MODE"] == "token"


def test_execute_refuses_a_job_of_the_wrong_size(monkeypatch, tmp_path, capsys):
    rc, calls = _execute(monkeypatch, tmp_path, {**DLC, "WORLD_SIZE": "3", "RANK": "0"})
    assert rc == 2 and not calls
    assert "the job has 3 node(s) (dlc) but the run needs trainer.nnodes=2" in capsys.readouterr().err
    rc, calls = _execute(monkeypatch, tmp_path, {**DLC, "WORLD_SIZE": "2", "RANK": "0",
                                                 "KUBERNETES_CONTAINER_RESOURCE_GPU": "4"})
    assert rc == 2 and not calls
    assert "this node has 4 GPUs" in capsys.readouterr().err


RAY_START_WAIT = "RAY_raylet_start_wait_time_s"


def _ray_wait_of_env_files(env_dir: Path) -> dict[str, str | None]:
    from dsv3_rl.launch.run import env_from_file

    base = {k: v for k, v in os.environ.items() if k != RAY_START_WAIT}
    return {n: env_from_file(env_dir / f"{n}.sh", base).get(RAY_START_WAIT) for n in ("cpu", "h100", "h20")}


def test_every_env_preset_gives_ray_120_s_to_register_its_raylet():
    """Every hardware env file gives the driver 120 s (Ray's default: 30) for its raylet to register: the raylet waits
    for its two agents' port files first, which on a loaded 2-core box took > 30 s about once per CI run (docs/ci-history.md
    "2026-12-07"); a value the job sets wins. The name is one Ray's core reads: it is compiled into _raylet.so."""
    import ray

    assert _ray_wait_of_env_files(REPO / "examples" / "deepseek_v3" / "env") == {"cpu": "120", "h100": "120", "h20": "120"}
    out = subprocess.run(["bash", "-c", f'{RAY_START_WAIT}=600; set -a; source "$1"; echo "${RAY_START_WAIT}"', "bash",
                          str(REPO / "examples" / "deepseek_v3" / "env" / "cpu.sh")], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "600", out
    so = next(Path(ray.__file__).parent.glob("_raylet*.so"))
    assert b"raylet_start_wait_time_s" in so.read_bytes()


def test_planted_fault_env_files_without_the_ray_wait(tmp_path):
    """Twin: the env files with the line removed from common.sh leave Ray's 30 s: the check above fails."""
    src = REPO / "examples" / "deepseek_v3" / "env"
    for f in src.glob("*.sh"):
        text = f.read_text()
        if f.name == "common.sh":
            assert RAY_START_WAIT in text
            text = "\n".join(ln for ln in text.splitlines() if RAY_START_WAIT not in ln) + "\n"
        (tmp_path / f.name).write_text(text)
    assert _ray_wait_of_env_files(tmp_path) == {"cpu": None, "h100": None, "h20": None}
