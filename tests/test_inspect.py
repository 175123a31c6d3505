"""`gearlab inspect` runs every applicable assigner on one batch and writes JSON / HTML / PNG."""
import json

from gearlab import credit
from gearlab.config import load_config
from gearlab.inspect import inspect


def test_inspect_writes_the_three_files(tmp_path, tiny_model_dir):
    cfg = load_config([f"model.name_or_path={tiny_model_dir}", f"trainer.output_dir={tmp_path}",
                       f"inspect.out_dir={tmp_path / 'insp'}", "inspect.prompts=2", "rollout.group_size=2",
                       "rollout.max_new_tokens=10"])
    out = inspect(cfg)
    rec = json.loads((tmp_path / "insp" / "credit.json").read_text())
    single_turn = [n for n in credit.available() if not credit.get(n).requires_turns]
    assert rec["assigners"] == single_turn and len(rec["samples"]) == 4
    s = rec["samples"][0]
    assert {"tokens", "response_mask", "turn_ids", "reward", "seq_advantage", "credit", "signals", "segments"} <= set(s)
    assert set(s["credit"]) == set(single_turn)
    assert all(len(v) == len(s["tokens"]) for v in s["credit"].values())
    if "gear" in single_turn:
        assert "kl" in s["signals"] and "gear" in s["segments"]
    html = (tmp_path / "insp" / "credit.html").read_text()
    assert html.startswith("<html>") and "grpo" in html
    assert (tmp_path / "insp" / "credit.png").read_bytes()[:4] == b"\x89PNG"
    assert out["png"].endswith("credit.png")
