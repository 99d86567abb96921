"""How every sensor of the project is declared: running from the moment the code location loads.

A sensor that had to be switched on in the UI would leave a fresh deployment without its
dispatcher, its on-time check or its catch-up builds until someone noticed.
"""

from __future__ import annotations

from typing import Any

import dagster as dg


def running_sensor(name: str, job: Any, every_seconds: int, description: str) -> Any:
    """``dg.sensor`` for ``job``, evaluated every ``every_seconds``, on by default."""
    return dg.sensor(
        name=name,
        job=job,
        minimum_interval_seconds=every_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=description,
    )
