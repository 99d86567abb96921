"""Dagster wiring only: build, drain, monitoring and resources. Everything they do is in the core.

No ``from __future__ import annotations`` in this package: Dagster reads the annotations of
``context`` and resource parameters when the decorators run, and cannot resolve them as strings.
"""
