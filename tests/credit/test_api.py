"""Registry behaviour and adding an assigner from outside the repository (file path and entry point)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from gearlab import credit
from gearlab.core.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, register

PLUGIN_SRC = textwrap.dedent('''
    """A credit method written outside gearlab: GRPO advantage, doubled on the last generated token."""
    import torch
    from gearlab.credit import CreditAssigner, CreditOutput, register

    @register("{name}")
    class LastTokenBoost(CreditAssigner):
        def __init__(self, boost: float = 2.0):
            self.boost = boost

        def assign(self, batch, seq_advantages, signals):
            m = batch.response_mask.float()
            adv = seq_advantages[:, None] * m
            last = m.cumsum(-1) == m.sum(-1, keepdim=True)
            adv = torch.where(last & batch.response_mask, adv * self.boost, adv)
            return CreditOutput(adv, metrics={{"boost": self.boost}})
''')


def _batch():
    return RolloutBatch(prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3, dtype=torch.long),
                        response_ids=torch.ones(2, 4, dtype=torch.long),
                        response_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool),
                        group_ids=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]))


def test_grpo_assigner_broadcasts_sequence_advantage():
    out = credit.build("grpo").assign(_batch(), torch.tensor([0.5, -0.5]), {})
    assert out.token_advantages.tolist() == [[0.5, 0.5, 0.5, 0.0], [-0.5, -0.5, 0.0, 0.0]]


def test_duplicate_name_is_an_error():
    credit.get("grpo")  # the plug-ins load on the first lookup; alone, this test would otherwise be the first
    with pytest.raises(ValueError, match="already registered"):
        @register("grpo")
        class Other(CreditAssigner):
            def assign(self, batch, seq_advantages, signals):
                return CreditOutput(seq_advantages)


def test_unknown_name_lists_known():
    with pytest.raises(KeyError, match="known: .*grpo"):
        credit.get("no-such-method")


def test_bad_options_name_the_assigner():
    with pytest.raises(ValueError, match="assigner 'grpo'"):
        credit.build("grpo", {"nonsense": 1})


def test_plugin_from_a_file_outside_the_repo(tmp_path):
    f = tmp_path / "my_credit.py"
    f.write_text(PLUGIN_SRC.format(name="last_boost_file"))
    credit.load_module(str(f))
    a = credit.build("last_boost_file", {"boost": 3.0})
    out = a.assign(_batch(), torch.tensor([1.0, -1.0]), {})
    assert out.token_advantages.tolist() == [[1.0, 1.0, 3.0, 0.0], [-1.0, -3.0, 0.0, 0.0]]


def test_plugin_from_an_entry_point(tmp_path):
    """A separately installed package declaring `gearlab.assigners` is found without touching gearlab/.
    Run in a fresh interpreter so plug-in discovery starts from scratch."""
    from tests.plugin_site import entry_point_site

    pkg = entry_point_site(tmp_path, "acme_credit", "gearlab.assigners", PLUGIN_SRC.format(name="acme_last_boost"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from gearlab import credit; "
            "print(credit.available()); print(type(credit.build('acme_last_boost')).__module__)")
    out = subprocess.run([sys.executable, "-c", code, str(pkg)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "acme_last_boost" in out.stdout and "acme_credit" in out.stdout
