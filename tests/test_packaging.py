"""gearlab installed as a wheel (not editable, not from the checkout) finds its configs and assigners from
any directory, and installs no bare top-level ``assigners`` module."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # built from a copy of the tracked files: setuptools leaves a build/ folder in the source tree, and a stale
    # one would put modules that no longer exist into later wheels
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("gearlab-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if "/" in n and ".dist-info" not in n}
    assert tops == {"gearlab"}, f"top-level entries besides gearlab: {tops}"
    assert "gearlab/assigners/gear.py" in names and "gearlab/conf/experiment/embedded.yaml" in names
    # every YAML of the checkout's conf/ ships
    for p in (ROOT / "conf").rglob("*.yaml"):
        assert f"gearlab/conf/{p.relative_to(ROOT / 'conf').as_posix()}" in names, p
    # every subpackage of the source tree ships (pyproject lists them explicitly)
    for init in (ROOT / "gearlab").rglob("__init__.py"):
        assert f"{init.relative_to(ROOT).as_posix()}" in names, f"{init.parent} missing from [tool.setuptools] packages"
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "gearlab.assigners" in listed


@pytest.mark.slow
def test_installed_wheel_works_from_any_directory(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True)
    # dependencies (torch, omegaconf, ...) come from the test environment; a path added by a .pth file is not
    # itself scanned for .pth files, so the checkout's editable-install hook there stays inactive
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import gearlab, json, importlib.util\n"
        "from gearlab.config import load_config, conf_dir\n"
        "from gearlab import credit\n"
        "cfg = load_config(['experiment=embedded', 'assigner=gear', 'task=arith_hard'])\n"
        "print(json.dumps({'file': gearlab.__file__, 'conf': str(conf_dir()), 'assigners': credit.available(),\n"
        "  'gear_opts': dict(cfg.assigner.options), 'seeds': list(cfg.compare.seeds), 'q_on': "
        "credit.build('gear').q_on,\n"
        "  'bare_assigners': importlib.util.find_spec('assigners') is not None}))\n"
    )
    out = subprocess.run([str(py), "-c", code], cwd=elsewhere, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["file"].startswith(str(site)), res["file"]
    assert res["conf"].startswith(str(site)), res["conf"]
    assert {"grpo", "gear", "rlsd", "oar_g", "mt_grpo"} <= set(res["assigners"])
    assert res["gear_opts"] == {} and res["seeds"] == [0, 1, 2, 3, 4]  # the YAML sets no defaults: the class holds them
    assert res["bare_assigners"] is False and res["q_on"] == 0.9
