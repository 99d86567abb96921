"""Launch the code location's own jobs on the Celery executor from a plain process, as a run worker would.

``python -m reminders_pipeline_testing.celery_runs CONFIG.yaml build 0 1 2 ... [--parallel N]`` starts
one per-chunk ``build_notification_queue`` run per chunk (N processes, each taking every Nth chunk
in turn: runs in threads of one process deadlock on Dagster's imports), ``... drain`` one
``drain_job`` run; each prints one JSON line per run: ``{"run_id", "status", "chunk"}``.

The job is loaded from ``reminders_pipeline.definitions`` (the module ``workspace.yaml`` names), so
the pointer a Celery worker receives is the deployment's, and ``REMINDERS_DAGSTER_EXECUTOR=celery``
must be set here and on the workers. The instance is ``DAGSTER_HOME``'s. Used by the Celery test and
by ``bench/bench_celery_scale.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import yaml
from dagster._core.definitions.reconstruct import ReconstructableRepository

ROOT = Path(__file__).resolve().parent.parent


def recon_job(name: str) -> Any:
    repo = ReconstructableRepository.for_module("reminders_pipeline.definitions", "defs", working_directory=str(ROOT))
    return repo.get_reconstructable_job(name)


def run_config(config_yaml: str) -> dict[str, Any]:
    return {"execution": yaml.safe_load(Path(config_yaml).read_text())["execution"]}


def execute(job: str, config: dict[str, Any], tags: dict[str, str], extra: dict[str, Any]) -> dict[str, Any]:
    with dg.DagsterInstance.get() as instance:
        result = dg.execute_job(recon_job(job), instance=instance, run_config=config, tags=tags, raise_on_error=False)
        return {"run_id": result.run_id, "status": result.dagster_run.status.value, **extra}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="celery_runs")
    parser.add_argument("config_yaml")
    parser.add_argument("what", choices=("build", "drain"))
    parser.add_argument("chunks", nargs="*", type=int)
    parser.add_argument("--parallel", type=int, default=1)
    args = parser.parse_args(argv)
    config = run_config(args.config_yaml)
    if args.what == "drain":
        print(json.dumps(execute("drain_job", config, {}, {})), flush=True)
        return 0

    if args.parallel > 1:
        return parallel(args.config_yaml, args.chunks, args.parallel)
    for chunk in args.chunks:
        line = execute("build_notification_queue", config, {"dagster/partition": f"{chunk:03d}"}, {"chunk": chunk})
        print(json.dumps(line), flush=True)
    return 0


def parallel(config_yaml: str, chunks: list[int], n: int) -> int:
    shares = [chunks[i::n] for i in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "reminders_pipeline_testing.celery_runs", config_yaml, "build", *map(str, share)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for share in shares
        if share
    ]
    codes = []
    for proc in procs:
        out, _ = proc.communicate()
        sys.stdout.write("".join(line + "\n" for line in out.splitlines() if line.startswith("{")))
        codes.append(proc.returncode)
    sys.stdout.flush()
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
