"""Shared pytest setup: CPU-friendly defaults for every test process (and the ones it spawns)."""

import os
import sys
from pathlib import Path

# torch.compile costs ~22 s per process on 2 cores and buys nothing at these sizes.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


import pytest  # noqa: E402

# megatron-core's LanguageModule (every GPTModel built in the pytest process) exports TransformerEngine's
# attention switches into os.environ, and a later model with another attention_backend, in this process or
# in a subprocess inheriting the environment, then fails megatron's check ("NVTE_FLASH_ATTN set to 1, but
# expected 0"). Put them back as they were after every test.
from dsv3_rl.launch.run import TE_ATTENTION_ENV as _TE_ATTENTION_ENV  # noqa: E402


# The full MATH-lighteval / GSM8K samples the committed fixtures and the cached tokenizer were cut from are not
# in the repo: DSV3_SHARED_DATA names their directory, else ../shared/data next to the clone (where CI has them).
SHARED_DATA = Path(os.environ.get("DSV3_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
SHARED_SAMPLES = ("MATH-lighteval-sample", "gsm8k-sample")


@pytest.fixture
def shared_data() -> Path:
    """The directory holding the full samples; a missing one FAILS the test (never a skip)."""
    missing = [n for n in SHARED_SAMPLES if not (SHARED_DATA / n).is_dir()]
    if missing:
        pytest.fail(f"{SHARED_DATA}: missing {', '.join(missing)}/ (the full data samples, not in the repo): set "
                    f"DSV3_SHARED_DATA to a directory holding {' and '.join(s + '/' for s in SHARED_SAMPLES)}",
                    pytrace=False)
    return SHARED_DATA


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = {k: os.environ.get(k) for k in _TE_ATTENTION_ENV}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    guard = sys.modules.get("dsv3_rl.mcore.mla_attention_guard")  # megatron's patch-0011 hook records them too
    for k in _TE_ATTENTION_ENV:
        getattr(guard, "MCORE_SET_ENV", {}).pop(k, None)


@pytest.fixture(scope="module", autouse=True)
def _no_leaked_process_group(request):
    """A test module that leaves torch.distributed or megatron's parallel state initialized makes the
    next in-process ``init_process_group`` fail ("trying to initialize the default process group
    twice!") in an unrelated test. Torn down after the module's own fixtures: clean up and fail there,
    naming the module."""
    yield
    tdist = sys.modules.get("torch.distributed")
    ps = sys.modules.get("megatron.core.parallel_state")
    leaked = []
    if ps is not None and ps.model_parallel_is_initialized():
        leaked.append("megatron parallel_state")
        ps.destroy_model_parallel()
    if tdist is not None and tdist.is_available() and tdist.is_initialized():
        leaked.append("torch.distributed default process group")
        tdist.destroy_process_group()
    if leaked:
        pytest.fail(f"{request.node.nodeid} left {' and '.join(leaked)} initialized (now destroyed); "
                    "tear down what a test sets up", pytrace=False)


@pytest.fixture(scope="session")
def grpo_work(tmp_path_factory):
    """WORK_DIR of every GRPO launch of the session (test_grpo_learning.py, test_algorithm_demos.py, the fault
    chain): the tiny model converted HF -> mcore and the data prepared once, not once per module (issue 28). Each run
    keeps its own CKPT_DIR and LOG_DIR (named after the run, no two alike)."""
    return tmp_path_factory.mktemp("grpo_work")


@pytest.fixture(scope="session")
def fault_chain(tmp_path_factory, grpo_work):
    """The GRPO runs with a killed worker, a killed engine, a damaged checkpoint and a SIGTERM, then resumed
    (tests/unit/grpo_fault_chain.py), once per session: test_launch_faults.py and the resume test of
    test_grpo_learning.py each assert their part of it (issue 28: one chain of launches for both)."""
    from grpo_fault_chain import run_chain  # tests/unit is on sys.path (pytest's prepend import mode)

    return run_chain(tmp_path_factory.mktemp("fault_chain"), work=grpo_work)


#: The files of `make test`'s xdist phase that take longest, longest first (pytest's durations summed per file on
#: the 2-core box: 2026-12-07's slow day, docs/results/2026-12-07-ci/phase1-cpu-by-file.txt, test_mcore_patches.py
#: ~480 s down to test_planner_validation.py ~30 s, reordered after that day's trims of test_verl_cpu_megatron.py
#: and test_convert.py, docs/ci-history.md "fifth session"; the other ~60 files take ~200 s together). pytest-xdist's ``--dist loadfile`` hands a file to whichever
#: worker frees up, by default the files with the most tests first (90 one-second tests before one 150-s test), so a
#: long file could start last and keep one core busy while the other had nothing left. The Makefile passes
#: ``--no-loadscope-reorder`` (collection order) and this hook puts these first: the last files handed out are
#: short ones (issue 28, docs/ci.md).
LONGEST_FILES = ("test_mcore_patches.py", "test_convert.py", "test_consistency.py", "test_correctness_layouts.py",
                 "test_correctness_four.py", "test_mcore_fastpath.py", "test_launch_resilience.py",
                 "test_bench_grpo_update.py", "test_verl_cpu_megatron.py", "test_launch_dryrun.py",
                 "test_verl_patches_config.py", "test_verl_cpu_platform.py", "test_launch_ray.py",
                 "test_verl_ckpt_restore.py", "test_mcore_fastpath_mla_guard.py", "test_planner_validation.py")


#: ``make test`` runs the ``e2e`` GRPO runs in two pytest processes side by side (``--e2e-lane 1/2``, ``2/2``;
#: ``E2E_LANES=1``: one at a time; docs/ci-history.md "Fifth pass", "Sixth pass"): one launch leaves ~23 % of the two cores idle (its start-up is a chain of one process after another), two fill
#: them (2026-11-27, 2-core box: the e2e phase 30:29 -> 24:53, peak memory used 19.6 of 23 GiB; docs/ci-history.md "Fifth
#: pass"). Lane 2 is these tests (node-id prefixes): the two algorithm demos (the DAPO one at PP2 with the R3 test on
#: its run, the one-step-off one with a killed engine and its restart: 3 start-ups); lane 1 every other e2e test: the
#: fault chain (3 start-ups) with the resume test, and the sound run (the demo's, in CI). Since 2026-12-07 (docs/ci-history.md
#: "fifth session"). A test no prefix names runs in lane 1, so a renamed test moves lanes but is never dropped.
E2E_LANE_2 = ("tests/unit/test_algorithm_demos.py::",)  # its demos serve the R3 and killed-engine tests: one file, one lane


def e2e_lane(nodeid: str) -> int:
    """The lane (1 or 2) of the e2e test NODEID (E2E_LANE_2)."""
    return 2 if nodeid.startswith(E2E_LANE_2) else 1


def pytest_addoption(parser):
    parser.addoption("--e2e-lane", default=None, choices=("1/2", "2/2"),
                     help="run only the e2e tests of this lane (make test runs both side by side; tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection sees the markers
def pytest_collection_modifyitems(config, items):
    """An ``e2e`` test (a whole GRPO run) is always ``slow`` too: it never lands in ``make test-fast``'s
    parallel phase, where it would share the two cores with other tests. Then LONGEST_FILES first, in that order,
    every other file after them as collected (a stable sort: a file's tests keep their order). With ``--e2e-lane``,
    the e2e tests of the other lane are deselected (``e2e_lane``)."""
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    lane = config.getoption("--e2e-lane")
    if lane:
        other = [i for i in items if i.get_closest_marker("e2e") and e2e_lane(i.nodeid) != int(lane[0])]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [i for i in items if i not in other]
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))
