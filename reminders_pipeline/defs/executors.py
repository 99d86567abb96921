"""Which executor runs the steps of a job: in-process on one machine, or spread by an existing engine.

In-process is the default (docs/dagster.md: a process per step costs ~2.6 CPU-seconds on a 2-core
machine). ``REMINDERS_DAGSTER_EXECUTOR=celery`` or ``k8s_job`` runs each step (a drain's send
batches, say) on Celery workers or in its own Kubernetes pod; deploy/ has the instance and run
config for both. The engines' packages are imported only when chosen.
"""

from typing import Any

import dagster as dg


def job_executor(name: str) -> Any:
    if name == "in_process":
        return dg.in_process_executor
    if name == "multiprocess":
        return dg.multiprocess_executor
    if name == "celery":
        from dagster_celery import celery_executor

        return celery_executor
    if name == "k8s_job":
        from dagster_k8s import k8s_job_executor

        return k8s_job_executor
    raise ValueError(f"unknown executor {name!r}")
