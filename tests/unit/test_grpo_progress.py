"""GRPO progress: step line, metrics.jsonl follower, PNG plots (each with a planted-fault twin)."""

from __future__ import annotations

import json

import matplotlib.image
import numpy as np
import pytest

from dsv3_rl.grpo import progress
from dsv3_rl.grpo.checks import CheckError, read_metrics
from dsv3_rl.grpo.progress import MetricsFollower, progress_line, val_reward, write_plots

VAL_KEY = "val-core/openai/gsm8k/reward/mean@4"
LINE = ("[dsv3-grpo] step 3/12  reward 0.219  val 0.194  resp_len 6.0  pg_loss -0.0123  "
        "|p_vllm-p_mcore| mean 3.0e-06 max 4.2e-05  12.3 s/step")


def _step(n: int, val: float | None = None, **extra) -> dict:
    s = {"step": n, "critic/score/mean": 0.219, "response_length/mean": 6.0, "actor/pg_loss": -0.0123,
         "training/rollout_probs_diff_max": 4.2e-05, "training/rollout_probs_diff_mean": 3e-06,
         "timing_s/step": 12.3, "training/global_step": n}
    if val is not None:
        s[VAL_KEY] = val
    s.update(extra)
    return s


# ------------------------------------------------------------------------------ val_reward, progress_line

def test_val_reward_key_rule():
    assert val_reward({"step": 1, "val-core/a/acc/best@4/mean": 0.9, "val-core/a/acc/mean@4": 0.5}) == 0.5
    assert val_reward({"step": 1, "val-core/a/reward/mean@2": 0.25, "val-core/b/reward/mean@2": 0.75}) == 0.25
    assert val_reward({"step": 1, "val/test_score/gsm8k": 0.3}) == 0.3  # older verl
    assert val_reward({"step": 1, "val-core/a/reward/mean@1": 0.4, "val/test_score/a": 0.3}) == 0.4  # val-core first


def test_val_reward_ignores_other_keys():
    # twin: keys that look like validation but are not the core reward must not be taken
    assert val_reward({"step": 1, "val-aux/a/reward/mean@4": 0.9, "val-core/a/reward/best@4/mean": 0.8,
                       "val/num_samples": 3, "critic/score/mean": 0.1}) is None
    assert val_reward({"step": 1, VAL_KEY: "0.5"}) is None  # not a number
    assert val_reward({"step": 1}) is None


def test_progress_line_with_val():
    assert progress_line(_step(3, val=0.194), 12) == LINE


def test_progress_line_without_val():
    line = progress_line(_step(3), 12)
    assert line == LINE.replace("val 0.194  ", "")
    assert "val" not in line


def test_progress_line_missing_values_are_na():
    # twin: neighbouring keys (score max, val-aux) must not stand in for the missing ones
    line = progress_line({"step": 0, "critic/score/max": 1.0, "val-aux/a/reward/mean@4": 0.5}, 12)
    assert line == ("[dsv3-grpo] step 0/12  reward n/a  resp_len n/a  pg_loss n/a  |p_vllm-p_mcore| mean n/a max n/a  "
                    "n/a s/step")
    # a validation-only step (before training, or the final validation) is one short line
    assert progress_line({"step": 13, VAL_KEY: 0.5}, 12) == "[dsv3-grpo] step 13/12  validation only: val 0.500"
    assert "pg_loss -3.2e-05" in progress_line(_step(1, **{"actor/pg_loss": -3.2e-05}), 2)


# ------------------------------------------------------------------------------------------ follower

def _records() -> list[dict]:
    """What verl logs: a val-only step 0 (validation before training), steps 1..3 with val at step 2 logged
    in a second record of the same step, a val-only step 4 (final validation); non-ASCII in a key."""
    recs = [{"step": 0, "data": {VAL_KEY: 0.1}}]
    for n in (1, 2, 3):
        recs.append({"step": n, "data": {k: v for k, v in _step(n).items() if k != "step"} | {"über/x": n}})
        if n == 2:
            recs.append({"step": 2, "data": {VAL_KEY: 0.2}})
    recs.append({"step": 4, "data": {VAL_KEY: 0.3}})
    return recs


