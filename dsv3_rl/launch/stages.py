"""Pipeline stages before training, each skipped when its verified output exists.

=========  ==========================================================================================
weights    synthetic presets (tiny, proxy): ``python -m dsv3_rl.minimodel.mini_model --model MODEL --out OUT``
fp8_cast   FP8 release -> BF16: ``python -m dsv3_rl.checkpoint.fp8 cast IN --out OUT``; done when the tool's
           manifest (``dsv3_manifest.json``) says complete for this input
hf_config  config.json fix-ups (quantization_config, MTP, topk_method, ...):
           ``python -m dsv3_rl.checkpoint.hf_config DIR``; done when ``--check`` finds nothing to change and the
           tokenizer has config.json's vocab_size entries (shorter: an error for synthetic weights, else an info)
convert    HF -> megatron-core dist checkpoint: ``python -m dsv3_rl.convert hf-to-mcore --hf-dir HF --out MCORE``
           (``CONVERT_NPROC=N``: under torchrun); done when its ``dsv3_manifest.json`` says complete for this
           source. verl then loads it with ``use_dist_checkpointing``
data       dataset -> verl RL parquet: ``python -m dsv3_rl.data.<dataset> --input-dir RAW --out OUT``
=========  ==========================================================================================

A stage that the launcher ran leaves ``.dsv3-launch-<stage>.json`` in its output directory: the exact
command, and size + mtime of its inputs. The stage counts as done only when its outputs exist, the
stage's own verification passes, and the marker matches the command it would run now (a changed input
or option reruns it; the tools themselves resume and write atomically).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable
from dsv3_rl.errors import Dsv3Error

from dsv3_rl.checkpoint.outputs import CONVERT_TOOL, FP8_TOOL, MANIFEST, read_manifest
from dsv3_rl.fs import write_json_atomic


@dataclasses.dataclass
class Stage:
    name: str
    needed: bool
    why: str
    argv: list[str]
    out_dir: Path | None
    outputs: list[Path]
    inputs: list[Path]
    verify: Callable[[], tuple[bool, str]] | None = None
    error: str | None = None
    """set when the stage cannot run (missing input, missing tool): the message says what to do"""
    ran: bool = False
    force_flag: str | None = None
    """the tool's flag to replace a previous output (``--force``, docs/cli.md), added when forced"""
    forced: bool = False

    def force(self) -> None:
        """Rerun even when the output verifies (``dsv3-launch --force-stage NAME``)."""
        self.forced = True

    @property
    def run_argv(self) -> list[str]:
        """The command run: ``argv`` plus the tool's force flag when forced (the marker records ``argv``)."""
        return self.argv + ([self.force_flag] if self.forced and self.force_flag else [])

    @property
    def marker(self) -> Path | None:
        return self.out_dir / f".dsv3-launch-{self.name}.json" if self.out_dir else None

    def signature(self) -> dict:
        sig = {}
        for p in self.inputs:
            p = Path(p)
            if p.is_file():
                st = p.stat()
                sig[str(p)] = [st.st_size, st.st_mtime_ns]
        return {"command": self.argv, "inputs": sig}

    def status(self) -> tuple[str, str]:
        """('skip'|'done'|'run'|'error', detail)."""
        if not self.needed:
            return "skip", self.why
        if self.error:
            return "error", self.error
        if self.forced:
            return "run", "forced (--force-stage)"
        missing = [str(p) for p in self.outputs if not Path(p).exists()]
        if missing:
            return "run", f"output missing: {missing[0]}"
        if self.verify is not None:
            ok, detail = self.verify()
            if not ok:
                return "run", detail
            if self.marker is None or not self.marker.is_file():
                return "done", f"verified ({detail})"
        if self.marker is not None:
            if not self.marker.is_file():
                return "run", f"no marker {self.marker.name} (output not made by this launcher)"
            try:
                rec = json.loads(self.marker.read_text())
            except (OSError, json.JSONDecodeError):
                return "run", f"unreadable marker {self.marker}"
            sig = self.signature()
            if rec.get("command") != sig["command"]:
                return "run", "options changed since the last run"
            if rec.get("inputs") != sig["inputs"]:
                return "run", "inputs changed since the last run"
        return "done", "verified output exists"

    def run(self, env: dict[str, str], log=print) -> None:
        st, detail = self.status()
        if st in ("skip", "done"):
            log(f"[stage {self.name}] {st}: {detail}")
            return
        if st == "error":
            raise StageError(f"stage {self.name}: {detail}")
        log(f"[stage {self.name}] running ({detail}): {' '.join(self.run_argv)}")
        t0 = time.monotonic()
        rc = subprocess.call(self.run_argv, env=stage_env(env))
        if rc != 0:
            raise StageError(f"stage {self.name} failed with exit status {rc}: {' '.join(self.run_argv)}")
        if self.verify is not None:
            ok, detail = self.verify()
            if not ok:
                raise StageError(f"stage {self.name} finished but its output does not verify: {detail}")
        missing = [str(p) for p in self.outputs if not Path(p).exists()]
        if missing:
            raise StageError(f"stage {self.name} finished but did not write {missing[0]}")
        if self.marker is not None:
            rec = {**self.signature(), "stage": self.name, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "seconds": round(time.monotonic() - t0, 1)}
            write_json_atomic(self.marker, rec, indent=1, ensure_ascii=True)
        self.ran = True
        log(f"[stage {self.name}] done in {time.monotonic() - t0:.1f}s")


