"""``gearlab new-assigner NAME``: the three files of a new credit method (module, YAML, contract test)."""
from __future__ import annotations

import keyword
import re
from pathlib import Path

MODULE = '''"""{title}: <one line on what this credit method does>.

Formula: A_{{i,t}} = <...>  (source: <paper / code>, tags as in docs/credit/README.md#provenance-tags: [SRC] / \
[PROPOSED]).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gearlab.batch import RolloutBatch
from gearlab.credit import CreditAssigner, CreditOutput, Signal, register
from gearlab.credit.options import option


@dataclass
class {cls}Options:
    # each option: default, one-line doc (`gearlab assigners {name}` prints it), checks run before any work
    alpha: float = option(0.1, "entropy weight", lo=0.0)


@register("{name}")
class {cls}(CreditAssigner):
    Options = {cls}Options  # the options become attributes: self.alpha
    needs = frozenset({{Signal.ENTROPY}})  # the signals you read; the core computes only these
    preserves_sign = True  # promises the contract kit will hold you to
    preserves_mass = False

    def assign(self, batch: RolloutBatch, seq_advantages: Tensor, signals: dict[Signal, Tensor]) -> CreditOutput:
        m = batch.response_mask.float()  # [B, T]
        weight = 1.0 + self.alpha * signals[Signal.ENTROPY].detach()  # [B, T], > 0 keeps the sign
        adv = seq_advantages[:, None] * weight * m
        return CreditOutput(token_advantages=adv, metrics={{"mean_weight": float((weight * m).sum() / \
m.sum().clamp_min(1))}})
'''

YAML = '''# {title}: <one line>, <source>
# Options and their defaults: the Options dataclass in the module (`gearlab assigners {name}`).
name: {name}
options: {{}}
'''

TEST = '''"""Contract kit + one hand-computed value for the {name} credit method."""
import torch

{import_line}
from gearlab.batch import RolloutBatch
from gearlab.credit.contract import assert_contract
from gearlab.credit import Signal, build


def test_contract():
    assert_contract("{name}")


def test_hand_computed_value():
    b = RolloutBatch(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                     response_ids=torch.ones(1, 3, dtype=torch.long), response_mask=torch.tensor([[True, True, False]]),
                     group_ids=torch.tensor([0]), rewards=torch.tensor([1.0]))
    out = build("{name}", {{"alpha": 0.5}}).assign(b, torch.tensor([2.0]), {{Signal.ENTROPY: torch.tensor([[1.0, 0.0, \
0.0]])}})
    # token 0: 2 * (1 + 0.5 * 1) = 3; token 1: 2 * 1 = 2; token 2 is padding
    assert out.token_advantages.tolist() == [[3.0, 2.0, 0.0]]
'''


def new_assigner(name: str, root: Path) -> list[Path]:
    """Write the module, its YAML and a contract test under ``root``.

    Inside the gearlab repository: assigners/<name>.py, conf/assigner/<name>.yaml, tests/assigners/test_<name>.py.
    Elsewhere (a plug-in of your own): <name>.py, conf/assigner/<name>.yaml, tests/test_<name>.py, with the
    test loading the module by path (use it with ``assigner.name=<name> assigner.plugins=[<name>.py]``).
    """
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ValueError(f"assigner name {name!r} must be a lower-case Python identifier (letters, digits, _)")
    cls = "".join(p.capitalize() for p in name.split("_")) + "Assigner"
    title = name.replace("_", " ").title()
    in_repo = (root / "gearlab" / "credit" / "api.py").is_file() and (root / "assigners" / "__init__.py").is_file()
    if in_repo:
        module, test = root / "assigners" / f"{name}.py", root / "tests" / "assigners" / f"test_{name}.py"
        import_line = f"import assigners.{name}  # noqa: F401  (registers the assigner)"
    else:
        module, test = root / f"{name}.py", root / "tests" / f"test_{name}.py"
        import_line = ("from pathlib import Path\n\nfrom gearlab.credit import load_module\n\n"
                       f"load_module(str(Path(__file__).resolve().parents[1] / \"{name}.py\"))  # registers the "
                       "assigner")
    files = {
        module: MODULE.format(name=name, cls=cls, title=title),
        root / "conf" / "assigner" / f"{name}.yaml": YAML.format(name=name, title=title),
        test: TEST.format(name=name, import_line=import_line),
    }
    existing = [str(p) for p in files if p.exists()]
    if existing:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)}")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)