def _content() -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in _records())


def _replay(tmp_path, follower_cls, chunk: int) -> list[str]:
    """Append the metrics file ``chunk`` bytes at a time, polling after each; flush at the end. Returns what
    went wrong: a returned record that differs from the finished file's, a step returned twice or never."""
    path = tmp_path / f"m{chunk}.jsonl"
    data = _content()
    path.write_bytes(data)
    final = {r["step"]: r for r in read_metrics(path)}
    path.write_bytes(b"")
    f = follower_cls(path)
    got, problems = [], []
    for i in range(0, len(data), chunk):
        with open(path, "ab") as fh:
            fh.write(data[i:i + chunk])
        got += f.poll()
    got += f.flush()
    for r in got:
        if r != final[r["step"]]:
            problems.append(f"step {r['step']} returned incomplete: {sorted(set(final[r['step']]) - set(r))} missing")
    steps = [r["step"] for r in got]
    if steps != sorted(final):
        problems.append(f"steps returned {steps}, file has {sorted(final)}")
    return problems


@pytest.mark.parametrize("chunk", [1, 7, 64, 100_000])
def test_follower_returns_each_step_once_and_complete(tmp_path, chunk):
    assert _replay(tmp_path, MetricsFollower, chunk) == []


class _EagerFollower(MetricsFollower):
    """Planted fault: returns the newest step before a later step has appeared."""

    def poll(self):
        self._read()
        return self._emit(list(self._pending))


class _LineGreedyFollower(MetricsFollower):
    """Planted fault: treats the unterminated last line as a complete one."""

    def _read(self):
        super()._read()
        if self._tail:
            self._add(self._tail, 0)
            self._offset += len(self._tail)
            self._tail = b""


def test_follower_faults_are_detected(tmp_path):
    assert any("incomplete" in p for p in _replay(tmp_path, _EagerFollower, 64))
    with pytest.raises(CheckError, match="not a verl metrics record"):
        _replay(tmp_path, _LineGreedyFollower, 7)


def test_follower_pieces_and_partial_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    f = MetricsFollower(path)
    assert f.poll() == []  # not created yet
    l1, l2, l3 = (json.dumps({"step": n, "data": {"critic/score/mean": n / 10}}) + "\n" for n in (1, 2, 3))
    path.write_text(l1)
    assert f.poll() == []  # step 1 may still get more records
    with open(path, "a") as fh:
        fh.write(l2[:15])  # partial line of step 2
    assert f.poll() == []  # the partial line is not a step yet, so step 1 is not complete either
    # the file at this moment really has a partial last line: the whole-file reader chokes on it
    with pytest.raises(CheckError, match="not JSON"):
        read_metrics(path)
    with open(path, "a") as fh:
        fh.write(l2[15:])
    assert f.poll() == [{"step": 1, "critic/score/mean": 0.1}]
    assert f.poll() == []
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 2, "data": {VAL_KEY: 0.5}}) + "\n" + l3[:-1])  # step 3 without newline
    assert f.poll() == []
    assert f.flush() == [{"step": 2, "critic/score/mean": 0.2, VAL_KEY: 0.5}, {"step": 3, "critic/score/mean": 0.3}]
    assert f.steps == read_metrics(path)
    assert f.flush() == [] and f.poll() == []


def test_follower_flush_leaves_a_half_written_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "data": {"a": 1}}) + '\n{"step": 2, "da')
    f = MetricsFollower(path)
    assert f.flush() == [{"step": 1, "a": 1}]


def test_follower_late_metrics_return_the_step_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": n, "data": {"a": n}}) + "\n" for n in (1, 2)))
    f = MetricsFollower(path)
    assert f.poll() == [{"step": 1, "a": 1}]
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 1, "data": {"b": 5}}) + "\n")
    assert f.poll() == [{"step": 1, "a": 1, "b": 5}]
    assert f.steps == [{"step": 1, "a": 1, "b": 5}]


