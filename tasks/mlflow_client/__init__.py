"""Moved to the top-level package `tracking` (tasks/ holds only Prefect tasks); the names documented here
(docs/api.md: `from tasks.mlflow_client import load_logged_policy`) stay importable."""

from tracking import *  # noqa: F403
from tracking import __all__  # noqa: F401
