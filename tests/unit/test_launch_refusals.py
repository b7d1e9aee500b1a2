"""What the launcher refuses before anything starts (issue 29's probe): an unrecognised DRY_RUN value, a forced stage
the run does not use, a GPU preset where no GPU is visible (the dry run says so), another run's directory. Each with
the twin that is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv3_rl.errors import UsageError, env_flag
from dsv3_rl.launch.cli import main


@pytest.mark.parametrize("value,want", [("y", True), ("YES", True), ("1", True), ("on", True), ("n", False),
                                        ("0", False), ("off", False), ("", False)])
def test_env_flag_words(value, want):
    assert env_flag("X", environ={"X": value}) is want
    assert env_flag("X", default=True, environ={}) is True  # unset: the default


@pytest.mark.parametrize("value", ["maybe", "2", "yess", "dry"])
def test_env_flag_refuses_anything_else(value):
    with pytest.raises(UsageError, match=f"X={value!r} is not a yes/no value"):
        env_flag("X", environ={"X": value})


def _dry(monkeypatch, tmp_path, value):
    monkeypatch.setenv("WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("DRY_RUN", value)


def test_dry_run_y_is_a_dry_run_and_an_unknown_value_is_refused(tmp_path, monkeypatch, capsys):
    _dry(monkeypatch, tmp_path, "y")  # probe: 'y' started a real run (its convert stage ran)
    assert main(["--preset", "tiny_cpu", "--quiet"]) == 0
    assert "dry run tiny_cpu: OK" in capsys.readouterr().out
    assert not (tmp_path / "work" / "models").exists()  # nothing converted
    _dry(monkeypatch, tmp_path, "maybe")
    assert main(["--preset", "tiny_cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "DRY_RUN='maybe' is not a yes/no value" in err
    assert not (tmp_path / "work" / "models").exists()


def test_force_stage_of_a_stage_the_run_does_not_use_is_refused(tmp_path, monkeypatch, capsys):
    _dry(monkeypatch, tmp_path, "1")
    assert main(["--preset", "tiny_cpu", "--quiet", "--force-stage", "weights"]) == 2
    err = capsys.readouterr().err
    assert "--force-stage 'weights': this run does not use that stage" in err and "convert" in err
    assert main(["--preset", "tiny_cpu", "--quiet", "--force-stage", "convert"]) == 0  # twin: a stage it runs


def test_an_unknown_force_stage_is_refused_while_parsing(tmp_path, monkeypatch, capsys):
    """issue 41: refused after ~57 s of validation before; now by argparse, before the preset is resolved."""
    import time

    from dsv3_rl.launch import run as launch_run
    from dsv3_rl.launch.stages import STAGE_NAMES

    _dry(monkeypatch, tmp_path, "1")
    monkeypatch.setattr(launch_run, "resolve", lambda *a, **k: pytest.fail("resolved before refusing --force-stage"))
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny_cpu", "--quiet", "--force-stage", "bogus"])
    assert e.value.code == 2 and time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert "--force-stage: invalid choice: 'bogus'" in err and "'convert'" in err
    # twin: every stage a run can build is a choice (test_force_stage_of_a_stage_the_run_does_not_use_is_refused
    # passes "weights" and "convert" through the parser)
    from dsv3_rl.launch import stages as stages_mod

    src = Path(stages_mod.__file__).read_text()
    import re

    assert set(re.findall(r'Stage\("(\w+)"', src)) == set(STAGE_NAMES)


def test_gpu_preset_without_a_gpu_is_refused_and_the_dry_run_says_so(tmp_path, monkeypatch, capsys):
    from dsv3_rl.launch import platform

    monkeypatch.setattr(platform, "local_gpus", lambda: 0)
    _dry(monkeypatch, tmp_path, "1")
    assert main(["--preset", "tiny_1xH100", "--quiet"]) == 0  # check-all dry-runs GPU presets on CPU boxes
    out = capsys.readouterr().out
    assert "warning: [hardware] preset tiny_1xH100 needs H100 GPUs" in out
    assert "this machine has none visible" in out and "a run here is refused" in out
    _dry(monkeypatch, tmp_path, "0")
    assert main(["--preset", "tiny_1xH100", "--quiet"]) == 1
    assert "refusing to start tiny_1xH100" in capsys.readouterr().err
    assert not (tmp_path / "work" / "models").exists()  # no stage ran, no Ray started
    # twin: with a GPU visible the finding is gone
    monkeypatch.setattr(platform, "local_gpus", lambda: 1)
    _dry(monkeypatch, tmp_path, "1")
    assert main(["--preset", "tiny_1xH100", "--quiet"]) == 0
    assert "none visible" not in capsys.readouterr().out


@pytest.mark.slow  # three verl compositions: 8-23 s on 2 cores
def test_a_value_of_the_wrong_kind_is_bad_input_from_the_command_line_and_the_preset(tmp_path, monkeypatch, capsys):
    """issue 41: 'data.train_batch_size=abc' crashed the checks ('unexpected ValueError ... a bug', exit 1);
    now exit 2 naming the key and where the value came from, the same from a preset."""
    from dsv3_rl.recipes.presets import PRESET_DIR

    _dry(monkeypatch, tmp_path, "1")
    assert main(["--preset", "tiny_cpu", "--quiet", "data.train_batch_size=abc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: data.train_batch_size='abc' (from the command line): verl's data.train_batch_size is "
                       "a number (its default: 1024)")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {PRESET_DIR / 'tiny_cpu.yaml'}\nverl: {{data: {{train_batch_size: abc}}, "
                   "trainer: {val_before_train: 2}}\n")
    assert main(["--preset", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "data.train_batch_size='abc' (from preset bad)" in err and "trainer.val_before_train=2" in err
    assert "true/false" in err
    from dsv3_rl.launch import run as launch_run  # twin: a number is accepted (the same check, before the validation)

    assert launch_run.resolve("tiny_cpu", ["data.train_batch_size=16"], validate=False).cfg.data.train_batch_size == 16


@pytest.mark.slow  # two verl compositions: ~10 s on 2 cores
def test_a_text_value_verl_declares_as_text_is_accepted(tmp_path):
    """verl's RolloutCorrectionConfig.rollout_is_threshold is ``str | float`` (IcePop's "0.5_5.0") though the yaml's
    default is 2.0: the kind comes from verl's dataclass where one declares the key (the first version refused
    test_rollout_correction's IcePop preset). Twin: the same text for algorithm.gamma (declared float) is refused."""
    from dsv3_rl.launch import run as launch_run
    from dsv3_rl.recipes.presets import PRESET_DIR
    from dsv3_rl.verl_glue.compose import VerlConfigError

    icepop = tmp_path / "icepop.yaml"
    icepop.write_text(f"extends: {PRESET_DIR / 'tiny_cpu.yaml'}\nverl: {{algorithm: {{rollout_correction: "
                      "{rollout_is: token, rollout_is_threshold: '0.5_5.0'}}}\n")
    cfg = launch_run.resolve(str(icepop), [], validate=False).cfg
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_5.0"
    with pytest.raises(VerlConfigError, match=r"algorithm.gamma='0.5_5.0' \(from the command line\): verl's "
                                              r"algorithm.gamma is a number"):
        launch_run.resolve(str(icepop), ["algorithm.gamma='0.5_5.0'"], validate=False)