def test_follower_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "data": {}}) + "\n[1, 2]\n")
    with pytest.raises(CheckError, match=r"metrics.jsonl:2: not a verl metrics record"):
        MetricsFollower(path).poll()


def test_follower_rewritten_file_starts_over(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": n, "data": {"a": n}}) + "\n" for n in (1, 2, 3)))
    f = MetricsFollower(path)
    assert [r["step"] for r in f.poll()] == [1, 2]
    path.write_text("".join(json.dumps({"step": n, "data": {"b": n}}) + "\n" for n in (1, 2)))
    assert f.poll() == [{"step": 1, "b": 1}]


# ---------------------------------------------------------------------------------------------- plots

def _series12() -> list[dict]:
    steps = [{"step": 0, VAL_KEY: 0.05}]
    for n in range(1, 13):
        s = _step(n, val=0.1 + 0.05 * n if n % 4 == 0 else None)
        s["critic/score/mean"] = 0.1 + 0.04 * n
        s["response_length/mean"] = 40 - 2 * n
        s["training/rollout_probs_diff_max"] = 0.0 if n == 5 else 1e-4 * (1 + n % 3)
        s["training/rollout_probs_diff_mean"] = 2e-6 * (1 + n % 2)
        steps.append(s)
    return steps


def _png(path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100, img.shape
    return img


def test_write_plots_pngs(tmp_path):
    paths = write_plots(_series12(), tmp_path / "plots")
    assert [p.name for p in paths] == ["reward.png", "consistency.png"]
    for p in paths:
        _png(p)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["consistency.png", "reward.png"]  # no temp files


def test_png_check_bites(tmp_path):
    (p,) = write_plots(_series12(), tmp_path)[:1]
    bad = tmp_path / "cut.png"
    bad.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises((OSError, SyntaxError, ValueError)):  # PIL's errors for a truncated PNG
        _png(bad)
    bad.write_bytes(b"GIF89a" + p.read_bytes()[6:])
    with pytest.raises(AssertionError, match="not a PNG"):
        _png(bad)


def test_write_plots_no_data(tmp_path):
    empty = [_png(p) for p in write_plots([], tmp_path / "empty")]
    data = [_png(p) for p in write_plots(_series12(), tmp_path / "data")]
    # twin: the plots do draw the data (differ from the "no data" ones) ...
    assert not np.array_equal(empty[0], data[0]) and not np.array_equal(empty[1], data[1])
    # ... and non-positive probability gaps are skipped on the log axis: only those -> "no data"
    zeros = [{"step": n, "training/rollout_probs_diff_max": 0.0, "training/rollout_probs_diff_mean": -1.0}
             for n in (1, 2)]
    assert np.array_equal(_png(write_plots(zeros, tmp_path / "zeros")[1]), empty[1])


def test_plot_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_content())
    assert [p.name for p in progress.plot_metrics_file(path, tmp_path / "out")] == ["reward.png", "consistency.png"]


def test_progress_line_shows_r3_route_agreement_only_when_logged():
    from dsv3_rl.grpo.progress import progress_line

    step = {"step": 3, "critic/score/mean": 0.5, "actor/router_replay/route_agreement": 0.987654}
    assert "routes agree 0.988" in progress_line(step, 12)
    del step["actor/router_replay/route_agreement"]
    assert "routes agree" not in progress_line(step, 12)


def test_expert_load_heat_map_written_from_verl_moe_metrics(tmp_path):
    from dsv3_rl.grpo.progress import write_plots

    steps = [{"step": i, "critic/score/mean": 0.1 * i, "rollout/moe/max_vio/layer_1": 0.2 * i,
              "rollout/moe/max_vio/layer_2": 1.5} for i in (1, 2, 3)]
    paths = write_plots(steps, tmp_path / "with")
    assert [p.name for p in paths] == ["reward.png", "consistency.png", "expert_load.png"]
    assert paths[-1].stat().st_size > 1000
    # twin: without the metrics (no R3) there is no heat map
    plain = [{k: v for k, v in s.items() if not k.startswith("rollout/moe")} for s in steps]
    assert [p.name for p in write_plots(plain, tmp_path / "without")] == ["reward.png", "consistency.png"]
