"""Where ddtree finds its configs and shipped files, in a checkout and when installed from a wheel.

A checkout has conf/, assets/toy and docs/ at the repository's top (the design card keeps them there);
a wheel carries copies of them under ddtree/_data/ (setup.py's build step). Runs go under the checkout's
runs/ in a checkout, and under the current directory when installed: never into site-packages.
"""

from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
PACKAGED = Path(__file__).resolve().parent / "_data"
SHIPPED = ("conf", "assets/toy", "docs/paper_reference.yaml")  # what a wheel carries under ddtree/_data/

IS_CHECKOUT = (CHECKOUT / "conf" / "config.yaml").is_file()
DATA_ROOT = CHECKOUT if IS_CHECKOUT else PACKAGED  # the folder holding conf/, assets/ and docs/
CONF_DIR = DATA_ROOT / "conf"


def runs_root() -> Path:
    """The folder runs/ goes in by default: the checkout, or the current directory for an installed package."""
    return CHECKOUT if IS_CHECKOUT else Path.cwd()
