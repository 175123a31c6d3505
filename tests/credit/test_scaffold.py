"""`gearlab new-assigner` writes a working plug-in whose contract test passes, and `check-assigner` runs the kit."""
import subprocess
import sys


def _gearlab(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "gearlab.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_new_assigner_outside_the_repo_passes_its_own_test_and_the_kit(tmp_path):
    out = _gearlab("new-assigner", "my_credit", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "my_credit.py").is_file() and (tmp_path / "conf/assigner/my_credit.yaml").is_file()
    test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_my_credit.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert test.returncode == 0, test.stdout[-2000:]
    chk = _gearlab("check-assigner", "my_credit", "assigner.plugins=[my_credit.py]", cwd=tmp_path)
    assert chk.returncode == 0 and "8/8 checks passed" in chk.stdout, chk.stdout + chk.stderr
    again = _gearlab("new-assigner", "my_credit", cwd=tmp_path)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr


def test_check_assigner_fails_a_broken_method(tmp_path):
    (tmp_path / "bad.py").write_text(
        "from gearlab.credit import CreditAssigner, CreditOutput, register\n"
        "@register('bad_credit')\n"
        "class Bad(CreditAssigner):\n"
        "    preserves_mass = True\n"
        "    def assign(self, batch, seq_advantages, signals):\n"
        "        return CreditOutput(seq_advantages[:, None].expand(batch.response_ids.shape) * 2.0)\n")
    chk = _gearlab("check-assigner", "bad_credit", "assigner.plugins=[bad.py]", cwd=tmp_path)
    assert chk.returncode == 1
    assert "FAIL  no credit on masked tokens" in chk.stdout and "FAIL  mass preserved" in chk.stdout
