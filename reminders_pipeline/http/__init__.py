"""The HTTP shell: the internal build/drain routes, the device API, the widget feed, health and metrics.

A thin FastAPI app over the same core functions the CLI and Dagster call; it holds no SQL and no
ledger logic, only request parsing, authentication and the mapping of core answers to responses.
"""

from reminders_pipeline.http.app import create_app

__all__ = ["create_app"]
