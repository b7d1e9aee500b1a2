"""Rollout correction chosen by name in a preset (dsv3_rl.recipes.rollout_correction).

(a) Every mode dry-runs against verl 0.9.1's real config (a preset extending ``tiny_cpu`` with
    ``rollout_correction: <mode>``, resolved and validated like ``--dry-run``), and the composed
    ``algorithm.rollout_correction`` equals the verl factory the mode is named after
    (``RolloutCorrectionConfig.decoupled_token_is()`` ...): the reference is verl's own code, not our table.
    Twins: each composed config differs from every other mode's factory; an unknown name is a PresetError.
(b) The keys a mode emits, fed to verl's own ``compute_rollout_correction_and_rejection_mask`` on a
    hand-made batch, give the weights / mask of the formula (computed here from log-probs with ``math``).
    Twins: the formula with the ratio inverted, without truncation, clamped instead of zeroed, or
    rejecting per token instead of per sequence does not match.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest

from dsv3_rl.recipes import rollout_correction
from dsv3_rl.recipes.presets import PRESET_DIR, PresetError, load_preset

TINY = PRESET_DIR / "tiny_cpu.yaml"
NODE = "algorithm.rollout_correction"


def _preset(tmp, name: str, body: str):
    p = tmp / f"{name}.yaml"
    p.write_text(f"extends: {TINY}\n{body}")
    return p


def _factories():
    """mode -> verl's RolloutCorrectionConfig factory it is documented to be (verl/trainer/config/algorithm.py)."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig as R

    return {"none": R.disabled(), "tis": R.decoupled_token_is(), "seq_tis": R.decoupled_seq_is(),
            "mis": R.decoupled_seq_is_rs(), "icepop": R.decoupled_token_icepop()}


def _fields(cfg) -> dict:
    """The public fields of a RolloutCorrectionConfig, or of a composed config node, as a plain dict."""
    from omegaconf import DictConfig, OmegaConf
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    names = [f.name for f in dataclasses.fields(RolloutCorrectionConfig) if not f.name.startswith("_")]
    if isinstance(cfg, DictConfig):
        d = OmegaConf.to_container(cfg, resolve=True)
        return {k: d[k] for k in names}
    return {k: getattr(cfg, k) for k in names}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Each mode (and tis with a preset-level threshold) resolved and validated like `--dry-run`."""
    from dsv3_rl.launch import run

    tmp = tmp_path_factory.mktemp("rc")
    env = {"WORK_DIR": str(tmp / "work"), "PATH": os.environ["PATH"]}
    out = {}
    for mode in rollout_correction.MODES:
        out[mode] = run.resolve(str(_preset(tmp, f"tiny_rc_{mode}", f"rollout_correction: {mode}\n")), [], env)
    tuned = "rollout_correction: tis\nverl: {algorithm: {rollout_correction: {rollout_is_threshold: 3.0}}}\n"
    out["tis_tuned"] = run.resolve(str(_preset(tmp, "tiny_rc_tis_tuned", tuned)), [], env)
    return out


# ---------------------------------------------------------------------------------------- (a) config


def test_the_modes_are_the_documented_five():
    assert list(rollout_correction.MODES) == ["none", "tis", "seq_tis", "mis", "icepop"]
    assert load_preset("tiny_cpu").rollout_correction == "none"  # a preset without the key: verl's defaults
    for name in ("671b_512xH100", "671b_96xH20"):  # the choice docs/launcher.md argues for
        assert load_preset(name).rollout_correction == "tis", name


@pytest.mark.parametrize("mode", list(rollout_correction.MODES))
def test_every_mode_dry_runs_and_is_verls_factory(mode, launches):
    from omegaconf import OmegaConf

    launch = launches[mode]
    assert launch.preset.rollout_correction == mode
    assert launch.errors == [], "\n".join(map(str, launch.errors))
    composed = _fields(OmegaConf.select(launch.cfg, NODE))
    assert composed == _fields(_factories()[mode])
    if mode != "none":  # without vLLM's log-probs verl skips the correction (ray_trainer.py:1650-1653)
        assert OmegaConf.select(launch.cfg, "actor_rollout_ref.rollout.calculate_log_probs") is True
        assert f"{NODE}.rollout_is={composed['rollout_is']}" in launch.argv
    else:  # nothing on the command line: verl's yaml defaults are the 'disabled' factory
        assert not any(a.startswith(f"{NODE}.") for a in launch.argv)


def test_each_composed_mode_differs_from_every_other_factory(launches):
    """Twin of the equality above: the comparison tells the modes apart."""
    from omegaconf import OmegaConf

    refs = {m: _fields(f) for m, f in _factories().items()}
    for mode in rollout_correction.MODES:
        composed = _fields(OmegaConf.select(launches[mode].cfg, NODE))
        assert [m for m, ref in refs.items() if ref == composed] == [mode]


def test_preset_verl_keys_tune_the_mode(launches):
    from omegaconf import OmegaConf

    launch = launches["tis_tuned"]
    assert launch.errors == []
    node = OmegaConf.select(launch.cfg, NODE)
    assert node.rollout_is == "token" and node.rollout_is_threshold == 3.0
    assert _fields(node) != _fields(_factories()["tis"])


def test_unknown_mode_is_an_error_naming_file_key_and_allowed_values(tmp_path):
    bad = _preset(tmp_path, "tiny_rc_bad", "rollout_correction: tsi\n")
    with pytest.raises(PresetError) as e:
        load_preset(bad)
    msg = str(e.value)
    assert str(bad) in msg and "rollout_correction='tsi'" in msg and "did you mean 'tis'" in msg
    assert "allowed: none, tis, seq_tis, mis, icepop" in msg
    mapping = _preset(tmp_path, "tiny_rc_map", "rollout_correction: {rollout_is: token}\n")
    with pytest.raises(PresetError, match=r"rollout_correction=\{'rollout_is': 'token'\}.*allowed: none, tis"):
        load_preset(mapping)
    with pytest.raises(ValueError, match="allowed: none, tis, seq_tis, mis, icepop"):
        rollout_correction.verl_tree("TIS")


# ------------------------------------------------------------------------------ (b) verl's weights

# Three sequences of 4 tokens; per-token ratio r = p_train / p_rollout. Padding (mask 0) carries a
# ratio of 10 so that counting it would show.
RATIOS = [[1.2, 3.0, 0.4, 1.0], [0.9, 6.0, 1.1, 10.0], [1.05, 0.95, 10.0, 10.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
ROLLOUT_LP = [[-1.0 - 0.1 * (i + j) for j in range(4)] for i in range(3)]
OLD_LP = [[lp + math.log(r) for lp, r in zip(lps, rs)] for lps, rs in zip(ROLLOUT_LP, RATIOS)]  # the trainer's


def _batch():
    import torch

    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return t(OLD_LP), t(ROLLOUT_LP), t(MASK)


def _verl(mode: str):
    """verl 0.9.1's IS weights and rejection mask for the keys MODE emits (what the trainer computes)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    keys = {k: v for k, v in rollout_correction.MODES[mode].items() if k != "bypass_mode"}
    old, rollout, mask = _batch()
    weights, new_mask, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **keys)
    w = None if weights is None else weights.batch["rollout_is_weights"].tolist()
    return w, new_mask.tolist(), metrics


