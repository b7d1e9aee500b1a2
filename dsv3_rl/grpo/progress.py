"""Progress of a running GRPO job, read from verl's metrics.jsonl: one line per step and two PNG plots.

verl 0.9.1's file logger (``trainer.logger=[file]``, ``VERL_FILE_LOGGER_PATH``) appends one JSON line per
step, ``{"step": n, "data": {metric: value}}``. :class:`MetricsFollower` tails that file while the trainer
writes it and hands back each step once it is complete; :func:`progress_line` renders a step as one line;
:func:`write_plots` draws the reward curve and the rollout-vs-trainer probability gap. A finished file is
read with :func:`dsv3_rl.grpo.checks.read_metrics` (the follower merges records of a step the same way).
"""

from __future__ import annotations

import datetime
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from dsv3_rl.fs import write_bytes_atomic
from dsv3_rl.grpo.checks import (PROB_DIFF_MAX, PROB_DIFF_MEAN, REWARD_KEYS, CheckError, read_metrics,
                                 route_agreement)

# verl metric names (verl 0.9.1, trainer/ppo/metric_utils.py); the reward and prob-diff names live in checks
RESPONSE_LENGTH = "response_length/mean"
PG_LOSS = "actor/pg_loss"
STEP_TIME = "timing_s/step"
PREFIX = "[dsv3-grpo]"


