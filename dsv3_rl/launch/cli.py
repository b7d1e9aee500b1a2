"""``python -m dsv3_rl.launch`` (console script ``dsv3-launch``): checkpoint -> GRPO from a named preset.

    dsv3-launch [run] --preset NAME [--dry-run] [--stages-only | --skip-stages] [verl overrides ...]
    dsv3-launch check --preset NAME [overrides]   the self-checks, plots and summary of a finished run again
    dsv3-launch list [--markdown]                 the presets, with their parallel sizes
    dsv3-launch show --preset NAME                the preset's files, merged, as verl overrides
    dsv3-launch check-all                         dry-run every preset (CI)
    dsv3-launch dlc --preset NAME [--format cli|job_file|json|yaml] [--out FILE] [--image ...]
    dsv3-launch slurm --preset NAME               the sbatch line for the preset
    dsv3-launch platform                          what the environment says about this node

``run`` is the default command. ``--preset`` defaults to ``$PRESET``; ``--dry-run`` to ``$DRY_RUN``.
Everything that is not a launcher option is a verl/Hydra override (``data.train_batch_size=64``,
``+actor_rollout_ref.actor.megatron.override_transformer_config.moe_enable_deepep=true``).

Exit status: 0 ok, 1 checks failed (nothing started) or the run failed, 2 bad input or a stage / Ray cluster error.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from dsv3_rl.cliargs import add_out
from dsv3_rl.errors import cli_main, env_flag
from dsv3_rl.recipes.presets import PresetError, list_presets, load_preset
from dsv3_rl.fs import write_text_atomic

COMMANDS = ("run", "check", "list", "show", "check-all", "dlc", "slurm", "platform")


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv3-launch run", add_help=True,
                                description="Resolve, validate and run a preset (any other argument is a verl override).")
    p.add_argument("--preset", default=os.environ.get("PRESET"), help="preset name or YAML file (default $PRESET)")
    p.add_argument("--dry-run", action="store_true", default=env_flag("DRY_RUN"),
                   help="resolve and validate everything, print the command, start nothing (also DRY_RUN=1; "
                        "an unrecognised DRY_RUN value is refused)")
    p.add_argument("--allow-missing", action="store_true",
                   help="dry run: missing checkpoint/dataset paths are warnings, not errors")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--stages-only", action="store_true", help="run the pipeline stages (cast, convert, data), not training")
    g.add_argument("--skip-stages", action="store_true", help="go straight to training (outputs must exist)")
    p.add_argument("--join-timeout", type=float, default=float(os.environ.get("RAY_JOIN_TIMEOUT", 1800)),
                   help="multi-node: seconds for all nodes to join Ray (default 1800, $RAY_JOIN_TIMEOUT)")
    p.add_argument("--quiet", action="store_true", help="summary only, not the full command")
    from dsv3_rl.launch.stages import STAGE_NAMES

    p.add_argument("--force-stage", action="append", default=[], metavar="STAGE", choices=STAGE_NAMES,
                   help="rerun this stage even if its output verifies, passing the tool its --force "
                        f"(repeatable; stages: {', '.join(STAGE_NAMES)})")
    return p


def refuse_repeated_overrides(overrides: list[str]) -> None:
    """The same override key twice (``a.b=1 a.b=2``) is refused, naming the key: Hydra would take the last."""
    seen: dict[str, str] = {}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in seen:
            raise PresetError(f"override {key!r} is given twice ({seen[key]!r} and {o!r}); give it once")
        seen[key] = o


def _force_stages(launch, names: list[str]) -> None:
    by_name = {st.name: st for st in launch.stages}
    for n in names:
        if n not in by_name:
            raise PresetError(f"--force-stage {n!r}: no such stage in this run (stages: {', '.join(by_name)})")
        status, why = by_name[n].status()
        if status == "skip":
            ran = [k for k, st in by_name.items() if st.status()[0] != "skip"]
            raise PresetError(f"--force-stage {n!r}: this run does not use that stage ({why}); stages it runs: "
                              f"{', '.join(ran)}")
        by_name[n].force()


def _pools_text(launch, s, pool: tuple[int, int] | None) -> str:
    """Where verl puts trainer and rollout (POOL: its standalone rollout pool, :func:`dsv3_rl.launch.checks.
    rollout_pool`), and how the weights reach the rollout (the refit manifest's coverage)."""
    from dsv3_rl.launch.verl_config import select
    from dsv3_rl.recipes.algorithms import MANIFEST_ENGINES
    from dsv3_rl.refit import manifest

    unit = "CPU process(es)" if launch.preset.is_cpu else "GPU(s)"
    try:
        on = manifest.enabled()  # DSV3_REFIT_MANIFEST of this environment (the env files never set it)
    except Exception as e:  # noqa: BLE001  (an unknown DSV3_REFIT_MANIFEST word: the run refuses it, say so here)
        on = None
        state = f"refit manifest: {e}"
    if pool is None:
        if on is not None:
            state = f"refit manifest {'on' if on else 'off (DSV3_REFIT_MANIFEST)'} (patch 0031)"
        return (f"colocated (hybrid engine): trainer and rollout share {s.nnodes} x {s.gpus_per_node} {unit}; weights -> "
                f"vLLM: verl's bucketed sync, {state}")
    be = select(launch.cfg, "actor_rollout_ref.rollout.checkpoint_engine.backend")
    if on is not None:
        patch = MANIFEST_ENGINES.get(str(be))
        state = (f"refit manifest {'on' if on else 'off (DSV3_REFIT_MANIFEST)'} ({patch})" if patch else
                 f"no refit manifest (carried by {', '.join(f'{k} ({v})' for k, v in MANIFEST_ENGINES.items())})")
    return (f"separate: trainer_pool {s.nnodes} x {s.gpus_per_node} {unit} | rollout {pool[0]} x {pool[1]} {unit} (verl's standalone "
            f"rollout pool); weights trainer -> rollout: checkpoint engine {be}, {state}")


def _print_launch(launch, *, out=None, full: bool = True) -> None:
    from dsv3_rl.verl_glue.overrides import shell_join

    # sys.stdout at call time, not at import (a default bound at import keeps a replaced stream)
    pr = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    ps = launch.preset
    chain = " <- ".join(p.name for p in reversed(ps.files))
    pr(f"preset     {ps.name}: {ps.description}")
    pr(f"           files: {chain} (in {ps.path.parent})")
    mc = launch.model_cfg
    pr(f"model      {ps.model}: {mc.get('num_hidden_layers')} layers, {mc.get('n_routed_experts')} experts "
       f"(top-{mc.get('num_experts_per_tok')}, {mc.get('n_group')} groups / top-{mc.get('topk_group')}), "
       f"{mc.get('num_attention_heads')} heads  [{launch.model_src}]")
    s = launch.sizes
    pr(f"hardware   {ps.hardware_name} ({ps.nodes} node{'s' if ps.nodes > 1 else ''} x {ps.gpus_per_node}"
       f"{' CPU processes' if ps.is_cpu else ' ' + ps.hardware['gpu']})")
    pr(f"mode       trainer_mode={ps.trainer_mode} algorithm={ps.algorithm} rollout_correction={ps.rollout_correction}"
       + (f" off_policy={ps.off_policy}" if ps.off_policy else "") + "  (docs/algorithms.md)")
    if s is not None:
        from dsv3_rl.launch.verl_config import select

        otc = select(launch.cfg, "actor_rollout_ref.actor.megatron.override_transformer_config") or {}
        rc = otc.get("recompute_granularity") or "none"
        if rc == "selective":
            rc += "[" + ",".join(otc.get("recompute_modules") or []) + "]"
        dtype = select(launch.cfg, "actor_rollout_ref.actor.megatron.dtype")
        pr(f"trainer    megatron {s.short()} recompute={rc} dtype={dtype}")
        util = select(launch.cfg, "actor_rollout_ref.rollout.gpu_memory_utilization")
        inst = s.rollout_tp * s.rollout_dp * s.rollout_pp
        from dsv3_rl.launch.checks import rollout_pool

        pool = rollout_pool(launch.cfg)
        ro_world = pool[0] * pool[1] if pool else s.world
        pr(f"rollout    {select(launch.cfg, 'actor_rollout_ref.rollout.name')} {s.rollout_short()} "
           f"({ro_world // inst if inst and ro_world % inst == 0 else '?'} engine(s)), gpu_memory_utilization={util}")
        pr(f"pools      {_pools_text(launch, s, pool)}")
    pr("paths")
    for k, v in launch.paths.items():
        pr(f"  {k:<11} {v}{'' if Path(v).exists() else '  (not there yet)'}")
    if launch.env:
        pr("environment (added)")
        for k in sorted(launch.env):
            pr(f"  {k}={launch.env[k]}")
    pr("stages")
    for st in launch.stages:
        status, detail = st.status()
        cmd = " ".join(st.argv[2:]) if st.argv and status == "run" else ""
        pr(f"  {st.name:<10} {status:<5} {detail}" + (f"\n             $ python -m {cmd.removeprefix('-m ')}" if cmd else ""))
    for n in launch.notes:
        pr(f"note       {n}")
    pr("checks")
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(launch.findings, key=lambda f: order.get(f.level, 3)):
        pr(f"  {f}")
    if not launch.findings:
        pr("  (none)")
    if full:
        pr("command")
        pr("  " + shell_join(launch.argv).replace("\n", "\n  "))


def _resolve_or_die(preset: str, overrides: list[str], *, allow_missing: bool = False):
    from dsv3_rl.launch.run import resolve

    launch = resolve(preset, overrides)  # PresetError / VerlConfigError: one line, exit 2 (cli_main)
    if allow_missing:
        from dsv3_rl.launch.checks import Finding

        launch.findings = [Finding("warning", f.check, f.message) if f.check.startswith("stage:") and f.level == "error"
                           else f for f in launch.findings]
    return launch


def cmd_run(argv: list[str]) -> int:
    p = _run_parser()
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if a.startswith("-")]
    if bad:
        p.error(f"unknown launcher option(s) {bad}; verl overrides look like key=value (see --help)")
    if not args.preset:
        raise PresetError(f"no preset: pass --preset NAME or set PRESET (presets: {', '.join(list_presets())})")
    refuse_repeated_overrides(rest)
    t0 = time.monotonic()
    launch = _resolve_or_die(args.preset, rest, allow_missing=args.allow_missing and args.dry_run)
    _force_stages(launch, args.force_stage)
    launch.findings += here_findings(launch, dry_run=args.dry_run)
    _print_launch(launch, full=not args.quiet)
    n_err = len(launch.errors)
    n_warn = sum(f.level == "warning" for f in launch.findings)
    if args.dry_run:
        verdict = "OK" if not n_err else f"FAILED: {n_err} error(s)"
        print(f"dry run {launch.preset.name}: {verdict}, {n_warn} warning(s); nothing started ({time.monotonic() - t0:.1f}s)")
        return 1 if n_err else 0
    if n_err:
        print(f"refusing to start {launch.preset.name}: {n_err} error(s) above (run with --dry-run to iterate)",
              file=sys.stderr)
        return 1
    return execute(launch, stages_only=args.stages_only, skip_stages=args.skip_stages, join_timeout=args.join_timeout)


