"""The files Serval ships beside its code, for an installed Serval as for a checkout: ``configs/`` (the Serve
configs), ``assets/`` (the trained demo pair) and ``helm/serval`` (the Helm chart).

They live under ``serval/_data``: in the checkout its entries are symlinks to the top-level directories
(which stay where users and tests know them), in a wheel they are copies (pyproject's package data), so
one path serves both.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "_data"
CHART_DIR = DATA_DIR / "helm" / "serval"
DEFAULT_SERVE_CONFIG = DATA_DIR / "configs" / "serve" / "default.yaml"
