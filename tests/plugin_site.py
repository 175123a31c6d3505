"""A separately "installed" package for plug-in tests: a folder with the package and its dist-info, whose entry
points announce it in a gearlab group. Put the folder first on ``sys.path`` of a fresh interpreter."""
from __future__ import annotations

from pathlib import Path


def entry_point_site(root: Path, package: str, group: str, source: str) -> Path:
    """Write ``root/site/<package>/__init__.py`` (``source``) and a dist-info declaring it in ``group``; returns
    the site folder."""
    site = root / "site"
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(source)
    dist = site / f"{package}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\nplugin = {package}\n")
    return site