def _num(x: Any) -> float | None:
    """``x`` as a float when it is a number (bool is not), else None. NaN/inf are kept: they are values."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def train_reward(step: dict) -> float | None:
    """The mean training reward of a step record (``critic/score/mean``, else ``critic/rewards/mean``)."""
    for k in REWARD_KEYS:
        if k in step:
            return _num(step[k])
    return None


def val_reward(step: dict) -> float | None:
    """The validation reward of a step record: the first ``val-core/...`` key containing ``mean@``
    (verl's ``val-core/<data_source>/<reward|acc|score>/mean@N``); failing that, the first ``val/...`` key
    containing ``score`` or ``reward`` (older verl). None when the step has no validation metric."""
    for k, v in step.items():
        if k.startswith("val-core/") and "mean@" in k and _num(v) is not None:
            return _num(v)
    for k, v in step.items():
        if k.startswith("val/") and ("score" in k or "reward" in k) and _num(v) is not None:
            return _num(v)
    return None


#: verl's rollout MoE load metrics, one per layer (rollout.moe_load_balance_metrics_interval, R3 on)
MOE_MAX_VIO = "rollout/moe/max_vio/layer_"


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def progress_line(step: dict, total: int) -> str:
    """One line for one step record, e.g. ``[dsv3-grpo] step 3/12  reward 0.219  val 0.194  resp_len 6.0
    pg_loss -0.0123  |p_vllm-p_mcore| mean 3.0e-06 max 4.2e-05  12.3 s/step``. ``val`` appears only on steps
    that validated; any other missing value prints ``n/a``. A record with a validation reward and no training
    reward (verl's validation before training, step 0, or its final one) is one short ``validation`` line."""
    v = val_reward(step)
    head = f"{PREFIX} step {step.get('step', '?')}/{total}"
    if v is not None and train_reward(step) is None:
        return f"{head}  validation only: val {_fmt(v, '.3f')}"
    parts = [head, f"reward {_fmt(train_reward(step), '.3f')}"]
    if v is not None:
        parts.append(f"val {_fmt(v, '.3f')}")
    parts += [f"resp_len {_fmt(_num(step.get(RESPONSE_LENGTH)), '.1f')}",
              f"pg_loss {_fmt(_num(step.get(PG_LOSS)), '.3g')}",
              f"|p_vllm-p_mcore| mean {_fmt(_num(step.get(PROB_DIFF_MEAN)), '.1e')} "
              f"max {_fmt(_num(step.get(PROB_DIFF_MAX)), '.1e')}",
              f"{_fmt(_num(step.get(STEP_TIME)), '.1f')} s/step"]
    agree = route_agreement(step)
    if agree is not None:
        parts.insert(-1, f"routes agree {agree:.3f}")
    return "  ".join(parts)


class MetricsFollower:
    """Tails a metrics.jsonl that another process is appending to.

    :meth:`poll` returns the step records (``{"step": n, **metrics}``, records of one step merged as in
    :func:`~dsv3_rl.grpo.checks.read_metrics`) that became complete since the last call: a step is complete
    once a record of a later step has appeared. The newest step stays pending until then, or until
    :meth:`flush` at the end of the run. A last line without its newline is not read until the newline
    arrives (the writer may be half-way through it); :meth:`flush` reads it if it is valid JSON by then.
    A missing file is an empty one (the trainer has not started logging yet); a file that shrank was
    rewritten and is read again from the start. Should more metrics of an already returned step arrive
    later, the step is returned again, merged. :attr:`steps` is everything complete so far, by step.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._reset()

    def _reset(self) -> None:
        self._offset = 0  # bytes of the file consumed (up to the end of the last complete line)
        self._lineno = 0  # complete lines consumed, for error messages
        self._tail = b""  # bytes after the last newline: a line still being written
        self._pending: dict[int, dict] = {}  # step -> merged metrics, not yet returned
        self._done: dict[int, dict] = {}  # step -> merged metrics, returned
        self._max_step: int | None = None

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [{"step": s, **self._done[s]} for s in sorted(self._done)]

    def _read(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self._offset + len(self._tail):
            self._reset()  # truncated / rewritten: start over
        with open(self.path, "rb") as f:
            f.seek(self._offset + len(self._tail))
            data = self._tail + f.read()
        *lines, self._tail = data.split(b"\n")
        for raw in lines:
            self._offset += len(raw) + 1
            self._lineno += 1
            self._add(raw, self._lineno)

    def _add(self, raw: bytes, lineno: int) -> None:
        if not raw.strip():
            return
        try:
            rec = json.loads(raw)
            step = int(rec["step"])
            data = dict(rec.get("data") or {})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckError(f"{self.path}:{lineno}: not a verl metrics record ({type(e).__name__}: {e})") from None
        if step in self._done:  # late metrics of a step already returned: return it again, merged
            self._pending[step] = self._done.pop(step)
        self._pending.setdefault(step, {}).update(data)
        self._max_step = step if self._max_step is None else max(self._max_step, step)

    def _emit(self, ready: list[int]) -> list[dict[str, Any]]:
        out = []
        for s in sorted(ready):
            self._done[s] = self._pending.pop(s)
            out.append({"step": s, **self._done[s]})
        return out

    def poll(self) -> list[dict[str, Any]]:
        """The step records completed since the last call (sorted by step; often empty)."""
        self._read()
        return self._emit([s for s in self._pending if s < self._max_step])

    def flush(self) -> list[dict[str, Any]]:
        """At the end of the run: read what is left, including a last line without newline if it is valid
        JSON, and return every step still pending."""
        self._read()
        if self._tail.strip():
            try:
                json.loads(self._tail)
            except ValueError:
                pass  # still half-written: the writer died mid-line; nothing to read there
            else:
                self._offset += len(self._tail)
                self._lineno += 1
                self._add(self._tail, self._lineno)
                self._tail = b""
        return self._emit(list(self._pending))



# ------------------------------------------------------------------------------------- start-up

#: milestones of a main_ppo start-up in verl 0.9.1's log (each line carries the time it was written): (what the
#: time up to it was spent on, text of the line). The first timestamped line of the attempt (main_ppo imported)
#: is the start; each phase runs from the milestone before it. Every phase but the weight sync is mostly new
#: processes importing torch/verl/megatron/vLLM (10-25 s each on 2 busy cores).
STARTUP_MARKS = (
    ("Ray", "Started a local Ray instance"),                                    # ray.init in the driver
    ("trainer + data", "train and validate dataloader initialized"),           # TaskRunner actor, imports, datasets
    ("Megatron workers", "actor and ref model engine initialized"),            # 2 WorkerDicts: model built + ckpt loaded
    ("vLLM engines", "checkpoint engine manager initialized"),                 # 2 x (server, EngineCore, worker)
    ("first weight sync", "update_weights done"),                              # trainer -> vLLM before step 1
    ("agent loop", "Passing raw prompts to InputProcessor"),                   # load balancer + agent loop worker up,
)                                                                              # first request (validation) reaches vLLM
_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")            # verl's and Ray's loggers
_VLLM_TIME = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d) \[")  # vLLM's: no year, no ms
ATTEMPT_HEADER = f"===== {PREFIX} attempt:"


def _log_time(line: str, year: str | None) -> float | None:
    m = _LOG_TIME.search(line)
    if m is not None:
        return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
    m = _VLLM_TIME.search(line) if year else None
    if m is not None:
        return datetime.datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp()
    return None


def startup_phases(log_text: str) -> list[tuple[str, float]]:
    """``[(phase, seconds)]`` of the last attempt in a main_ppo.log (:data:`STARTUP_MARKS`, in order; a phase
    whose milestone is missing is left out and the next one counts from the last one found)."""
    text = log_text[log_text.rfind(ATTEMPT_HEADER) + 1:] if ATTEMPT_HEADER in log_text else log_text
    start, year, seen = None, None, {}
    for line in text.splitlines():
        t = _log_time(line, year)
        if t is None:
            continue
        if start is None:
            start, year = t, datetime.datetime.fromtimestamp(t).strftime("%Y")
        for name, needle in STARTUP_MARKS:
            if name not in seen and needle in line:
                seen[name] = t
    out, prev = [], start
    for name, _ in STARTUP_MARKS:
        if name in seen and prev is not None:
            out.append((name, max(0.0, seen[name] - prev)))
            prev = seen[name]
    return out


def startup_line(log_path: str | Path) -> str | None:
    """One line with the start-up phases of the run logged in LOG_PATH, e.g. ``[dsv3-grpo] start-up 154s after
    main_ppo's imports: Ray 9s, trainer + data 41s, Megatron workers 32s, vLLM engines 53s, first weight sync 2s,
    agent loop 14s`` (validation before training and the steps follow); None when the log has none of the
    milestones (a run that died before Ray came up)."""
    try:
        phases = startup_phases(Path(log_path).read_text(errors="replace"))
    except OSError:
        return None
    if not phases:
        return None
    return (f"{PREFIX} start-up {sum(s for _, s in phases):.0f}s after main_ppo's imports: "
            + ", ".join(f"{n} {s:.0f}s" for n, s in phases))

# ------------------------------------------------------------------------------------------ plots

def _series(steps: list[dict], get, positive: bool = False) -> tuple[list[int], list[float], int]:
    """(steps, values, how many values were dropped as non-finite or, with ``positive``, <= 0)."""
    xs, ys, dropped = [], [], 0
    for s in steps:
        y = get(s)
        if y is None:
            continue
        if not math.isfinite(y) or (positive and y <= 0):
            dropped += 1
            continue
        xs.append(s["step"])
        ys.append(y)
    return xs, ys, dropped


def _label(name: str, series: tuple) -> str:
    n = series[2]
    return name + (f" ({n} step{'s' if n > 1 else ''} not shown: <= 0 or not finite)" if n else "")


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no data\n({what})", ha="center", va="center", transform=ax.transAxes,
            fontsize=14, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _step_axis(ax, *series: tuple) -> None:
    """Integer step ticks; a range of under two steps is widened, or matplotlib ticks fractions of a step."""
    from matplotlib.ticker import MaxNLocator

    xs = [x for s in series for x in s[0]]
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if xs and max(xs) - min(xs) < 2:
        ax.set_xlim(min(xs) - 1, max(xs) + 1)


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_bytes_atomic(path, buf.getvalue())
    return path


def write_plots(steps: list[dict], out_dir: Path, dense_layers: int = 0) -> list[Path]:
    """``reward.png`` (train reward and validation reward per step, mean response length on a right axis)
    and ``consistency.png`` (max and mean |p_vllm - p_mcore| per step, log scale) under ``out_dir``, each
    written atomically; a plot without any value says "no data" instead. With verl's rollout MoE load
    metrics in the steps (R3) also ``expert_load.png`` (max_vio per layer and step; the first ``dense_layers``
    layers, DeepSeek-V3's ``first_k_dense_replace``, route nothing and are left out). Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = sorted(steps, key=lambda s: s["step"])
    written = []

    tr = _series(steps, train_reward)
    va = _series(steps, val_reward)
    rl = _series(steps, lambda s: _num(s.get(RESPONSE_LENGTH)))
    fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
    try:
        ax.set_title("GRPO reward per step")
        if not (tr[0] or va[0] or rl[0]):
            _no_data(ax, f"{REWARD_KEYS[0]}, val-core/*/mean@N, {RESPONSE_LENGTH}")
        else:
            handles = []
            if tr[0]:
                handles += ax.plot(*tr[:2], color="tab:blue", marker="o", markersize=4, linewidth=1.5,
                                   label=_label("train reward (mean)", tr))
            if va[0]:
                handles += ax.plot(*va[:2], color="tab:green", marker="D", markersize=6, linestyle="--", linewidth=1,
                                   label=_label("validation reward (mean)", va))
            _step_axis(ax, tr, va, rl)
            ax.set_ylabel("reward")
            ax.grid(True, alpha=0.3)
            if rl[0]:
                ax2 = ax.twinx()
                handles += ax2.plot(*rl[:2], color="tab:orange", marker=".", markersize=4, linewidth=1.2, alpha=0.8,
                                    label=_label("response length (mean)", rl))
                ax2.set_ylabel("response length (tokens)", color="tab:orange")
                ax2.tick_params(axis="y", colors="tab:orange")
                ax.set_zorder(ax2.get_zorder() + 1)  # the rewards above the length line
                ax.patch.set_visible(False)
            fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
        written.append(_save(fig, out_dir / "reward.png"))
    finally:
        plt.close(fig)

    mx = _series(steps, lambda s: _num(s.get(PROB_DIFF_MAX)), positive=True)
    mn = _series(steps, lambda s: _num(s.get(PROB_DIFF_MEAN)), positive=True)
    fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
    try:
        ax.set_title("rollout vs trainer: |p_vllm - p_mcore| of the sampled tokens")
        if not (mx[0] or mn[0]):
            _no_data(ax, f"{PROB_DIFF_MAX}, {PROB_DIFF_MEAN}")
        else:
            if mx[0]:
                ax.plot(*mx[:2], color="tab:red", marker="o", markersize=4, label=_label("max", mx))
            if mn[0]:
                ax.plot(*mn[:2], color="tab:purple", marker="s", markersize=4, label=_label("mean", mn))
            ax.set_yscale("log")
            _step_axis(ax, mx, mn)
            ax.set_ylabel("|p_vllm - p_mcore|")
            ax.grid(True, which="both", alpha=0.3)
            fig.legend(loc="outside lower center", ncol=2, fontsize=9, frameon=False)
        written.append(_save(fig, out_dir / "consistency.png"))
    finally:
        plt.close(fig)

    layers = sorted({int(k[len(MOE_MAX_VIO):]) for s in steps for k in s if k.startswith(MOE_MAX_VIO)
                     and k[len(MOE_MAX_VIO):].isdigit() and int(k[len(MOE_MAX_VIO):]) >= dense_layers})
    moe_steps = [s for s in steps if any(f"{MOE_MAX_VIO}{i}" in s for i in layers)]
    if layers and moe_steps:
        import numpy as np

        grid = np.array([[_num(s.get(f"{MOE_MAX_VIO}{i}")) if _num(s.get(f"{MOE_MAX_VIO}{i}")) is not None else np.nan
                          for s in moe_steps] for i in layers], dtype=float)
        fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(layers)), layout="constrained")
        try:
            im = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest")
            ax.set_title("expert load per MoE layer and step: max_vio = busiest expert's share x experts - 1 "
                         "(0 = balanced)", fontsize=9)
            ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
            ax.set_xticks(range(len(moe_steps)), [str(s["step"]) for s in moe_steps])
            ax.set_xlabel("step")
            fig.colorbar(im, ax=ax, label="max_vio")
            written.append(_save(fig, out_dir / "expert_load.png"))
        finally:
            plt.close(fig)
    return written


def plot_metrics_file(metrics: str | Path, out_dir: Path) -> list[Path]:
    """:func:`write_plots` of a finished run's metrics.jsonl (read with :func:`checks.read_metrics`)."""
    return write_plots(read_metrics(metrics), out_dir)
