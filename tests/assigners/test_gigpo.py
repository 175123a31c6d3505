"""GiGPO (assigners/gigpo.py): hand-computed episode + anchor-state step advantages.

Row specs: a digit d = a token the policy generated in turn d; a/b/c = environment text after
generation 0/1/2 (response_mask 0); '.' = padding.
"""
import math

import pytest
import torch

from gearlab import credit
from tests.assigners.turn_batches import make_batch
from gearlab.credit.contract import assert_contract
from gearlab.core.grpo import group_advantages
from gearlab.tasks.registry import get_task

NAN = float("nan")




def expect(specs, per_turn_values):
    return torch.tensor([[vals[int(ch)] if ch.isdigit() else 0.0 for ch in s]
                         for s, vals in zip(specs, per_turn_values)], dtype=torch.float64)


def assert_close_to(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# Group 0: three episodes of one task; group 1: another task whose observations reuse the names.
SPECS = ["00a11b22",
         "00a11...",
         "00a11...",
         "00......",
         "00......"]
TURN_R = [[0, 1, 0], [0, 0, NAN], [0, 0, NAN], [0, NAN, NAN], [0, NAN, NAN]]
OUTCOME = [1.0, 0.0, 0.0, 1.0, 1.0]
GIDS = [0, 0, 0, 1, 1]
OBS = [["s0", "s1", "s2"],
       ["s0", "s1"],
       ["s0", "s0"],      # the action of turn 0 did not change the state: s0 seen again
       ["s0"], ["s0"]]    # same name, other episode group: never grouped with group 0
SEQ_ADV = torch.zeros(5)  # not used by GiGPO (A^E is recomputed)

# Worked example (gamma = 0.5, outcome_in_returns: the outcome is added to the last turn's reward)
#   step rewards  row0 [0, 1, 0+1], row1 [0, 0+0], row2 [0, 0+0]          (group 1: [0+1] each)
#   episode return R(τ) = Σ step rewards: group 0 [2, 0, 0], group 1 [1, 1]
#   step returns (γ = 0.5): row0 R2 = 1, R1 = 1 + 0.5·1 = 1.5, R0 = 0 + 0.5·1.5 = 0.75; rows 1, 2: 0
#   step groups in group 0: s0 = {r0k0 .75, r1k0 0, r2k0 0, r2k1 0} (mean .1875),
#                           s1 = {r0k1 1.5, r1k1 0} (mean .75), s2 = {r0k2 1} (singleton -> 0)
#   group 1: s0 = {1, 1} -> 0; A^E = 0 (all-equal)
AS = {(0, 0): 0.5625, (1, 0): -0.1875, (2, 0): -0.1875, (2, 1): -0.1875, (0, 1): 0.75, (1, 1): -0.75, (0, 2): 0.0}


def test_hand_values_mean_norm_cross_steps():
    b = make_batch(SPECS, TURN_R, OUTCOME, GIDS, OBS)
    out = credit.build("gigpo", {"gamma": 0.5}).assign(b, SEQ_ADV, {})
    # cross_steps: group 0 returns counted once per turn: [2,2,2, 0,0, 0,0], mean 6/7
    #   -> A^E = [2 - 6/7, -6/7, -6/7] = [8/7, -6/7, -6/7]
    ae = [8 / 7, -6 / 7, -6 / 7]
    want = expect(SPECS, [{k: ae[i] + AS.get((i, k), 0.0) for k in range(3)} for i in range(3)] + [{0: 0.0}, {0: 0.0}])
    assert_close_to(out.token_advantages, want)
    assert (out.token_advantages[~b.response_mask] == 0).all()  # env text and padding get 0
    # step groups: s0(4), s1(2), s2(1) in group 0, s0(2) in group 1 -> mean size 9/4; 1 of 9 items singleton
    assert out.metrics["step_group_size_mean"] == pytest.approx(9 / 4)
    assert out.metrics["singleton_step_frac"] == pytest.approx(1 / 9)


def test_hand_values_per_trajectory_episode_baseline():
    b = make_batch(SPECS, TURN_R, OUTCOME, GIDS, OBS)
    out = credit.build("gigpo", {"gamma": 0.5, "cross_steps": False}).assign(b, SEQ_ADV, {})
    # each trajectory once: [2, 0, 0], mean 2/3 -> A^E = [4/3, -2/3, -2/3]; A^S unchanged
    ae = [4 / 3, -2 / 3, -2 / 3]
    want = expect(SPECS, [{k: ae[i] + AS.get((i, k), 0.0) for k in range(3)} for i in range(3)] + [{0: 0.0}, {0: 0.0}])
    assert_close_to(out.token_advantages, want)


def test_hand_values_mean_std_norm():
    b = make_batch(SPECS, TURN_R, OUTCOME, GIDS, OBS)
    out = credit.build("gigpo", {"gamma": 0.5, "mode": "mean_std_norm", "step_coef": 2.0}).assign(b, SEQ_ADV, {})
    eps = 1e-6
    # A^E: [2,2,2,0,0,0,0], mean 6/7, Bessel var = (3(8/7)^2 + 4(6/7)^2)/6 = 8/7
    sd = math.sqrt(8 / 7)
    ae = [(8 / 7) / (sd + eps), (-6 / 7) / (sd + eps), (-6 / 7) / (sd + eps)]
    # s0: [.75,0,0,0], mean .1875, Bessel var = (.5625^2 + 3·.1875^2)/3 = .140625, std .375
    # s1: [1.5, 0], mean .75, Bessel var = 2·.75^2 = 1.125
    s0, s1 = 0.375 + eps, math.sqrt(1.125) + eps
    a_s = {(0, 0): 0.5625 / s0, (1, 0): -0.1875 / s0, (2, 0): -0.1875 / s0, (2, 1): -0.1875 / s0,
           (0, 1): 0.75 / s1, (1, 1): -0.75 / s1, (0, 2): 0.0}
    want = expect(SPECS, [{k: ae[i] + 2.0 * a_s.get((i, k), 0.0) for k in range(3)} for i in range(3)]
                  + [{0: 0.0}, {0: 0.0}])
    assert_close_to(out.token_advantages, want, atol=1e-5)


def test_default_gamma_and_outcome_in_returns():
    # two 2-turn episodes, same states, outcome 1 vs 0, no intermediate reward; defaults (γ = 0.95, mean_norm)
    specs = ["0a1", "0a1"]
    b = make_batch(specs, [[0, 0], [0, 0]], [1.0, 0.0], obs=[["x", "y"], ["x", "y"]])
    out = credit.build("gigpo").assign(b, torch.zeros(2), {})
    # returns: row0 [0.95, 1], row1 [0, 0] -> A^S turn 0 ±0.475, turn 1 ±0.5
    # A^E: [1,1,0,0] mean 0.5 -> ±0.5
    assert_close_to(out.token_advantages, expect(specs, [{0: 0.975, 1: 1.0}, {0: -0.975, 1: -1.0}]))
    # outcome_in_returns=False: the step returns hold turn rewards only (all 0) -> A^S = 0,
    # and A^E uses the outcome alone: [1, 0] -> ±0.5
    out = credit.build("gigpo", {"outcome_in_returns": False}).assign(b, torch.zeros(2), {})
    assert_close_to(out.token_advantages, expect(specs, [{0: 0.5, 1: 0.5}, {0: -0.5, 1: -0.5}]))


def test_no_repeated_state_reduces_to_episode_advantage():
    specs = ["0a1b2", "0a1..", "0....", "0a1.."]
    turn_r = [[0.5, 0, 1], [0, 1, NAN], [2, NAN, NAN], [0, 0, NAN]]
    obs = [["p", "q", "r"], ["u", "v"], ["w"], ["a", "b"]]  # all distinct within each group
    b = make_batch(specs, turn_r, [1.0, 0.0, 1.0, 0.0], group_ids=[0, 0, 0, 1], obs=obs)
    out = credit.build("gigpo", {"mode": "mean_std_norm", "cross_steps": False,
                                 "outcome_in_returns": False}).assign(b, torch.zeros(4), {})
    assert out.metrics["singleton_step_frac"] == 1.0
    # every step group is a singleton -> A^S = 0 -> plain GRPO on the outcome (group 1 is a singleton
    # episode group: verl's raw-score rule, A^E = R = 0 here)
    grpo = credit.build("grpo").assign(b, group_advantages(b.rewards, b.group_ids), {})
    assert_close_to(out.token_advantages, grpo.token_advantages)


def test_zero_std_episode_group_with_equal_returns_is_zero():
    specs = ["0a1", "0a1", "0a1"]
    b = make_batch(specs, [[1, 0], [1, 0], [1, 0]], [1.0, 1.0, 1.0], obs=[["s", "t"]] * 3)
    for mode in ("mean_norm", "mean_std_norm"):
        out = credit.build("gigpo", {"mode": mode}).assign(b, torch.zeros(3), {})
        assert (out.token_advantages == 0).all()


def test_similarity_grouping_optional():
    specs = ["0", "0"]
    obs = [["the red door is open"], ["the red door is opened"]]  # difflib ratio = 2·20/42 ≈ 0.952
    b = make_batch(specs, [[0], [0]], [1.0, 0.0], obs=obs)
    exact = credit.build("gigpo").assign(b, torch.zeros(2), {})
    assert_close_to(exact.token_advantages, [[0.5], [-0.5]])  # distinct states: A^S = 0, A^E = ±0.5
    sim = credit.build("gigpo", {"similarity_thresh": 0.95}).assign(b, torch.zeros(2), {})
    assert_close_to(sim.token_advantages, [[1.0], [-1.0]])  # one step group: returns [1, 0] -> A^S = ±0.5
    with pytest.raises(ValueError, match="text observations"):
        credit.build("gigpo", {"similarity_thresh": 0.9}).assign(b.with_(meta={"anchor_obs": [[1], [2]]}),
                                                                torch.zeros(2), {})
    with pytest.raises(ValueError, match="similarity_thresh"):
        credit.build("gigpo", {"similarity_thresh": 1.0})


# ------------------------------------------------------------------------ errors and wiring
def test_single_turn_task_is_a_startup_error():
    with pytest.raises(ValueError, match="gigpo needs a multi-turn task with per-turn rewards; task 'arith' "
                                         "is single-turn — use assigner=grpo, or a multi-turn task"):
        credit.build("gigpo").setup(seed=0, total_steps=1, task=get_task("arith"))


def test_missing_turn_data_or_anchor_obs_is_an_error():
    b = make_batch(SPECS, TURN_R, OUTCOME, GIDS, OBS)
    a = credit.build("gigpo")
    with pytest.raises(ValueError, match="anchor_obs"):
        a.assign(b.with_(meta={}), SEQ_ADV, {})
    with pytest.raises(ValueError, match="turn_ids"):
        a.assign(b.with_(turn_ids=None), SEQ_ADV, {})
    with pytest.raises(ValueError, match="turn_rewards"):
        a.assign(b.with_(turn_rewards=None), SEQ_ADV, {})
    bad = [list(o) for o in OBS]
    bad[1] = ["s0"]  # row 1 has two turns
    with pytest.raises(ValueError, match=r"anchor_obs\[1\] has 1 observations"):
        a.assign(b.with_(meta={"anchor_obs": bad}), SEQ_ADV, {})


def test_config_file_and_contract():
    import yaml
    from pathlib import Path

    conf = yaml.safe_load((Path(__file__).parents[2] / "conf/assigner/gigpo.yaml").read_text())
    a = credit.build(conf["name"], conf["options"])
    assert (a.mode, a.gamma, a.step_coef, a.cross_steps, a.similarity_thresh) == ("mean_norm", 0.95, 1.0, True, None)
    cls = credit.get("gigpo")
    assert cls.requires_turns and not cls.preserves_sign and not cls.preserves_mass
    for opts in ({"mode": "mean_std_norm"}, {"cross_steps": False}, {"similarity_thresh": 0.9}):
        assert_contract("gigpo", opts)
