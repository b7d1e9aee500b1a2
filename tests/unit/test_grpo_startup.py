"""The start-up line of a GRPO run (dsv3_rl.grpo.progress.startup_phases / startup_line): where the ~2.5 minutes
before step 1 go, read from the times verl and Ray write into main_ppo.log. Lines copied from a real tiny_cpu run
(2026-11-26, shortened)."""

from __future__ import annotations

from dsv3_rl.grpo.progress import ATTEMPT_HEADER, startup_line, startup_phases

LOG = """
===== [dsv3-grpo] attempt: python -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer ... (resume from step None) =====
INFO:2026-11-26 10:44:19,682:Platform override from VERL_PLATFORM: cpu
[validate_config] All configuration checks passed successfully!
2026-11-26 10:44:29,162\tINFO worker.py:2038 -- Started a local Ray instance.
(TaskRunnerV1 pid=25800) INFO:2026-11-26 10:44:42,306:Platform override from VERL_PLATFORM: cpu
(TaskRunnerV1 pid=25800) INFO:2026-11-26 10:45:10,393:train and validate dataloader initialized, train dataset size: 54
(TaskRunnerV1 pid=25800) INFO:2026-11-26 10:45:10,394:Total training steps: 12
(TaskRunnerV1 pid=25800) INFO:2026-11-26 10:45:42,127:actor and ref model engine initialized
(vLLMHttpServer pid=27631) (MainProcess pid=27631) WARNING 11-26 10:46:34 [api_router.py:33] LoRA dynamic loading
(TaskRunnerV1 pid=25800) INFO:2026-11-26 10:46:35,602:checkpoint engine manager initialized
(TaskRunnerV1 pid=25800) INFO:2026-11-26 10:46:35,678:Training from scratch
(WorkerDict pid=26885) INFO:2026-11-26 10:46:37,703:update_weights done, time cost: 2.02s
(vLLMHttpServer pid=27630) (MainProcess pid=27630) WARNING 11-26 10:46:51 [input_processor.py:375] Passing raw prompts to InputProcessor is deprecated
(TaskRunnerV1 pid=25800) ('Initial validation metrics: '
(WorkerDict pid=26885) INFO:2026-11-26 10:47:07,000:update_weights done, time cost: 0.30s
"""


def test_phases_from_the_log_times():
    got = dict(startup_phases(LOG))
    want = {"Ray": 9.48, "trainer + data": 41.231, "Megatron workers": 31.734, "vLLM engines": 53.475,
            "first weight sync": 2.101, "agent loop": 13.297}
    assert got.keys() == want.keys() and all(abs(got[k] - v) < 1e-3 for k, v in want.items()), got


def test_line(tmp_path):
    log = tmp_path / "main_ppo.log"
    log.write_text(LOG)
    assert startup_line(log) == ("[dsv3-grpo] start-up 151s after main_ppo's imports: Ray 9s, trainer + data 41s, "
                                 "Megatron workers 32s, vLLM engines 53s, first weight sync 2s, agent loop 13s")


def test_twin_only_the_last_attempt_counts():
    """A resumed run appends a second attempt to the same log: its start-up is measured, not the first one's
    (nor the span across both)."""
    second = LOG.replace("10:46:37,703", "10:46:38,703").replace("10:4", "11:4")
    assert second.count(ATTEMPT_HEADER) == 1
    phases = dict(startup_phases(LOG + second))
    assert abs(phases["first weight sync"] - 3.101) < 1e-3 and abs(phases["Ray"] - 9.48) < 1e-3, phases


def test_twin_missing_milestone_is_left_out_and_a_log_without_any_gives_none(tmp_path):
    phases = dict(startup_phases(LOG.replace("actor and ref model engine initialized", "something else")))
    assert "Megatron workers" not in phases
    assert abs(phases["vLLM engines"] - (31.734 + 53.475)) < 1e-3  # counted from the milestone before it
    (tmp_path / "died.log").write_text("Traceback (most recent call last):\nImportError: no ray\n")
    assert startup_line(tmp_path / "died.log") is None
    assert startup_line(tmp_path / "missing.log") is None
