"""Train/rollout consistency (issue 16): the metrics, verl's replay check (patch 0020) and the
``dsv3-consistency`` tool end to end (vLLM CPU build vs the megatron model, with verl's R3 replay)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dsv3_rl.consistency import metrics


def _routes(rows):
    """[tokens, layers=2, top_k] with a dense layer 0 (-1) and routed layer 1."""
    t = torch.full((len(rows), 2, len(rows[0])), -1, dtype=torch.int16)
    t[:, 1] = torch.tensor(rows, dtype=torch.int16)
    return t


def test_route_agreement_compares_expert_sets_not_their_order():
    a = _routes([[0, 1, 2, 3], [4, 5, 6, 7]])
    b = _routes([[3, 2, 1, 0], [7, 6, 5, 4]])
    overall, per_layer = metrics.route_agreement([a], [b])
    assert overall == 1.0 and per_layer == [{"layer": 1, "route_agreement": 1.0}]


def test_route_agreement_counts_one_changed_expert():  # twin of the above
    a = _routes([[0, 1, 2, 3], [4, 5, 6, 7]])
    b = _routes([[0, 1, 2, 4], [4, 5, 6, 7]])
    assert metrics.route_agreement([a], [b])[0] == 0.5


def test_route_agreement_refuses_records_of_different_length():
    with pytest.raises(ValueError, match="differ in shape"):
        metrics.route_agreement([_routes([[0, 1]])], [_routes([[0, 1], [0, 1]])])


def test_logprob_gap_against_hand_computed_values():
    roll = torch.tensor([-1.0, -2.0])
    train = torch.tensor([-1.5, -2.0])
    gap = metrics.logprob_gap([roll], [train])
    r = -0.5
    assert gap["logprob_abs_diff_mean"] == pytest.approx(0.25)
    assert gap["logprob_abs_diff_max"] == pytest.approx(0.5)
    assert gap["k3_kl"] == pytest.approx(((torch.tensor(r).exp() - 1 - r) / 2).item())
    assert metrics.logprob_gap([roll], [roll])["k3_kl"] == 0.0


def test_group_limit_violations_and_expert_load():
    # 8 experts in 4 groups of 2, at most 2 groups per token
    ok = _routes([[0, 1, 6, 7], [2, 3, 4, 5]])
    bad = _routes([[0, 2, 4, 6], [0, 1, 2, 3]])
    assert metrics.group_limit_violations([ok], 8, 4, 2) == 0
    assert metrics.group_limit_violations([bad], 8, 4, 2) == 1
    load, stats = metrics.expert_load([ok], 8)
    assert load[1].tolist() == [1] * 8 and load[0].sum() == 0
    assert stats == [{"layer": 1, "max_over_mean": 1.0, "idle_experts": 0}]


def _verl_replay():
    import os

    os.environ.setdefault("VERL_PLATFORM", "cpu")
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

    rr = RouterReplay()
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return rr


def _native_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_verl_replay_refuses_routes_that_break_the_group_limit():
    rr = _verl_replay()
    scores = torch.rand(2, 8)
    rr.set_target_indices(torch.tensor([[0, 1, 6, 7], [0, 2, 4, 6]]))
    with pytest.raises(RuntimeError, match=r"1 of 2 replayed tokens break the group limit.*row 1.*\[0, 2, 4, 6\].*moe_router_group_topk=2"):
        rr.get_replay_topk(scores, 4, num_groups=4, group_topk=2, default_compute_topk=_native_topk)


def test_verl_replay_takes_routes_within_the_group_limit():  # twin: the check lets good routes through
    rr = _verl_replay()
    scores = torch.rand(2, 8)
    target = torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5]])
    rr.set_target_indices(target)
    probs, idx = rr.get_replay_topk(scores, 4, num_groups=4, group_topk=2, default_compute_topk=_native_topk)
    assert torch.equal(idx, target) and torch.equal(probs, scores.gather(1, target))


def test_verl_replay_refuses_expert_ids_out_of_range():
    rr = _verl_replay()
    rr.set_target_indices(torch.tensor([[0, 1, 2, 8]]))
    with pytest.raises(RuntimeError, match=r"expert id 8 is outside 0\.\.7"):
        rr.get_replay_topk(torch.rand(1, 8), 4, default_compute_topk=_native_topk)


def _cli(*args, timeout=1200):
    return subprocess.run([sys.executable, "-m", "dsv3_rl.consistency.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_refuses_bad_input_with_one_line(tmp_path, capsys):
    """Exit 2 and one line on stderr. One real launch for the shell's view of it; the other inputs through the same
    main() in this process (each launch imports torch: ~10 s on a loaded 2-core box), refused before any model loads."""
    from dsv3_rl.consistency import cli

    bad = tmp_path / "p.json"
    bad.write_text('{"not": "a list"}')
    for i, (args, needle) in enumerate(((["run", "--prompts", str(bad)], "must be a non-empty JSON list"),
                                        (["run", "--model", str(tmp_path)], "no config.json"))):
        if i == 0:
            proc = _cli(*args, timeout=120)
            rc, err = proc.returncode, proc.stderr
        else:
            rc, err = cli.main(args), capsys.readouterr().err
        assert rc == 2, err
        assert err.strip().startswith("error:") and needle in err and len(err.strip().splitlines()) == 1
    for args, needle in ((["run", "--min-agreement", "2"], "argument --min-agreement: '2' is not a number within 0..1"),
                         (["run", "--max-tokens", "0"], "argument --max-tokens: '0' is not an integer >= 1")):
        with pytest.raises(SystemExit) as e:  # argparse: its usage line, then the error naming the flag
            cli.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.strip().splitlines()[-1].endswith(needle), err


@pytest.fixture(scope="module")
def rollout_cache(tmp_path_factory):
    """Shared by run and check-faults: the clean vLLM rollout (the same inputs in both) is made once."""
    return tmp_path_factory.mktemp("rollouts")


def test_rollout_key_names_every_input(tmp_path):
    from dsv3_rl.consistency.cli import rollout_key

    (tmp_path / "config.json").write_text("{}")
    args = dict(model=tmp_path, prompts=["a"], dtype="bf16", max_tokens=4, seed=0, fault=None, max_model_len=512)
    key = rollout_key(**args)
    assert rollout_key(**args) == key
    for k, v in (("prompts", ["b"]), ("dtype", "fp32"), ("max_tokens", 5), ("seed", 1), ("fault", "no_group_limit"),
                 ("max_model_len", 256)):
        assert rollout_key(**{**args, k: v}) != key, k  # twin: another input is another rollout
    (tmp_path / "model.safetensors").write_bytes(b"x")  # the model's files changed
    assert rollout_key(**args) != key


@pytest.mark.slow
def test_run_passes_its_gates_on_the_demo_model(tmp_path, rollout_cache):
    out = tmp_path / "report.json"
    proc = _cli("run", "--json", str(out), "--out", str(tmp_path / "plots"), "--rollout-cache", str(rollout_cache))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["dtype"] == "bf16" and rep["passed"]
    for key in ("without_replay", "with_replay"):
        assert set(rep[key]) >= {"route_agreement", "logprob_abs_diff_mean", "logprob_abs_diff_max", "per_layer"}
    assert rep["with_replay"]["route_agreement"] == 1.0
    assert [p["layer"] for p in rep["with_replay"]["per_layer"]] == [1, 2, 3]  # layer 0 is dense
    assert rep["group_limit_violations"] == 0
    assert (tmp_path / "plots" / "expert_load.png").stat().st_size > 0
    assert "PASSED" in proc.stdout.splitlines()[-1]


@pytest.mark.slow
def test_check_faults_sees_every_planted_fault_fail(tmp_path, rollout_cache):
    out = tmp_path / "faults.json"
    clean_made = list(rollout_cache.glob("rollout-clean-*.pt"))  # by the run test above, when it ran
    proc = _cli("check-faults", "--json", str(out), "--rollout-cache", str(rollout_cache))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reused = [ln for ln in proc.stdout.splitlines() if ln.startswith("vLLM rollout (")]
    assert reused == ([f"vLLM rollout (clean) reused: {clean_made[0]}"] if clean_made else []), reused
    rep = json.loads(out.read_text())
    faults = {r["fault"]: r["failed"] for r in rep["faults"]}
    assert faults.pop("none (clean)") == []
    assert set(faults) == {"shift_routes", "replay_logprob_only", "zero_expert_bias", "no_group_limit"}
    assert all(faults.values()), faults
    assert any("group limit" in f for f in faults["no_group_limit"])
    assert faults["replay_logprob_only"] == ["replay: trainer routes == vLLM routes (update)"]


def _store_steps(store, swap_order=False):
    """Two requests through prefill chunks, decoding and a recomputation of B after preemption.
    Layer 1 routes token at position p of request r to experts [base + p] * 2 (A: base 0, B: base 100 // 4)."""
    from dsv3_rl.consistency.vllm_routes import RouteStore  # noqa: F401  (the type under test)

    def step(reqs):  # reqs: [(req_id, [positions])]
        order = list(reversed(reqs)) if swap_order else reqs
        rows, pos = [], []
        for req, ps in reqs:
            base = 0 if req.startswith("A") else 25
            rows += [[base + p, base + p] for p in ps]
            pos += ps
        store.capture(1, torch.tensor(rows))
        store.commit([r for r, _ in order], {r: len(ps) for r, ps in reqs}, torch.tensor(pos))

    step([("A-1a2b", [0, 1]), ("B-9f9f", [0, 1, 2])])  # prefill (A in two chunks)
    step([("A-1a2b", [2]), ("B-9f9f", [3])])
    step([("A-1a2b", [3])])  # B preempted
    step([("A-1a2b", [4]), ("B-9f9f", [0, 1, 2, 3])])  # B recomputed from the start
    step([("B-9f9f", [4])])


def _expected(base, n):
    t = torch.full((n, 2, 2), -1, dtype=torch.int16)
    t[:, 1] = torch.tensor([[base + p, base + p] for p in range(n)], dtype=torch.int16)
    return t


def test_vllm_route_store_files_rows_by_request_and_position():
    from dsv3_rl.consistency.vllm_routes import RouteStore

    store = RouteStore(num_layers=2, top_k=2)
    _store_steps(store)
    a, b = store.pop("A"), store.pop("B")  # vLLM's internal ids carry a suffix
    assert torch.equal(torch.from_numpy(a), _expected(0, 5))
    assert torch.equal(torch.from_numpy(b), _expected(25, 5))
    assert store.pop("A") is None  # popped once


def test_vllm_route_store_twin_rows_filed_under_the_wrong_request_are_seen():
    from dsv3_rl.consistency.vllm_routes import RouteStore

    store = RouteStore(num_layers=2, top_k=2)
    _store_steps(store, swap_order=True)  # the runner's batch order is not the order of the rows
    assert not torch.equal(torch.from_numpy(store.pop("A")), _expected(0, 5))


def test_verl_replay_counts_route_agreement():
    """Patch 0023: in R3 (replay mask given) the router counts the replayed rows whose experts equal its own top-k."""
    rr = _verl_replay()
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.9, 0.8, 0.1, 0.0], [0.9, 0.8, 0.1, 0.0]])
    rr.set_target_indices(torch.tensor([[1, 0], [2, 3], [2, 3]]), replay_mask=torch.tensor([True, True, False]))
    _, idx = rr.get_replay_topk(scores, 2, default_compute_topk=_native_topk)
    assert (rr.route_agree, rr.route_total) == (1, 2)  # row 0 agrees (as a set), row 1 does not, row 2 is not replayed
    assert idx.tolist() == [[1, 0], [2, 3], [0, 1]]