def _formula(mode: str, fault: str | None = None):
    """(weights, mask) from the definitions (docs/launcher.md table), from the log-probs with math.exp."""
    ratios = [[math.exp(o - r) for o, r in zip(olds, rolls)] for olds, rolls in zip(OLD_LP, ROLLOUT_LP)]
    if fault == "inverted":
        ratios = [[1 / r for r in row] for row in ratios]
    weights, mask = None, [list(map(float, m)) for m in MASK]
    if mode in ("tis", "icepop"):
        lo, hi = (None, 2.0) if mode == "tis" else (0.5, 5.0)
        weights = []
        for row, m in zip(ratios, MASK):
            out = []
            for r, keep in zip(row, m):
                if not keep:
                    out.append(0.0)
                elif mode == "tis":
                    out.append(r if fault == "untruncated" else min(r, hi))
                else:
                    out.append(min(max(r, lo), hi) if fault == "clamped" else (r if lo <= r <= hi else 0.0))
            weights.append(out)
    if mode in ("seq_tis", "mis"):
        weights = []
        for row, m in zip(ratios, MASK):
            prod = math.prod(r for r, keep in zip(row, m) if keep or fault == "padding")
            w = prod if fault == "untruncated" else min(prod, 2.0)
            weights.append([w if keep else 0.0 for keep in m])
    if mode == "mis":
        for i, (row, m) in enumerate(zip(ratios, MASK)):
            if fault == "per_token":
                mask[i] = [float(keep and 0.5 <= r <= 2.0) for r, keep in zip(row, m)]
                continue
            prod = math.prod(r for r, keep in zip(row, m) if keep or fault == "padding")
            mask[i] = [float(keep) * float(0.5 <= prod <= 2.0) for keep in m]
    return weights, mask


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("mode", list(rollout_correction.MODES))
def test_verl_weights_match_the_formula(mode):
    w, mask, metrics = _verl(mode)
    ref_w, ref_mask = _formula(mode)
    assert _close(w, ref_w), (w, ref_w)
    assert _close(mask, ref_mask), (mask, ref_mask)
    assert metrics["rollout_corr/kl"] == pytest.approx(  # verl's mismatch metric, logged in every mode
        -sum(math.log(r) for row, m in zip(RATIOS, MASK) for r, k in zip(row, m) if k) / sum(map(sum, MASK)))
    if mode == "tis":  # the batch exercises the cap: one token at 3.0 and one at 6.0 are cut to 2
        assert sorted(x for row in w for x in row)[-2:] == [2.0, 2.0]
    if mode == "icepop":  # ... and the window: 6.0 and 0.4 get weight 0, the rest their full ratio
        assert w[1][1] == 0.0 and w[0][2] == 0.0 and w[0][1] == pytest.approx(3.0)
    if mode == "mis":  # sequence 1 (ratio 0.9 x 6 x 1.1 = 5.94) is rejected, the others kept
        assert mask == [[1.0] * 4, [0.0] * 4, [1.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize(("mode", "fault"), [("tis", "inverted"), ("tis", "untruncated"), ("icepop", "inverted"),
                                             ("icepop", "clamped"), ("seq_tis", "untruncated"),
                                             ("seq_tis", "padding"), ("mis", "per_token"), ("mis", "padding")])
def test_a_wrong_formula_does_not_match(mode, fault):
    w, mask, _ = _verl(mode)
    ref_w, ref_mask = _formula(mode, fault)
    assert not (_close(w, ref_w) and _close(mask, ref_mask)), f"{mode} with {fault} ratio still matches verl"
