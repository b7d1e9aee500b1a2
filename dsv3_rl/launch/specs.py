"""Job submission specs generated from a preset: PAI-DLC (``dlc submit pytorchjob`` command line, its
``--job_file`` key=value file, and a CreateJob request body as JSON/YAML) and Slurm (an ``sbatch`` line
for ``examples/deepseek_v3/slurm/run_mcore_deepseek_verl.sbatch``).

Site values come from options or the environment: ``DLC_IMAGE``, ``DLC_WORKSPACE_ID``,
``DLC_RESOURCE_ID`` (quota), ``DLC_DATA_SOURCES`` (comma-separated dataset ids), ``DLC_CODE_DIR`` (where the
repo is inside the container; default: this checkout's path, i.e. shared storage mounted at the same
path). A missing one is left as ``<DLC_IMAGE>`` and listed in ``missing``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Any

from dsv3_rl.recipes.presets import REPO, Preset

LAUNCHER = "examples/deepseek_v3/run_mcore_deepseek_verl.sh"
SBATCH = "examples/deepseek_v3/slurm/run_mcore_deepseek_verl.sbatch"
#: environment forwarded into the job when set here (paths on shared storage, logging)
FORWARD_ENV = ("WORK_DIR", "MODEL_PATH", "HF_PATH", "MCORE_PATH", "DATA_RAW", "DATA_DIR", "CKPT_DIR", "LOG_DIR",
               "WANDB_MODE", "RAY_AUTH_MODE", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")


@dataclasses.dataclass
class DLCSpec:
    name: str
    command: str
    workers: int
    gpu: int
    cpu: int
    memory: str
    shared_memory: str
    image: str
    workspace_id: str
    resource_id: str
    data_sources: list[str]
    envs: dict[str, str]
    priority: int
    max_running_minutes: int | None
    gpu_type: str | None
    missing: list[str]
    max_restarts: int = 0
    """``run.max_restarts``: DLC's AIMaster restarts the job (``--enable-job-restart``) up to this often"""

    @property
    def restart_args(self) -> str:
        """AIMaster fault-tolerance arguments: a failed job is restarted as a whole (every pod reruns the launcher,
        which resumes from the last verified checkpoint); "Sync" because the Ray job spans all pods."""
        return (f"--job-execution-mode=Sync --enable-job-restart=True --max-num-of-job-restart={self.max_restarts}"
                if self.max_restarts else "")

    def cli(self) -> str:
        """``dlc submit pytorchjob`` command line (the DLC client's flags)."""
        args = [
            f"--name={self.name}", f"--workers={self.workers}",
            f"--worker_gpu={self.gpu}", f"--worker_cpu={self.cpu}", f"--worker_memory={self.memory}",
            f"--worker_shared_memory={self.shared_memory}", f"--worker_image={self.image}",
            f"--workspace_id={self.workspace_id}", f"--resource_id={self.resource_id}", f"--priority={self.priority}",
        ]
        if self.data_sources:
            args.append(f"--data_sources={','.join(self.data_sources)}")
        if self.envs:
            args.append("--envs=" + ",".join(f"{k}={v}" for k, v in self.envs.items()))
        if self.max_running_minutes:
            args.append(f"--job_max_running_time_minutes={self.max_running_minutes}")
        args.append(f"--command={self.command}")
        return "dlc submit pytorchjob \\\n  " + " \\\n  ".join(shlex.quote(a) for a in args)

    def job_file(self) -> str:
        """``dlc submit pytorchjob --job_file=FILE``: key=value lines, keys as the command-line flags."""
        lines = [
            f"name={self.name}", f"workers={self.workers}", f"worker_gpu={self.gpu}", f"worker_cpu={self.cpu}",
            f"worker_memory={self.memory}", f"worker_shared_memory={self.shared_memory}", f"worker_image={self.image}",
            f"workspace_id={self.workspace_id}", f"resource_id={self.resource_id}", f"priority={self.priority}",
        ]
        if self.data_sources:
            lines.append(f"data_sources={','.join(self.data_sources)}")
        if self.envs:
            lines.append("envs=" + ",".join(f"{k}={v}" for k, v in self.envs.items()))
        if self.max_running_minutes:
            lines.append(f"job_max_running_time_minutes={self.max_running_minutes}")
        lines.append(f"command={self.command}")
        return "\n".join(lines) + "\n"

    def body(self) -> dict[str, Any]:
        """PAI-DLC CreateJob request body (JobType PyTorchJob, one Worker role of ``workers`` pods)."""
        res = {"GPU": str(self.gpu), "CPU": str(self.cpu), "Memory": self.memory, "SharedMemory": self.shared_memory}
        if self.gpu_type:
            res["GPUType"] = self.gpu_type
        body: dict[str, Any] = {
            "DisplayName": self.name, "JobType": "PyTorchJob", "WorkspaceId": self.workspace_id,
            "ResourceId": self.resource_id, "Priority": self.priority, "UserCommand": self.command,
            "JobSpecs": [{"Type": "Worker", "Image": self.image, "PodCount": self.workers, "ResourceConfig": res}],
            "Envs": dict(self.envs),
        }
        if self.data_sources:
            body["DataSources"] = [{"DataSourceId": d} for d in self.data_sources]
        if self.max_running_minutes:
            body["JobMaxRunningTimeMinutes"] = self.max_running_minutes
        if self.max_restarts:
            body["Settings"] = {"EnableErrorMonitoringInAIMaster": True, "ErrorMonitoringArgs": self.restart_args}
        return body

    def render(self, fmt: str) -> str:
        if fmt == "cli":
            return self.cli() + "\n"
        if fmt == "job_file":
            return self.job_file()
        if fmt == "json":
            return json.dumps(self.body(), indent=2, ensure_ascii=False) + "\n"
        if fmt == "yaml":
            import yaml

            return yaml.safe_dump(self.body(), sort_keys=False, allow_unicode=True, width=120)
        raise ValueError(f"format {fmt!r}; allowed: cli, job_file, json, yaml")


