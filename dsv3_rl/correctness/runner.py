"""Run the suite: reference once, the candidate at every layout (and planted fault), compare, report.

Reference (``reference="hf"``, the default): transformers' DeepseekV3ForCausalLM on the HF
checkpoint, in fp32. Candidate: megatron-core GPTModel from the project's config mapping
(``dsv3_rl.models.config_map``) with weights converted by the project's converter (:mod:`bridge`),
one training step per layout in ``torchrun`` workers (:mod:`worker`); all jobs of one world size
share one launch. ``reference="mcore"`` compares every layout against the single-process megatron
model instead (random weights, no converter): layout plumbing only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from dsv3_rl.correctness import assemble, bridge, compare, data, faults, layouts, report
from dsv3_rl.correctness.compare import Check
from dsv3_rl.correctness.faults import Fault
from dsv3_rl.correctness.layouts import Layout
from dsv3_rl.correctness.report import LayoutResult
from dsv3_rl.correctness.spec import resolve_spec, tf32_off

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass
class Options:
    hf_model_path: str | None = None
    layouts: list = dataclasses.field(default_factory=lambda: list(layouts.CI_LAYOUTS))
    dtype: str = "fp32"
    batch_size: int = 4
    seq_length: int = 32
    micro_batch_size: int = 1
    seed: int = 0
    fault: str | None = None
    reference: str = "hf"
    work: str | None = None
    keep_work: bool = False
    debug: bool = False
    json_out: str | None = None
    weights: str | None = None
    """an already converted megatron dist checkpoint of the HF model (skips the conversion)"""
    preset: str = "tiny"
    """preset of the random mini model written when no hf_model_path is given"""
    preset_overrides: dict = dataclasses.field(default_factory=dict)
    """preset keys to override for that mini model (e.g. num_hidden_layers)"""
    calibrate: bool = False
    """also compare transformers in bf16 against the fp32 reference (bf16's own error, not counted)"""
    spec: str = "auto"
    """megatron layer spec of the candidate: te (Transformer Engine), local, or auto (te where TE imports)"""
    worker_timeout: int = 1800


@dataclasses.dataclass
class Candidate:
    label: str
    layout: Layout
    fault: Fault | None = None


def _worker_env(pythonpath: Path | None, nproc: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")}
    # NVTE_* attention variables megatron wrote into this process's environment for a model built here are not the
    # user's: a worker that inherited them would take them as the user's choice (the MLA guard refused fp32 on TE)
    from dsv3_rl.mcore import mla_attention_guard

    for k, v in mla_attention_guard.MCORE_SET_ENV.items():
        if env.get(k) == v:
            del env[k]
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    repo = str(Path(__file__).resolve().parents[2])
    paths = ([str(pythonpath)] if pythonpath else []) + [repo] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def launch(spec: dict, log_dir: Path, nproc: int, pythonpath: Path | None, timeout: int) -> subprocess.CompletedProcess:
    """One ``torchrun`` (plain python for one process) of :mod:`worker` over ``spec['jobs']``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    spec_path = log_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    if nproc == 1:
        cmd = [sys.executable, "-m", "dsv3_rl.correctness.worker"]
    else:
        # --standalone: torchrun binds its rendezvous port itself (port 0). A port chosen here and bound later by
        # torchrun raced with the launches of other suites run beside this one: on the 4-GPU box (2026-11-26) every
        # job of two lanes died on "EADDRINUSE" (docs/correctness.md)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "dsv3_rl.correctness.worker"]
    cmd += ["--spec", str(spec_path)]
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=_worker_env(pythonpath, nproc), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        so = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        se = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        r = subprocess.CompletedProcess(cmd, 124, so, se + f"\nworker timed out after {timeout}s")
    (log_dir / "worker.log").write_text((r.stdout or "") + "\n--- stderr ---\n" + (r.stderr or ""))
    return r


def _free_gpu() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_error(text: str) -> str:
    """The first line of a worker's output that names an exception or an error (what killed it), else the last
    non-empty line: torchrun's own summary ("ChildFailedError ... error_file: <N/A>") says nothing about why."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    for ln in lines:
        if re.match(r"^(\[rank\d+\]:?\s*)?([\w.]+(Error|Exception|Interrupt)\b|error:)", ln) \
                and "ChildFailedError" not in ln and "warn" not in ln.lower():
            return ln[:400]
    return lines[-1][:400] if lines else "no output"


def _tail(text: str, n: int = 30) -> str:
    lines = [ln for ln in (text or "").splitlines() if "warn" not in ln.lower() and ln.strip()]
    return "\n".join(lines[-n:])


def build_mini_model(out: Path, preset: str, dtype: str, overrides: dict | None = None) -> Path:
    from dsv3_rl.minimodel.mini_model import write_mini_model

    return write_mini_model(preset, out, seed=0, dtype="fp32" if dtype == "fp32" else "bf16", overrides=overrides,
                            overwrite=True)


def init_checkpoint(hf_config, path: Path, dtype: torch.dtype, use_te: bool | None = None) -> None:
    """Random megatron weights (``reference="mcore"``), initialised like any layout would."""
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import layout_check, runtime

    with assemble.single_process_megatron():
        layout_check.save(runtime.build_model(hf_config, Parallel(), dtype=dtype, use_te=use_te), path)


def edit_checkpoint(hf_config, src: Path, dst: Path, dtype: torch.dtype, edit, use_te: bool | None = None) -> list[str]:
    """Copy a megatron dist checkpoint through a single-process model (of the layer spec the workers
    use: the copy holds that spec's tensor names), applying ``edit`` to its full (TP1-named) state dict
    in place; returns the names ``edit`` changed."""
    from dsv3_rl.models.config_map import Parallel
    from dsv3_rl.mcore import layout_check, runtime

    with assemble.single_process_megatron():
        chunks = runtime.build_model(hf_config, Parallel(), dtype=dtype, use_te=use_te)
        layout_check.load(chunks, src)
        sd = chunks[0].state_dict(keep_vars=True)
        with torch.no_grad():
            changed = edit({k: (v.data if isinstance(v, torch.nn.Parameter) else v) for k, v in sd.items()
                            if isinstance(v, torch.Tensor)})
        if dst.exists():
            shutil.rmtree(dst)
        layout_check.save(chunks, dst)
    return changed


def config_check(hf_config, mcore_overrides: dict, dtype: torch.dtype) -> Check:
    from dsv3_rl.models.config_map import Parallel, UnsupportedConfigError, hf_to_mcore_kwargs

    name = "HF config expressible in megatron-core (config_map)"
    try:
        hf_to_mcore_kwargs(hf_config, Parallel(), dtype=dtype, **mcore_overrides)
    except UnsupportedConfigError as e:
        return Check("Config", name, False, detail=f"REFUSED: {e}")
    return Check("Config", name, True)


class Suite:
    """Shared state of one invocation: work dir, HF model, batch, weights, references."""

    def __init__(self, o: Options, out: Callable[[str], None] = print):
        from transformers import AutoConfig

        if o.reference not in ("hf", "mcore"):
            raise ValueError(f"reference {o.reference!r}: allowed hf, mcore")
        if o.dtype not in DTYPES:
            raise ValueError(f"dtype {o.dtype!r}: allowed {', '.join(DTYPES)}")
        self.o, self.out = o, out
        self.spec = resolve_spec(o.spec)
        tf32_off(o.dtype, out)
        self.dtype = DTYPES[o.dtype]
        self.tol = compare.TOLERANCES[o.dtype]
        self.t_start = time.time()
        self.own_work = o.work is None
        self.work = Path(o.work or tempfile.mkdtemp(prefix="dsv3-correctness-"))
        self.work.mkdir(parents=True, exist_ok=True)
        if o.hf_model_path:
            self.hf_path = Path(o.hf_model_path)
        else:
            tag = "".join(f"-{k}{v}" for k, v in sorted(o.preset_overrides.items()))
            self.hf_path = self.work / f"mini-{o.preset}{tag}-{o.dtype}"
            if not (self.hf_path / "config.json").exists():
                out(f"Creating a random {o.preset} DeepSeek-V3 model in {self.hf_path} ...")
                build_mini_model(self.hf_path, o.preset, o.dtype, o.preset_overrides)
        self.AutoConfig = AutoConfig
        self.base_config = AutoConfig.from_pretrained(self.hf_path)
        self.batch = data.make_batch(self.base_config.vocab_size, o.batch_size, o.seq_length, o.seed)
        torch.save(self.batch, self.work / "batch.pt")
        self._weights: dict[str | None, Path] = {}
        self._refs: dict[tuple, tuple] = {}
        self._variants: dict[tuple, Suite] = {}
        self.calibration: list[LayoutResult] = []

    # -- configs, weights, references ------------------------------------------------------------
    def hf_config(self, overrides: dict):
        cfg = self.AutoConfig.from_pretrained(self.hf_path)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return cfg

    def cand_hf_overrides(self, fault: Fault | None) -> dict:
        if not fault or fault.candidate_ignores_hf_overrides:
            return {}
        return dict(fault.hf_config_overrides)

    def weights(self, fault: Fault | None = None) -> Path:
        key = fault.name if fault and fault.weight_edit else None
        if key in self._weights:
            return self._weights[key]
        if key is None:
            o = self.o
            if o.weights:
                w = Path(o.weights)
            elif o.reference == "hf":
                w = self.work / "mcore_ckpt"
                if not (w / "metadata.json").exists():
                    self.out("Converting the HF checkpoint to a megatron dist checkpoint (dsv3_rl.convert) ...")
                    bridge.hf_to_mcore(self.hf_path, w, self.dtype)
            else:
                w = self.work / "mcore_init"
                if not (w / "metadata.json").exists():
                    self.out("Initialising random megatron weights (reference: megatron single process) ...")
                    init_checkpoint(self.base_config, w, self.dtype, use_te=self.spec == "te")
        else:
            w = self.work / f"weights_{fault.name}"
            changed = edit_checkpoint(self.base_config, self.weights(None), w, self.dtype, fault.weight_edit,
                                      use_te=self.spec == "te")
            self.out(f"Planted fault {fault.name}: edited {len(changed)} tensor(s) of the converted checkpoint "
                     f"({', '.join(changed[:4])}{'...' if len(changed) > 4 else ''})")
        self._weights[key] = w
        return w

    def hf_reference(self, overrides: dict) -> tuple:
        key = tuple(sorted(overrides.items()))
        if key not in self._refs:
            from dsv3_rl.correctness.reference import load_hf, run_reference

            dev = "cuda" if torch.cuda.is_available() else "cpu"
            self.out(f"Running the HuggingFace reference (fp32{', ' + str(dict(key)) if key else ''}): forward + backward ...")
            model = load_hf(self.hf_path, torch.float32, overrides, dev)
            self._refs[key] = run_reference(model, self.batch, self.o.micro_batch_size)
            del model
            _free_gpu()
            if self.o.calibrate and not key:
                model = load_hf(self.hf_path, torch.bfloat16, overrides, dev)
                rec, info, grads = run_reference(model, self.batch, self.o.micro_batch_size)
                del model
                _free_gpu()
                ref_rec, ref_info, ref_grads = self._refs[key]
                checks = (compare.compare_records(rec, ref_rec, self.tol) + compare.compare_loss(info, ref_info, self.tol)
                          + compare.compare_grads(grads, ref_grads, self.tol))
                self.calibration.append(LayoutResult("hf_bf16", "transformers in bf16 (calibration, not counted)", checks))
        return self._refs[key]

    # -- candidates --------------------------------------------------------------------------------
    def job(self, cand: Candidate, out_dir: Path) -> dict:
        f = cand.fault
        return dict(out=str(out_dir), weights=str(self.weights(f)), layout=dataclasses.asdict(cand.layout),
                    config_overrides={**dict(cand.layout.config_overrides),
                                      **(dict(f.mcore_config_overrides) if f else {})},
                    hf_config_overrides=self.cand_hf_overrides(f))

    def variant_key(self, lay: Layout) -> tuple:
        """The mini-model variant a layout runs on: () for the suite's own model (always with --hf-model-path)."""
        return () if self.o.hf_model_path else tuple(lay.model_overrides)

    def variant(self, key: tuple) -> Suite:
        """A suite on the variant ``key`` of the random model (its own HF model, conversion and reference),
        in a sub-directory of this one's work dir."""
        if key not in self._variants:
            tag = "".join(f"-{k}{v}" for k, v in key)
            o = dataclasses.replace(self.o, preset_overrides={**self.o.preset_overrides, **dict(key)}, weights=None,
                                    work=str(self.work / f"variant{tag}"), json_out=None, calibrate=False)
            self.out(f"Layouts on a variant of the model ({', '.join(f'{k}={v}' for k, v in key)}): {o.work}")
            self._variants[key] = Suite(o, self.out)
        return self._variants[key]

    def execute(self, cands: list[Candidate], show: bool = True) -> list[LayoutResult]:
        """Run all candidates (grouped per model variant, then into one launch per world size and megatron
        tree) and compare."""
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(cands):
            groups.setdefault(self.variant_key(c.layout), []).append(i)
        if list(groups) == [()]:
            return self._execute(cands, show)
        results: list = [None] * len(cands)
        for key, idx in groups.items():
            suite = self.variant(key) if key else self
            for i, r in zip(idx, suite._execute([cands[i] for i in idx], show), strict=True):
                results[i] = r
        return results

    def _execute(self, cands: list[Candidate], show: bool = True) -> list[LayoutResult]:
        o = self.o
        for c in cands:
            if c.fault and c.fault.needs_te and self.spec != "te":
                raise ValueError(f"planted fault {c.fault.name} needs the Transformer Engine spec (--spec te), "
                                 f"this run is on the {self.spec} spec")
        if o.reference == "mcore" and any(c.fault and c.fault.candidate_ignores_hf_overrides for c in cands):
            raise ValueError("fault rope-interleave-false-unchecked needs the HF reference (reference=hf)")
        pre: dict[int, list[Check]] = {}
        runnable = []
        for i, c in enumerate(cands):
            data.check_divisible(o.batch_size, o.micro_batch_size, c.layout.dp(c.layout.world), where=f"layout {c.layout.name}: ")
            if torch.cuda.is_available() and c.layout.world > torch.cuda.device_count():
                raise ValueError(f"layout {c.layout.name} needs {c.layout.world} GPUs, {torch.cuda.device_count()} visible")
            f = c.fault
            chk = config_check(self.hf_config(self.cand_hf_overrides(f)), dict(f.mcore_config_overrides) if f else {},
                               self.dtype)
            pre[i] = [chk]
            if chk.passed:
                runnable.append(i)
        # planted-fault trees, one per reverted patch
        trees: dict[str, Path] = {}
        for i in runnable:
            f = cands[i].fault
            if f and f.revert_patch and f.revert_patch not in trees:
                trees[f.revert_patch] = faults.tree_without(f.revert_patch, self.work / f"megatron_without_{f.revert_patch[:4]}")
                self.out(f"Planted fault {f.name}: megatron from {trees[f.revert_patch]} ({f.revert_patch} reversed)")
        # launches: (world, tree) -> job indices; the megatron reference rides along with world 1
        groups: dict[tuple, list] = {}
        ref_out = self.work / "reference_tp1"
        if o.reference == "mcore":
            groups[(1, None)] = [("ref", Candidate("reference", layouts.get("tp1")), ref_out)]
        out_dirs = {}
        for i in runnable:
            c = cands[i]
            d = self.work / f"job{i:02d}_{c.label.replace('@', '_at_')}"
            if d.exists():
                shutil.rmtree(d)
            out_dirs[i] = d
            tree = trees.get(c.fault.revert_patch) if c.fault and c.fault.revert_patch else None
            groups.setdefault((c.layout.world, tree), []).append((i, c, d))
        logs: dict = {}
        seconds: dict[int, float] = {}
        for (world, tree), members in groups.items():
            spec = dict(hf_config=str(self.hf_path), batch=str(self.work / "batch.pt"),
                        micro_batch_size=o.micro_batch_size, dtype=o.dtype, use_te=self.spec == "te",
                        jobs=[self.job(c, d) for _, c, d in members])
            names = ", ".join(c.label for _, c, _ in members)
            self.out(f"Running megatron-core ({world} process{'es' if world > 1 else ''}"
                     f"{', tree ' + str(tree) if tree else ''}): {names} ...")
            t0 = time.time()
            r = launch(spec, self.work / f"launch_w{world}_{len(logs)}", world, tree, o.worker_timeout)
            dt = (time.time() - t0) / max(1, len(members))
            for i, _, _ in members:
                logs[i] = r
                seconds[i] = dt
        if o.reference == "mcore":
            r = logs["ref"]
            if not (ref_out / "done.json").exists():
                raise RuntimeError(f"the megatron reference run failed (rc {r.returncode}):\n{_tail(r.stderr)}")
            rec, info = assemble.assemble(ref_out, o.batch_size, o.seq_length)
            self._refs[("mcore",)] = (rec, info, assemble.full_grads(self.base_config, ref_out / "grads",
                                                                     use_te=self.spec == "te"))

        results = []
        for i, c in enumerate(cands):
            t0 = time.time()
            checks = list(pre[i])
            log = ""
            if i in out_dirs:
                d, r = out_dirs[i], logs[i]
                log = _tail((r.stdout or "") + (r.stderr or ""))
                checks += self.compare_job(c, d, r)
                if not o.keep_work:
                    shutil.rmtree(d / "grads", ignore_errors=True)
                    shutil.rmtree(d / "grads_hf", ignore_errors=True)
            res = LayoutResult(c.label, c.layout.describe() + (f" + PLANTED FAULT {c.fault.name}" if c.fault else ""),
                               checks, seconds.get(i, 0.0) + time.time() - t0, log,
                               known_fail=c.layout.known_fail if c.fault is None and c.layout.expected_to_fail(self.spec)
                               else "")
            results.append(res)
            if show:
                self.out(report.format_layout(res, self.reference_name, o.debug))
        return results

    @property
    def reference_name(self) -> str:
        return "HF reference" if self.o.reference == "hf" else "megatron single process"

    def compare_job(self, c: Candidate, d: Path, r: subprocess.CompletedProcess) -> list[Check]:
        o, tol = self.o, self.tol
        if (d / "refused.txt").exists():
            return [Check("Config", "megatron-core builds the model", False, detail=(d / "refused.txt").read_text())]
        if not (d / "done.json").exists():
            return [Check("Layout", f"{report.CRASH_CHECK} ({c.layout.world} processes)", False,
                          detail=f"exit status {r.returncode}; {first_error((r.stdout or '') + (r.stderr or ''))}; "
                                 f"log: {Path(r.args[-1]).parent / 'worker.log' if r.args else ''}")]
        try:
            if o.reference == "hf":
                ref_rec, ref_info, ref_grads = self.hf_reference(dict(c.fault.hf_config_overrides) if c.fault else {})
            else:
                ref_rec, ref_info, ref_grads = self._refs[("mcore",)]
            cand_cfg = self.hf_config(self.cand_hf_overrides(c.fault))
            rec, info = assemble.assemble(d, o.batch_size, o.seq_length)
            if o.reference == "hf":
                grads = bridge.grads_to_hf(d / "grads", d / "grads_hf", self.hf_path)
                grads = {k: v for k, v in grads.items() if k in ref_grads or not k.endswith("e_score_correction_bias")}
            else:
                grads = assemble.full_grads(cand_cfg, d / "grads", use_te=self.spec == "te")
        except (Exception, CheckpointException) as e:  # noqa: BLE001 -- any failure here is this layout's FAIL, named
            return [Check("Layout", "results reassembled and mapped", False,
                          detail=f"{type(e).__name__}: {str(e)[:500]}")]
        checks = []
        if info["world"] > 1:
            checks.append(Check("Layout", "Replicated activations identical across ranks",
                                info["replica_max_diff"] <= tol.act_rel, metric="max diff",
                                value=info["replica_max_diff"], limit=tol.act_rel))
        checks += compare.compare_records(rec, ref_rec, tol)
        checks += compare.compare_loss(info, ref_info, tol)
        checks += compare.compare_grads(grads, ref_grads, tol, per_tensor=o.debug)
        return checks

    # -- the end -------------------------------------------------------------------------------------
    def meta(self, extra: dict | None = None) -> dict:
        from dsv3_rl.models.config_map import moe_layer_pattern

        o, cfg = self.o, self.base_config
        pattern = moe_layer_pattern(cfg)
        backend = (f"NCCL on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
                   else "gloo on CPU")
        return dict(hf_model_path=str(self.hf_path), num_layers=cfg.num_hidden_layers, dense_layers=pattern.count(0),
                    moe_layers=pattern.count(1), hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                    num_experts=getattr(cfg, "n_routed_experts", 0), topk=getattr(cfg, "num_experts_per_tok", 0),
                    n_group=getattr(cfg, "n_group", 1), topk_group=getattr(cfg, "topk_group", 1),
                    batch_size=o.batch_size, seq_length=o.seq_length, micro_batch_size=o.micro_batch_size,
                    dtype=o.dtype, reference=("transformers DeepseekV3ForCausalLM (fp32)" if o.reference == "hf"
                                              else "megatron-core single process (tp1)"),
                    backend=backend, torch=torch.__version__, spec=self.spec, te=self.te_version(), **(extra or {}))

    def te_version(self) -> str | None:
        if self.spec != "te":
            return None
        import transformer_engine

        return transformer_engine.__version__

    def close(self) -> None:
        if self.own_work and not self.o.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)


def _layouts(o: Options) -> list[Layout]:
    return [layouts.get(n) if isinstance(n, str) else n for n in o.layouts]


def run_suite(o: Options, out: Callable[[str], None] = print) -> int:
    """The suite at ``o.layouts`` (with ``o.fault`` planted). Prints the report; returns the exit
    status: 0 overall PASS, 1 FAIL."""
    fault = faults.get(o.fault) if o.fault else None
    lays = _layouts(o)
    if fault and fault.needs_te and resolve_spec(o.spec) != "te":
        raise ValueError(f"planted fault {fault.name} needs the Transformer Engine spec (--spec te)")
    if fault and fault.layout and fault.layout not in [lay.name for lay in lays]:
        lays.append(layouts.get(fault.layout))
    elif fault and fault.needs_tp and not any(lay.tp > 1 for lay in lays):
        lays.append(layouts.get("tp2_sp"))
    suite = Suite(o, out)
    try:
        meta = suite.meta(dict(layouts=[lay.name for lay in lays], fault=fault.name if fault else None,
                               fault_description=fault.description if fault else None))
        out(report.format_header(meta, suite.tol))
        results = suite.execute([Candidate(lay.name, lay, fault) for lay in lays])
        for c in suite.calibration:
            out(report.format_layout(c, suite.reference_name, o.debug))
        out(report.format_summary(results))
        overall = report.overall(results)
        out(f"correctness (spec {suite.spec}, {o.dtype}): {len(results)} layout(s), {sum(len(r.checks) for r in results)} "
            f"checks, {sum(not c.passed for r in results for c in r.checks)} failed, {time.time() - suite.t_start:.1f} s: "
            f"{report.verdict(results)}")
        if o.json_out:
            report.write_json(Path(o.json_out), meta, suite.tol, results + suite.calibration)
        return 0 if overall else 1
    finally:
        suite.close()


def fault_candidates(o: Options, names: list[str], spec: str, each_layout: bool = False) -> list[Candidate]:
    """The runs of :func:`run_fault_matrix`: the clean twins first, then every fault where it is planted."""
    base = _layouts(o)[0] if o.layouts else layouts.get("tp1")
    tp_layout = base if base.tp > 1 else layouts.get("tp2_sp")

    every = _layouts(o) if each_layout and o.layouts else [base]
    # with each_layout, faults go where the clean run is expected to PASS (a documented failure fails anyway)
    # and where the model has what they break (MoE faults skip all-dense model variants)
    plantable = [lay for lay in every if not lay.expected_to_fail(spec)] if each_layout else every

    def where(f: Fault) -> list[Layout]:
        if f.layout:
            return [layouts.get(f.layout)]
        fit = [lay for lay in plantable if not (f.needs_moe and lay.dense_model)]
        if f.needs_tp:
            return [lay for lay in fit if lay.tp > 1] or [tp_layout]
        return fit

    cands = [Candidate(f"clean@{lay.name}", lay)
             for lay in dict.fromkeys(every + [lay for n in names for lay in where(faults.get(n))])]
    for n in names:
        f = faults.get(n)
        cands += [Candidate(f"{n}@{lay.name}", lay, f) for lay in where(f)]
    return cands


def run_fault_matrix(o: Options, fault_names: list[str] | None = None, out: Callable[[str], None] = print,
                     each_layout: bool = False) -> int:
    """Clean run + every planted fault (each at ``o.layouts[0]``, a TP>1 layout for TP faults, a fault's own
    layout where it names one; with ``each_layout`` at every layout of ``o.layouts``, TP faults at those with
    TP > 1): exit 0 iff every clean run PASSes (or fails as documented: XFAIL) and every fault FAILs."""
    spec = resolve_spec(o.spec)
    names = fault_names or [n for n in faults.FAULTS
                            if (o.reference == "hf" or not faults.FAULTS[n].candidate_ignores_hf_overrides)
                            and (spec == "te" or not faults.FAULTS[n].needs_te)]
    for n in names:
        if faults.get(n).needs_te and spec != "te":
            raise ValueError(f"planted fault {n} needs the Transformer Engine spec (--spec te): on the {spec} spec "
                             f"the patch it reverts changes nothing")
    cands = fault_candidates(o, names, spec, each_layout)
    suite = Suite(o, out)
    try:
        meta = suite.meta(dict(layouts=sorted({c.layout.name for c in cands}), fault="matrix",
                               fault_description=", ".join(names)))
        out(report.format_header(meta, suite.tol))
        results = suite.execute(cands, show=o.debug)
        rows = []
        ok_all = True
        for c, r in zip(cands, results, strict=True):
            expect = "FAIL" if c.fault else ("XFAIL" if r.known_fail else "PASS")
            got = r.status
            failing = [ch for ch in r.checks if not ch.passed]
            # a planted fault is caught by a failing check, not by a run that crashed before comparing anything
            ok = (not r.passed and not r.crashed) if c.fault else r.ok
            ok_all &= ok
            what = "; ".join(ch.name for ch in failing[:3]) + (f" (+{len(failing) - 3} more)" if len(failing) > 3 else "")
            rows.append((c.label, expect, got, len(failing), "ok" if ok else "WRONG", what))
        w = max(len(r[0]) for r in rows)
        out("============= Planted faults =============")
        out(f"{'run':<{w}}  expect  result  failed checks  verdict  first failing checks")
        for label, expect, got, nfail, verdict, what in rows:
            out(f"{label:<{w}}  {expect:<6}  {got:<6}  {nfail:>13}  {verdict:<7}  {what}")
        out("")
        out("============= Overall Result =============")
        out("PASS" if ok_all else "FAIL")
        out(f"correctness faults (spec {suite.spec}, {o.dtype}): {len(cands) - sum(c.fault is not None for c in cands)} "
            f"clean run(s), {sum(c.fault is not None for c in cands)} with a planted fault ({len(names)} kind(s)), "
            f"{time.time() - suite.t_start:.1f} s: {'every fault caught' if ok_all else 'NOT every fault caught'}")
        if o.json_out:
            report.write_json(Path(o.json_out), meta, suite.tol, results)
        return 0 if ok_all else 1
    finally:
        suite.close()


__all__ = ["Options", "Candidate", "Suite", "run_suite", "run_fault_matrix"]