def here_findings(launch, *, dry_run: bool) -> list:
    """What this machine and this WORK_DIR say about the run: a GPU preset where no GPU is visible (refused; the dry
    run warns, so that GPU presets still dry-run on a CPU box), a GPU preset whose host-memory estimate passes this
    machine's MemTotal x RAY_memory_usage_threshold (refused; info in the dry run), and checkpoints of another run in
    CKPT_DIR."""
    from dsv3_rl.launch import platform, workdir
    from dsv3_rl.launch.checks import Finding

    out = []
    if not launch.preset.is_cpu:
        n = platform.local_gpus()
        if n == 0:
            msg = (f"preset {launch.preset.name} needs {launch.preset.hardware['gpu']} GPUs "
                   f"({launch.preset.hardware_name}) and this machine has none visible (torch.cuda.device_count() "
                   f"== 0): a run here is refused before anything starts (Ray would wait for ever for GPU slots)")
            out.append(Finding("warning" if dry_run else "error", "hardware", msg))
    if not launch.preset.is_cpu:  # host RAM: the trainer's offloaded state + the other processes vs Ray's kill line
        from dsv3_rl.launch.checks import host_memory_check

        out += host_memory_check(launch, platform.mem_total_bytes(), platform.ray_memory_threshold(launch.full_env()),
                                 dry_run=dry_run)
    why = workdir.identity_mismatch(launch)
    if why:
        out.append(Finding("error", "run_dir", why))
    return out


