"""What the launcher refuses before anything starts (issue 29's probe): an unrecognised DRY_RUN value, a forced stage
the run does not use, a GPU preset where no GPU is visible (the dry run says so), another run's directory. Each with
the twin that is accepted."""

from __future__ import annotations

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