def node_command(preset: Preset, overrides: list[str], code_dir: str) -> str:
    """What every node runs: the thin launcher with the preset (it reads the platform's environment)."""
    args = " ".join(shlex.quote(o) for o in overrides)
    return (f"cd {shlex.quote(code_dir)} && bash {LAUNCHER} --preset {shlex.quote(preset.name)}"
            + (f" {args}" if args else ""))


def dlc_spec(preset: Preset, environ: dict[str, str], overrides: list[str] | None = None, *,
             image: str | None = None, workspace_id: str | None = None, resource_id: str | None = None,
             data_sources: str | None = None, code_dir: str | None = None, name: str | None = None) -> DLCSpec:
    missing: list[str] = []

    def site(value, env_key):
        v = value or environ.get(env_key) or preset.dlc.get(env_key.removeprefix("DLC_").lower())
        if not v:
            missing.append(env_key)
            return f"<{env_key}>"
        return str(v)

    code = code_dir or environ.get("DLC_CODE_DIR") or str(REPO)
    envs = {k: environ[k] for k in FORWARD_ENV if environ.get(k)}
    envs.setdefault("RAY_PORT", environ.get("RAY_PORT", "6379"))
    ds = data_sources or environ.get("DLC_DATA_SOURCES") or ""
    d = preset.dlc
    return DLCSpec(
        name=name or f"dsv3-grpo-{preset.name}".replace("_", "-").lower(),
        command=node_command(preset, overrides or [], code), workers=preset.nodes, gpu=preset.gpus_per_node,
        cpu=int(d.get("worker_cpu", 96)), memory=str(d.get("worker_memory", "1600Gi")),
        shared_memory=str(d.get("worker_shared_memory", "512Gi")), image=site(image, "DLC_IMAGE"),
        workspace_id=site(workspace_id, "DLC_WORKSPACE_ID"), resource_id=site(resource_id, "DLC_RESOURCE_ID"),
        data_sources=[x for x in ds.split(",") if x], envs=envs, priority=int(d.get("priority", 1)),
        max_running_minutes=d.get("max_running_minutes"), gpu_type=d.get("gpu_type"), missing=missing,
        max_restarts=int(preset.run.get("max_restarts", 0) or 0),
    )


def sbatch_command(preset: Preset, overrides: list[str] | None = None) -> str:
    """``sbatch`` line for the preset's node count (the script runs the launcher on every node). With
    ``run.max_restarts`` > 0 the job is ``--requeue``-able and the script requeues a failed run (not a bad-input
    exit 2) while ``SLURM_RESTART_COUNT`` < ``DSV3_MAX_RESTARTS``; the requeued job resumes from the last verified
    checkpoint."""
    s = preset.slurm
    restarts = int(preset.run.get("max_restarts", 0) or 0)
    args = ["sbatch", f"--nodes={preset.nodes}", "--ntasks-per-node=1", f"--job-name=dsv3-{preset.name}"]
    if restarts:
        args.append("--requeue")
    if not preset.is_cpu:
        args.append(f"--gpus-per-node={preset.gpus_per_node}")
    for k, flag in (("partition", "--partition"), ("time", "--time"), ("cpus_per_task", "--cpus-per-task"),
                    ("mem", "--mem"), ("account", "--account"), ("qos", "--qos")):
        if s.get(k):
            args.append(f"{flag}={s[k]}")
    args += [f"--export=ALL,PRESET={preset.name}" + (f",DSV3_MAX_RESTARTS={restarts}" if restarts else ""), SBATCH,
             *(overrides or [])]
    return " ".join(shlex.quote(a) for a in args)