def _ray_init(cfg) -> dict:
    """The composed ``ray_kwargs.ray_init`` as a plain dict ({} where the config has none)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "ray_kwargs.ray_init", default=None) if cfg is not None else None
    return dict(OmegaConf.to_container(node, resolve=True)) if node is not None else {}


def after_head(launch, rc: int) -> int:
    """Node 0 after main_ppo returned RC: the run's checks, plots, report.json and summary line, as one node ends
    (``train.check_finished``); a failed main_ppo keeps its exit status."""
    if rc != 0 or launch.preset.checks is None:
        return rc
    from dsv3_rl.launch.train import check_finished

    return check_finished(launch)


def execute(launch, *, stages_only: bool = False, skip_stages: bool = False, join_timeout: float = 1800.0) -> int:
    """Run the stages and the training command here, or as one node of a multi-node Ray cluster."""
    from dsv3_rl.launch import platform, ray_cluster

    env = launch.full_env()
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "10")
    # A cluster we bring up uses token auth only when the job shares a token; otherwise it is off
    # (Ray >= 2.5x enables it by default, but a token made on one node is unknown to the others).
    if "RAY_AUTH_MODE" not in env:
        env["RAY_AUTH_MODE"] = "token" if env.get("RAY_AUTH_TOKEN") else "disabled"
    info = platform.parse(env)
    nnodes = launch.sizes.nnodes
    print(f"platform   {info.describe()}")
    if info.nnodes != nnodes:
        raise platform.PlatformError(
            f"the job has {info.nnodes} node(s) ({info.platform}) but the run needs trainer.nnodes={nnodes} "
            f"({launch.preset.hardware_name}); submit with {nnodes} nodes or override trainer.nnodes")
    if info.gpus_per_node is not None and not launch.preset.is_cpu and info.gpus_per_node != launch.sizes.gpus_per_node:
        raise platform.PlatformError(f"this node has {info.gpus_per_node} GPUs ({', '.join(info.sources)}) but the run "
                                     f"needs trainer.n_gpus_per_node={launch.sizes.gpus_per_node}")

    def run_stages():
        if skip_stages:
            print("[stages] skipped (--skip-stages)")
            return
        for st in launch.stages:
            st.run(env)

    def _term(signum, frame):
        raise SystemExit(128 + signum)  # unwinds through `finally`: Ray nodes are stopped

    old_term = signal.signal(signal.SIGTERM, _term)
    ray_env = {k: v for k, v in env.items() if k.startswith("RAY_")}  # for this process's own ray.init
    old_env = {k: os.environ.get(k) for k in ray_env}
    os.environ.update(ray_env)
    log_dir = launch.paths.logs / "ray"
    try:
        if nnodes == 1:
            run_stages()
            if stages_only:
                return 0
            print(f"[train] {' '.join(launch.argv[:4])} ... ({len(launch.argv) - 4} overrides)")
            from dsv3_rl.launch.train import run_single_node

            signal.signal(signal.SIGTERM, old_term)  # the watched run handles SIGINT/SIGTERM itself
            return run_single_node(launch, env)
        gpus = None if launch.preset.is_cpu else launch.sizes.gpus_per_node
        port = info.ray_port
        # main_ppo joins our cluster (RAY_ADDRESS): what its ray.init would declare, every node's `ray start` does
        command, node = ray_cluster.cluster_job(launch.argv, _ray_init(launch.cfg),
                                                cpu_slots=launch.sizes.gpus_per_node if launch.preset.is_cpu else None,
                                                job_env=env)
        if gpus is not None:
            node["num_gpus"] = gpus
        if info.is_head:
            if not stages_only and str(launch.cfg.trainer.get("resume_mode", "auto")) != "disable":
                from dsv3_rl.launch import ckpt  # the same verification as one node; the scheduler restarts the job

                keep = launch.cfg.trainer.get("max_actor_ckpt_to_keep")
                ckpt.prepare_resume(launch.paths.ckpt, keep=keep if isinstance(keep, int) else None,
                                    mode=str(launch.preset.run.get("verify_checkpoints", "digests")))
            spec = ray_cluster.RayNodeSpec(head=True, port=port, head_addr=info.head_addr,
                                           node_ip=env.get("RAY_NODE_IP"), **node)
            if stages_only:
                run_stages()
                return 0
            timeouts = ray_cluster.Timeouts(join=join_timeout)
            rc = ray_cluster.run_head(spec, nnodes, env, run_stages, command, timeouts,
                                      log_path=log_dir / "head.log")
            return after_head(launch, rc)
        head = ray_cluster.resolve_host(info.head_addr)
        spec = ray_cluster.RayNodeSpec(head=False, port=port, head_addr=head, node_ip=env.get("RAY_NODE_IP"), **node)
        if stages_only:
            return 0
        return ray_cluster.run_worker(spec, env, ray_cluster.Timeouts(join=join_timeout),
                                      log_path=log_dir / f"worker-{info.node_rank}.log")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------------------------- listing


def preset_rows() -> list[dict]:
    """One row per preset: model, hardware, trainer and rollout sizes (from the preset files)."""
    from dsv3_rl.recipes.algorithms import rollout_world as world_of_rollout, trainer_world

    rows = []
    for name in list_presets():
        p = load_preset(name)
        lay, ro = p.layout, dict(p.rollout)
        tp, pp, cp = int(lay.get("tp", 1)), int(lay.get("pp", 1)), int(lay.get("cp", 1))
        world = trainer_world(p)  # off-policy trainer modes: the hardware minus the rollout's pool
        dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else "?"
        trainer = f"TP{tp} PP{pp} EP{lay.get('ep', 1)}" + (f" ETP{lay['etp']}" if "etp" in lay else "") + f" DP{dp}"
        if lay.get("first_stage_layers") or lay.get("last_stage_layers"):
            trainer += f", first/last {lay.get('first_stage_layers', '-')}/{lay.get('last_stage_layers', '-')}"
        if lay.get("pipeline_layout"):
            trainer += f", layout `{lay['pipeline_layout']}`"
        opt = (((p.verl.get("actor_rollout_ref") or {}).get("actor") or {}).get("optim") or {})
        if (opt.get("override_optimizer_config") or {}).get("optimizer_cpu_offload"):
            trainer += " (CPU optimizer)"
        rc = lay.get("recompute", "none")
        if rc == "selective":
            rc = "sel: " + ",".join(lay.get("recompute_modules") or ["core_attn"])
        rollout = (f"TP{ro.get('tp', '?')}" + (f" DP{ro['dp']}" if (ro.get("dp") or 1) > 1 else "")
                   + (f" EP{ro['ep']}" if (ro.get("ep") or 1) > 1 else ""))
        if "gpu_memory_utilization" in ro:
            rollout += f" @{ro['gpu_memory_utilization']}"
        if p.rollout_quantization != "none":  # rollout_quantization: fp8 (dsv3_rl/recipes/rollout_quantization.py)
            rollout += f", {p.rollout_quantization.upper()} weights"
        if p.trainer_mode != "sync" or p.algorithm != "grpo":  # dsv3_rl/recipes/algorithms.py
            trainer += f" [{p.trainer_mode}, {p.algorithm}]"
            if p.off_policy:
                rollout += f" on {world_of_rollout(p)} separate"
        hardware = p.hardware_name
        if p.is_cpu:
            hardware += f" ({p.gpus_per_node} processes)"
        elif p.nodes > 1:
            hardware += f" ({p.nodes} nodes)"
        rows.append(dict(preset=name, model=p.model, hardware=hardware, trainer=trainer, recompute=rc,
                         rollout=rollout, description=p.description))
    return rows


def cmd_check(argv: list[str]) -> int:
    from dsv3_rl.launch.train import check_finished

    p = argparse.ArgumentParser(prog="dsv3-launch check", description="Self-checks, plots and summary of a finished "
                                "run, read from its LOG_DIR / CKPT_DIR (same preset, environment and overrides).")
    p.add_argument("--preset", default=os.environ.get("PRESET"), help="preset name or YAML file (default $PRESET)")
    args, rest = p.parse_known_args(argv)
    if not args.preset:
        raise PresetError("no preset: pass --preset NAME or set PRESET")
    launch = _resolve_or_die_novalidate(args.preset, rest)
    return check_finished(launch)  # a missing or unreadable run output: CheckError, one line, exit 2


def cmd_list(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dsv3-launch list")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    rows = preset_rows()
    cols = ("preset", "model", "hardware", "trainer", "recompute", "rollout")
    if args.markdown:
        head = {"trainer": "trainer (megatron)", "rollout": "rollout (vLLM) @ gpu_memory_utilization"}
        print("| " + " | ".join(head.get(c, c) for c in cols) + " |")
        print("|" + "|".join("---" for _ in cols) + "|")
        for r in rows:
            print("| " + " | ".join(f"`{r[c]}`" if c == "preset" else str(r[c]).replace("|", "\\|") for c in cols) + " |")
        return 0
    w = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(w[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w[c]) for c in cols))
    return 0


def cmd_show(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dsv3-launch show")
    p.add_argument("--preset", default=os.environ.get("PRESET"), required=os.environ.get("PRESET") is None)
    args, rest = p.parse_known_args(argv)
    launch = _resolve_or_die_novalidate(args.preset, rest)
    for o in launch.overrides + launch.user:
        print(o)
    return 0


def _resolve_or_die_novalidate(preset, overrides):
    from dsv3_rl.launch.run import resolve

    return resolve(preset, overrides, validate=False)


def cmd_check_all(argv: list[str]) -> int:
    """Dry-run every preset in one process (verl imported once). Exit 1 if any has errors."""
    p = argparse.ArgumentParser(prog="dsv3-launch check-all")
    p.add_argument("--allow-missing", action="store_true")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    failed = []
    for name in list_presets():
        launch = _resolve_or_die(name, [], allow_missing=args.allow_missing)
        if args.verbose:
            _print_launch(launch, full=False)
        errs = launch.errors
        warns = [f for f in launch.findings if f.level == "warning"]
        print(f"{name:<16} {'OK ' if not errs else 'FAIL'} {launch.sizes.short() if launch.sizes else ''} "
              f"| {len(errs)} error(s), {len(warns)} warning(s)")
        for f in errs + warns:
            print(f"    {f}")
        if errs:
            failed.append(name)
    print(f"check-all: {len(list_presets()) - len(failed)}/{len(list_presets())} presets dry-run clean"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_dlc(argv: list[str]) -> int:
    from dsv3_rl.launch.specs import dlc_spec

    p = argparse.ArgumentParser(prog="dsv3-launch dlc", description="PAI-DLC job spec for a preset")
    p.add_argument("--preset", default=os.environ.get("PRESET"))
    p.add_argument("--format", default="cli", choices=("cli", "job_file", "json", "yaml"))
    add_out(p, "-o", help="write here (atomically) instead of stdout")
    for k in ("image", "workspace-id", "resource-id", "data-sources", "code-dir", "name"):
        p.add_argument(f"--{k}")
    args, rest = p.parse_known_args(argv)
    if not args.preset:
        p.error("--preset (or $PRESET) is required")
    preset = load_preset(args.preset)
    spec = dlc_spec(preset, dict(os.environ), rest, image=args.image, workspace_id=args.workspace_id,
                    resource_id=args.resource_id, data_sources=args.data_sources, code_dir=args.code_dir, name=args.name)
    text = spec.render(args.format)
    if args.out:
        out = Path(args.out)
        write_text_atomic(out, text)
        print(f"wrote {out} ({args.format}, {spec.workers} workers x {spec.gpu} GPUs)")
    else:
        sys.stdout.write(text)
    if spec.missing:
        print(f"warning: set {', '.join(spec.missing)} (or the matching --option) before submitting", file=sys.stderr)
    return 0


def cmd_slurm(argv: list[str]) -> int:
    from dsv3_rl.launch.specs import sbatch_command

    p = argparse.ArgumentParser(prog="dsv3-launch slurm", description="sbatch line for a preset")
    p.add_argument("--preset", default=os.environ.get("PRESET"))
    args, rest = p.parse_known_args(argv)
    if not args.preset:
        p.error("--preset (or $PRESET) is required")
    print(sbatch_command(load_preset(args.preset), rest))
    return 0


def cmd_platform(argv: list[str]) -> int:
    from dsv3_rl.launch import platform

    print(platform.parse(dict(os.environ)).describe())
    return 0


#: warnings the launcher's own process triggers while it validates a preset, each harmless and explained in
#: docs/grpo-demo.md ("Known-harmless log lines"); they stay in main_ppo's log, not on the console
KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # megatron-core imported without TE/Apex (CPU)
    "Disabled critic as algorithm.adv_estimator",  # verl: GRPO has no critic
    "rollout on the CPU platform",  # our CPU patch turns vLLM sleep mode off
)


def quiet_known_warnings() -> None:
    import logging
    import warnings

    for msg in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{msg}")
    logging.getLogger("verl").setLevel(logging.WARNING)


@cli_main(interrupted='Ray nodes started by this run are stopped; finished stages are kept, rerun to resume')
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: dsv3-launch [{'|'.join(COMMANDS)}] [options] [verl overrides]\n\n{__doc__}")
        return 0
    cmd = "run"
    if argv and argv[0] in COMMANDS:
        cmd, argv = argv[0], argv[1:]
    if "--list" in argv and cmd == "run":
        return cmd_list([])
    fn = {"run": cmd_run, "check": cmd_check, "list": cmd_list, "show": cmd_show, "check-all": cmd_check_all, "dlc": cmd_dlc,
          "slurm": cmd_slurm, "platform": cmd_platform}[cmd]
    quiet_known_warnings()
    return fn(argv)  # PresetError and the other Dsv3Errors: one line, exit 2 (cli_main)


if __name__ == "__main__":
    sys.exit(main())