#: torch.distributed's rendezvous variables. In a multi-node job they describe the job (PAI-DLC: WORLD_SIZE = pods,
#: RANK = node, MASTER_ADDR/PORT = pod 0), not a stage: a stage is one process on node 0 (or torchrun --standalone,
#: which sets its own), and the converter reading WORLD_SIZE=2 would wait for a rank that never comes
JOB_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                       "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def stage_env(env: dict[str, str]) -> dict[str, str]:
    """The environment a stage's command runs in: ENV without the job's torch.distributed rendezvous variables."""
    return {k: v for k, v in env.items() if k not in JOB_RENDEZVOUS_VARS}


class StageError(Dsv3Error, RuntimeError):
    pass


def _py(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def _has_weights(d: Path) -> bool:
    return d.is_dir() and (any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file())


def read_config(d: Path) -> dict | None:
    try:
        return json.loads((Path(d) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def is_fp8(model_dir: Path, preset_cfg: dict) -> bool:
    """Does the checkpoint (or, before download, the model preset) carry FP8 weights?"""
    cfg = read_config(model_dir)
    if cfg is None:
        cfg = preset_cfg
    q = cfg.get("quantization_config") or {}
    return q.get("quant_method") == "fp8"


#: every stage :func:`build_stages` may build, in order (``dsv3-launch run --force-stage`` checks its argument
#: against these while it parses the command line, before the minute of validation)
STAGE_NAMES = ("weights", "download", "fp8_cast", "hf_config", "convert", "data")


def build_stages(preset, paths, *, max_prompt_length: int | None, model_cfg: dict) -> list[Stage]:
    """The stages for PRESET with PATHS (see :mod:`dsv3_rl.launch.run`)."""
    from dsv3_rl.models import presets as model_presets

    stages: list[Stage] = []
    w = preset.weights
    model_dir, hf_dir = Path(paths.model), Path(paths.hf)
    model_name = model_presets.resolve(preset.model)

    # weights ------------------------------------------------------------------------------------
    synthetic = w["source"] == "synthetic"
    why = (f"shipped in the repository ({w.get('path')})" if w["source"] == "shipped"
           else "weights come from a download (MODEL_PATH)")
    st = Stage("weights", needed=synthetic, why=why,
               argv=_py("dsv3_rl.minimodel.mini_model", "--model", model_name, "--out", str(model_dir), "--force"),
               out_dir=model_dir, outputs=[model_dir / "config.json"], inputs=[])
    if synthetic:
        st.verify = lambda d=model_dir: ((_has_weights(d), "weights present") if _has_weights(d)
                                         else (False, f"no *.safetensors in {d}"))
    elif not (model_dir / "config.json").is_file():
        hint = w.get("download") or "download the checkpoint"
        stages.append(Stage("download", needed=True, why="", argv=[], out_dir=None, outputs=[model_dir / "config.json"],
                            inputs=[], error=f"MODEL_PATH={model_dir} has no config.json; {hint.format(path=model_dir)} "
                                              f"(or set MODEL_PATH to the checkpoint)"))
    stages.append(st)

    # fp8 cast -----------------------------------------------------------------------------------
    fp8 = w["fp8"] is True or (w["fp8"] == "auto" and is_fp8(model_dir, model_cfg))
    st = Stage("fp8_cast", needed=fp8 and hf_dir != model_dir,
               why="checkpoint is BF16 already" if not fp8 else "HF_PATH is MODEL_PATH",
               argv=_py("dsv3_rl.checkpoint.fp8", "cast", str(model_dir), "--out", str(hf_dir)),
               out_dir=None, outputs=[hf_dir / "config.json"], inputs=[model_dir / "config.json"], force_flag="--force")

    def verify_cast(out=hf_dir, src=model_dir):
        try:
            man = read_manifest(out, FP8_TOOL)
        except (OSError, Dsv3Error):
            man = None
        if man is None:
            return False, f"no complete {MANIFEST} of the FP8 cast in {out}"
        if not man.get("complete"):
            return False, f"{out / MANIFEST} says incomplete (an interrupted cast resumes)"
        if Path(man.get("input", "")).resolve() != src.resolve():
            return False, f"{out} is a cast of {man.get('input')}, not of {src}"
        return True, f"{MANIFEST} complete"

    st.verify = verify_cast
    if fp8 and hf_dir == model_dir:
        st.needed, st.error = True, (f"{model_dir} holds FP8 weights but HF_PATH equals MODEL_PATH; set HF_PATH to a "
                                     f"new directory for the BF16 cast")
    stages.append(st)

    # config fix-up --------------------------------------------------------------------------------
    st = Stage("hf_config", needed=True, why="",
               argv=_py("dsv3_rl.checkpoint.hf_config", str(hf_dir)),
               out_dir=None, outputs=[hf_dir / "config.json"], inputs=[])

    def verify_config(d=hf_dir, synthetic=synthetic):
        """``hf_config --check`` (in-process: the same function the CLI calls), then the tokenizer's length against
        vocab_size (:func:`tokenizer_gap`: an error for synthetic weights, an info for real ones)."""
        if not (d / "config.json").is_file():
            return False, f"{d / 'config.json'} missing"
        from dsv3_rl.checkpoint.hf_config import ConfigError, fix_checkpoint_config

        try:
            changes = fix_checkpoint_config(d, dry_run=True)
        except ConfigError as e:
            return False, f"config.json cannot be fixed: {e}"
        if changes:
            return False, f"config.json needs {len(changes)} fix-up(s): " + "; ".join(map(str, changes[:3]))
        try:
            gap = tokenizer_gap(d, synthetic=synthetic)
        except Exception as e:  # noqa: BLE001  (transformers: OSError, ValueError, KeyError, ... for a broken tokenizer)
            why = (str(e).splitlines() or [""])[0]
            return False, f"the tokenizer in {d} does not load with AutoTokenizer as verl loads it ({type(e).__name__}: {why})"
        if gap and synthetic:
            return False, gap  # the tool cannot fix it: the stage stops (exit 2) naming both numbers
        return True, "config.json acceptable to verl and vLLM" + (f"; info: {gap}" if gap else "")

    st.verify = verify_config
    stages.append(st)

    # HF -> mcore --------------------------------------------------------------------------------
    mcore = Path(paths.mcore)
    st = Stage("convert", needed=bool(w.get("dist_ckpt")),
               why="weights.dist_ckpt is false: verl loads the HF weights itself",
               argv=convert_argv(hf_dir, mcore, int(os.environ.get("CONVERT_NPROC", "1") or 1)), out_dir=mcore, outputs=[mcore],
               inputs=[hf_dir / "config.json", hf_dir / "model.safetensors.index.json", hf_dir / "model.safetensors"],
               force_flag="--force")

    def verify_mcore(out=mcore, src=hf_dir):
        try:
            man = read_manifest(out, CONVERT_TOOL)
        except (OSError, Dsv3Error):
            man = None
        if man is None:
            return False, f"no {MANIFEST} of the converter in {out}"
        if not man.get("complete") or man.get("direction") != "hf->mcore":
            return False, f"{out / MANIFEST} is not a complete hf->mcore conversion"
        if Path(man.get("source", "")).resolve() != src.resolve():
            return False, f"{out} was converted from {man.get('source')}, not from {src}"
        return True, f"{MANIFEST} complete, from {src.name}"

    st.verify = verify_mcore
    stages.append(st)

    # data -----------------------------------------------------------------------------------------
    d = preset.data
    raw, out = Path(paths.data_raw), Path(paths.data)
    argv = _py(f"dsv3_rl.data.{d['dataset']}", "--input-dir", str(raw), "--out", str(out))
    for k in ("train_size", "test_size"):
        if d.get(k):
            argv += [f"--{k.replace('_', '-')}", str(d[k])]
    if d.get("length_filter") and max_prompt_length:
        argv += ["--tokenizer", str(hf_dir), "--max-prompt-length", str(max_prompt_length)]
    raw_files = sorted(raw.rglob("*.parquet")) if raw.is_dir() else []
    st = Stage("data", needed=True, why="", argv=argv, out_dir=out,
               outputs=[out / "train.parquet", out / "test.parquet", out / "prep_summary.json"], inputs=raw_files)
    st.verify = lambda out=out: verify_data(out)
    if not raw.is_dir():
        st.error = f"DATA_RAW={raw} does not exist (or set DATA_RAW). {_download_hint(d['dataset'], raw)}"
        if all(p.exists() for p in st.outputs):
            st.error = None
            st.out_dir = None  # no marker to compare inputs with: the files themselves are validated
    stages.append(st)
    return stages


def tokenizer_gap(d: Path, *, synthetic: bool) -> str | None:
    """What a tokenizer in D shorter than its config.json's vocab_size does to the run (one line naming both numbers),
    None where they agree or D holds no tokenizer. verl's vLLM rollout masks the logits of ids >= len(tokenizer)
    (``monkey_patch_compute_logits``), Megatron's log-probs normalise over all vocab_size rows: the two differ by
    -ln(the trainer's probability of ids < len), about ln(vocab_size/len) on every token for SYNTHETIC weights (random
    lm_head rows; the proxy GPU run of 2026-12-07 measured 4.147 nats with 2048 of 129280), next to nothing for trained
    weights (DeepSeek-V3's own tokenizer: 128815 of 129280)."""
    from dsv3_rl.models.tokenizer import tokenizer_length

    vocab = (read_config(d) or {}).get("vocab_size")
    n = tokenizer_length(d)
    if n is None or not isinstance(vocab, int) or n >= vocab:
        return None
    gap = (f"the tokenizer in {d} has {n} entries but config.json vocab_size is {vocab}: verl's vLLM rollout never "
           f"samples ids >= {n} while Megatron's log-probs normalise over all {vocab} rows, so rollout and trainer "
           f"log-probs disagree by up to ln({vocab}/{n}) = {math.log(vocab / n):.4g} nats")
    if synthetic:
        return (gap + " on every token with these synthetic weights (random lm_head rows); rewrite them with "
                      "--force-stage weights (mini_model pads the tokenizer to vocab_size)")
    return gap + " (trained weights put next to no probability on ids the tokenizer never produces: far less in practice)"


def verify_data(out: Path) -> tuple[bool, str]:
    """``dsv3-prep-data validate`` on the prepared splits (in-process: the function the CLI calls)."""
    from dsv3_rl.data.common import DataPrepError, validate_rl_parquet

    rows = {}
    for sp in ("train", "test"):
        try:
            rows[sp] = validate_rl_parquet(out / f"{sp}.parquet")
        except DataPrepError as e:
            return False, f"prepared data does not validate: {e}"
    return True, f"train/test parquet validate ({rows['train']}/{rows['test']} rows)"


def dataset_spec(dataset: str):
    """``dsv3_rl.data.<dataset>.SPEC`` (name, download hint, ...) of a preset's ``data.dataset``
    (one of :data:`dsv3_rl.recipes.presets.DATASETS`, checked when the preset is loaded)."""
    import importlib

    return importlib.import_module(f"dsv3_rl.data.{dataset}").SPEC


def _download_hint(dataset: str, raw: Path) -> str:
    """The data-prep module's own download hint for ``dataset``, with DIR filled in."""
    return dataset_spec(dataset).download_hint.replace("DIR", str(raw))


def convert_argv(hf_dir: Path, mcore_dir: Path, nproc: int = 1) -> list[str]:
    """``python -m dsv3_rl.convert hf-to-mcore`` (under torchrun with NPROC > 1: the converter spreads its I/O
    over the ranks; ``CONVERT_NPROC`` sets it)."""
    args = ["dsv3_rl.convert", "hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(mcore_dir)]
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", *args]
    return _py(*args)