def test_verl_moe_load_metrics_leave_out_dense_layers():
    """Patch 0024: rows marked -1 (dense layers in the routes recorded on CPU) do not void the step's metrics."""
    from verl.trainer.ppo.metric_utils import compute_rollout_moe_load_balance_metrics

    routes = torch.full((1, 5, 2, 2), -1, dtype=torch.int16)  # [bsz, seq, layers (0 dense, 1 routed), top_k]
    routes[0, :, 1] = torch.tensor([[0, 1], [0, 1], [2, 3], [0, 1], [0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1]])  # the last response row is dropped by verl (never fed)
    m = compute_rollout_moe_load_balance_metrics(routes, mask, num_experts=4)
    # routed layer: counts [3, 3, 1, 1] of 8 -> share * 4 - 1 = [0.5, 0.5, -0.5, -0.5]
    assert m["rollout/moe/max_vio/layer_1"] == pytest.approx(0.5) and m["rollout/moe/min_vio/layer_1"] == pytest.approx(-0.5)
    assert m["rollout/moe/max_vio/layer_0"] == pytest.approx(-1.0)  # dense: nothing counted
    routes[0, 0, 1, 0] = 4  # twin: an id beyond the expert count still voids the metrics
    assert compute_rollout_moe_load_balance_metrics(routes, mask, num_experts=4) == {}


def _replay_check(tmp_path, layout, *extra):
    import os

    out = tmp_path / "replay.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dsv3_rl.consistency.replay_check", "--layout", layout, "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=600, env=env)
    return proc, (json.loads(out.read_text()) if out.is_file() else None)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp=2,ep=2,etp=1", "pp=2"])
def test_replay_check_records_and_replays_at_two_ranks(tmp_path, layout):
    """verl's router replay over gloo at TP2 x EP2 (+SP) and PP2: replayed routes are the recorded ones, the loss is
    bit-identical, and a perturbed router is held to them (it alone agrees with ~40%)."""
    proc, rep = _replay_check(tmp_path, layout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rep["world"] == 2 and rep["replay_agreement"] == 1.0 and rep["replay_perturbed_agreement"] == 1.0
    assert rep["loss_replay"] == rep["loss_record"] and rep["native_perturbed_agreement"] < 0.9


@pytest.mark.slow
def test_replay_check_twin_shifted_routes_fail(tmp_path):
    proc, rep = _replay_check(tmp_path, "tp=2,ep=2,etp=1", "--fault", "shift")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [g["gate"] for g in rep["gates"] if not g["passed"]]
    assert "replayed routes == recorded routes" in failed and rep["replay_agreement"] < 0.9
