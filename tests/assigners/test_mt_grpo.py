"""MT-GRPO (assigners/mt_grpo.py): hand-computed advantages on 2- and 3-turn batches.

Row specs: a digit d = a token the policy generated in turn d; a/b/c = environment text after
generation 0/1/2 (turn id 0/1/2, response_mask 0); '.' = padding (turn id -1, never read).
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




def expect(specs, per_turn_values, default=0.0):
    """Token table from a per-row {turn: value} dict: generated tokens get the value of their turn;
    env and padding tokens get 0."""
    rows = []
    for s, vals in zip(specs, per_turn_values):
        rows.append([vals[int(ch)] if ch.isdigit() else default for ch in s])
    return torch.tensor(rows, dtype=torch.float64)


def assert_close_to(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# ------------------------------------------------------------------------ 2-turn source rule
K2_SPECS = ["00a11",   # tool call, tool result, answer
            "00a1.",   # tool call, tool result, answer
            "000..",   # no tool result: answered at once
            "00a.."]   # tool result came, but the episode ended (turn budget) before generation 1
K2_TURN_R = [[1, 0], [1, 0], [0, NAN], [0, NAN]]   # R^T = [1, 1, 0, 0]
K2_OUTCOME = [1.0, 0.0, 0.0, 1.0]                     # R^O


def test_two_turn_source_rule_exactly():
    eps = 1e-4  # the source's epsilon
    b = make_batch(K2_SPECS, K2_TURN_R, K2_OUTCOME)
    # A^O: R^O = [1,0,0,1], mean 0.5, Bessel var = 4*0.25/3, std = sqrt(1/3) -> ±0.5/(sqrt(1/3)+eps)
    a = 0.5 / (math.sqrt(1 / 3) + eps)
    a_o = torch.tensor([a, -a, -a, a])
    assert_close_to(a_o, group_advantages(b.rewards, b.group_ids, eps=eps))
    # A^T: R^T = [1,1,0,0] has the same mean/std -> A^T = [a, a, -a, -a]
    # A^comb: R^T + R^O = [2,1,0,1], mean 1, Bessel var = (1+0+1+0)/3 = 2/3 -> row 2: -1/(sqrt(2/3)+eps)
    comb2 = -1.0 / (math.sqrt(2 / 3) + eps)
    lam = 2.0
    out = credit.build("mt_grpo", {"k2_compat": True, "turn_coef": lam, "eps": eps}).assign(b, a_o, {})
    want = expect(K2_SPECS, [
        {0: a + lam * a, 1: a},      # generation 0: A^O + λA^T = 3a; generation 1: A^O only
        {0: -a + lam * a, 1: -a},    # generation 0: -a + 2a = +a (turn credit flips the sign), then -a
        {0: comb2},                  # no tool result: GRPO-MR fallback A^comb on every token
        {0: a - lam * a},            # tool result present: A^O + λA^T = a - 2a = -a
    ])
    assert_close_to(out.token_advantages, want)
    assert out.metrics["no_tool_result_frac"] == 0.25
    assert out.metrics["sign_flip_frac"] > 0  # rows 1 and 3, generation 0


def test_two_turn_later_turn_rewards_ignored_by_source_rule_and_generalisation_matches_it():
    # Only turn 0 carries a turn reward (turn 1 has 0): every K-turn mode gives generation-0 tokens
    # A^O + λA^T and later tokens A^O, i.e. the source rule for every row that has a tool result.
    specs = ["00a11", "00a1.", "00a11", "00a.."]
    turn_r = [[1, 0], [1, 0], [0, 0], [0, NAN]]
    b = make_batch(specs, turn_r, K2_OUTCOME)
    a_o = group_advantages(b.rewards, b.group_ids)
    src = credit.build("mt_grpo", {"k2_compat": True}).assign(b, a_o, {}).token_advantages
    for norm in ("per_turn", "zero_fill", "reward_to_go"):
        gen_ = credit.build("mt_grpo", {"norm": norm}).assign(b, a_o, {}).token_advantages
        assert_close_to(gen_, src)
    # and the source ignores rewards of later turns entirely
    b2 = make_batch(specs, [[1, 5], [1, -3], [0, 7], [0, NAN]], K2_OUTCOME)
    assert_close_to(credit.build("mt_grpo", {"k2_compat": True}).assign(b2, a_o, {}).token_advantages, src)


# ------------------------------------------------------------------------ K-turn generalisation
K3_SPECS = ["00a11b22",   # 3 turns
            "00a11...",   # 2 turns
            "00......"]   # stopped after 1 turn
K3_TURN_R = [[1, 1, 0], [1, 0, NAN], [0, NAN, NAN]]
K3_AO = torch.tensor([0.3, -0.1, -0.2])  # any outcome advantage: it is added unchanged


@pytest.mark.parametrize("norm, values", [
    # per_turn: per-turn-index norm over the members that had the turn (no std: R - mean):
    #   turn 0: [1,1,0] mean 2/3 -> [1/3, 1/3, -2/3]; turn 1: [1,0] (rows 0,1) mean 1/2 -> [1/2, -1/2, 0]
    #   turn 2: only row 0 -> singleton -> 0.   V_k = Σ_{k'≥k}: V0 = [5/6, -1/6, -2/3], V1 = [1/2, -1/2, 0]
    ("per_turn", [{0: 0.3 + 5 / 6, 1: 0.3 + 0.5, 2: 0.3}, {0: -0.1 - 1 / 6, 1: -0.1 - 0.5}, {0: -0.2 - 2 / 3}]),
    # zero_fill: missing turns = 0, every member counted: turn 0 [1,1,0] -> [1/3,1/3,-2/3];
    #   turn 1 [1,0,0] mean 1/3 -> [2/3,-1/3,-1/3]; turn 2 [0,0,0] -> 0.  V0 = [1, 0, -1], V1 = [2/3, -1/3, -1/3]
    ("zero_fill", [{0: 0.3 + 1.0, 1: 0.3 + 2 / 3, 2: 0.3}, {0: -0.1 + 0.0, 1: -0.1 - 1 / 3}, {0: -0.2 - 1.0}]),
    # reward_to_go: G = future turn reward: row0 [2,1,0], row1 [1,0,-], row2 [0,-,-]
    #   turn 0 (all reached): [2,1,0] mean 1 -> [1,0,-1]; turn 1 (rows 0,1): [1,0] mean 1/2 -> [1/2,-1/2];
    #   turn 2 (row 0 only): singleton -> 0
    ("reward_to_go", [{0: 0.3 + 1.0, 1: 0.3 + 0.5, 2: 0.3}, {0: -0.1 + 0.0, 1: -0.1 - 0.5}, {0: -0.2 - 1.0}]),
])
def test_three_turn_hand_values(norm, values):
    b = make_batch(K3_SPECS, K3_TURN_R, [1.0, 0.0, 0.0])
    out = credit.build("mt_grpo", {"norm": norm, "scale_by_std": False}).assign(b, K3_AO, {})
    assert_close_to(out.token_advantages, expect(K3_SPECS, values))
    assert (out.token_advantages[~b.response_mask] == 0).all()  # env text and padding get nothing


def test_three_turn_std_scaled_reward_to_go_and_turn_coef():
    b = make_batch(K3_SPECS, K3_TURN_R, [1.0, 0.0, 0.0])
    out = credit.build("mt_grpo", {"turn_coef": 0.5}).assign(b, K3_AO, {})
    # turn 0: G = [2,1,0], mean 1, Bessel std 1 -> [1, 0, -1]/(1+1e-6)
    # turn 1: G = [1,0], mean 1/2, Bessel std sqrt(0.5) -> ±0.5/(sqrt(0.5)+1e-6) = ±0.7071063
    s1 = 0.5 / (math.sqrt(0.5) + 1e-6)
    d0 = 1 / (1 + 1e-6)
    assert_close_to(out.token_advantages, expect(K3_SPECS, [
        {0: 0.3 + 0.5 * d0, 1: 0.3 + 0.5 * s1, 2: 0.3}, {0: -0.1, 1: -0.1 - 0.5 * s1}, {0: -0.2 - 0.5 * d0}]))


def test_termination_bias_of_per_turn_normalisation():
    # Every turn earns intermediate reward 1; row 0 takes 3 turns, row 1 stops after one.
    # per_turn: each turn index has all-equal rewards among the rows that had it -> every term 0, so
    # the 2 extra units of intermediate reward earned by continuing never reach the gradient (the
    # baseline subtracted grows with the trajectory's own length: verl#7244).
    specs = ["0a1b2", "0...."]
    b = make_batch(specs, [[1, 1, 1], [1, NAN, NAN]], [0.0, 0.0])
    a_o = torch.zeros(2)
    biased = credit.build("mt_grpo", {"norm": "per_turn", "scale_by_std": False}).assign(b, a_o, {})
    assert (biased.token_advantages == 0).all()
    # reward_to_go: turn 0 G = [3, 1], mean 2 -> [+1, -1]; turns 1-2 reached by row 0 only -> 0
    rtg = credit.build("mt_grpo", {"norm": "reward_to_go", "scale_by_std": False}).assign(b, a_o, {})
    assert_close_to(rtg.token_advantages, expect(specs, [{0: 1.0, 1: 0.0, 2: 0.0}, {0: -1.0}]))
    # zero_fill: turn 0 [1,1] -> 0; turn 1 [1,0] -> ±1/2; turn 2 [1,0] -> ±1/2; V0 = [1, -1], V1 = [1, ·], V2 = [1/2, ·]
    zf = credit.build("mt_grpo", {"norm": "zero_fill", "scale_by_std": False}).assign(b, a_o, {})
    assert_close_to(zf.token_advantages, expect(specs, [{0: 1.0, 1: 1.0, 2: 0.5}, {0: -1.0}]))


def test_zero_std_groups_and_ragged_groups():
    # group 5: identical turn rewards and outcomes -> A^O = 0 and every turn term 0 -> all zeros.
    # group 9: a real group next to it is unaffected by it.
    specs = ["0a1", "0a1", "0a1", "0.."]
    b = make_batch(specs, [[1, 0], [1, 0], [1, 1], [0, NAN]], [1.0, 1.0, 0.0, 1.0], group_ids=[5, 5, 9, 9])
    a_o = group_advantages(b.rewards, b.group_ids, scale_by_std=False)  # [0, 0, -1/2, 1/2]
    for norm in ("per_turn", "zero_fill", "reward_to_go"):
        out = credit.build("mt_grpo", {"norm": norm, "scale_by_std": False}).assign(b, a_o, {})
        assert (out.token_advantages[:2] == 0).all(), norm
        assert torch.isfinite(out.token_advantages).all()
    # reward_to_go, group 9: turn 0 G = [2, 0] -> ±1; turn 1 only row 2 -> 0
    out = credit.build("mt_grpo", {"scale_by_std": False}).assign(b, a_o, {})
    assert_close_to(out.token_advantages[2:], expect(specs[2:], [{0: -0.5 + 1, 1: -0.5}, {0: 0.5 - 1}]))


# ------------------------------------------------------------------------ errors and wiring
def test_single_turn_task_is_a_startup_error():
    a = credit.build("mt_grpo")
    with pytest.raises(ValueError, match="mt_grpo needs a multi-turn task with per-turn rewards; task 'arith' "
                                         "is single-turn — use assigner=grpo, or a multi-turn task"):
        a.setup(seed=0, total_steps=1, task=get_task("arith"))

    class MultiTurn:
        name, multi_turn = "tool_task", True

    a.setup(seed=0, total_steps=1, task=MultiTurn())


def test_missing_or_malformed_turn_data_is_an_error():
    b = make_batch(K3_SPECS, K3_TURN_R, [1.0, 0.0, 0.0])
    a = credit.build("mt_grpo")
    with pytest.raises(ValueError, match="turn_rewards"):
        a.assign(b.with_(turn_rewards=None), K3_AO, {})
    with pytest.raises(ValueError, match="turn_ids"):
        a.assign(b.with_(turn_ids=None), K3_AO, {})
    with pytest.raises(ValueError, match="NaN before a finite entry"):
        a.assign(b.with_(turn_rewards=torch.tensor([[1, NAN, 0], [1, 0, NAN], [0, NAN, NAN]])), K3_AO, {})
    with pytest.raises(ValueError, match="turn id 1"):  # row 1 generated turn 1 but has one reward
        a.assign(b.with_(turn_rewards=torch.tensor([[1, 1, 0], [1, NAN, NAN], [0, NAN, NAN]])), K3_AO, {})
    with pytest.raises(ValueError, match="assigner.options.norm: 'bogus' is not one of"):
        credit.build("mt_grpo", {"norm": "bogus"})


def test_config_file_and_contract():
    import yaml
    from pathlib import Path

    conf = yaml.safe_load((Path(__file__).parents[2] / "conf/assigner/mt_grpo.yaml").read_text())
    a = credit.build(conf["name"], conf["options"])
    assert (a.norm, a.turn_coef, a.k2_compat) == ("reward_to_go", 1.0, False)
    cls = credit.get("mt_grpo")
    assert cls.requires_turns and not cls.preserves_sign and not cls.preserves_mass
    for opts in ({"norm": "per_turn"}, {"norm": "zero_fill"}, {"k2_compat": True}):
        assert_contract("mt_grpo", opts)
