"""deploy/: the Kubernetes and Celery examples validate against Dagster's own config schemas."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from dagster._config import validate_config
from dagster._core.instance.config import dagster_instance_config

from reminders_pipeline.defs.build import split

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def test_k8s_instance_and_its_run_launcher_config_are_valid():
    from dagster_k8s import K8sRunLauncher

    config, _ = dagster_instance_config(str(DEPLOY / "k8s"))
    launcher = config["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    result = validate_config(K8sRunLauncher.config_type(), launcher["config"])
    assert result.success, [e.message for e in result.errors]
    assert config["run_monitoring"]["max_resume_run_attempts"] == 0  # a half-sent drain is never resumed


def test_k8s_env_turns_on_per_chunk_runs():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "reminders-env.yaml").read_text()))
    env = docs[0]["data"]
    assert env["REMINDERS_BUILD_CHUNKS_PER_RUN"] == "1"
    assert split([(0, 3), (7, 7)], 1) == [(0, 0), (1, 1), (2, 2), (3, 3), (7, 7)]
    assert split([(0, 5)], 4) == [(0, 3), (4, 5)]
    assert split([(0, 15)], 0) == [(0, 15)]


def test_celery_instance_is_valid():
    config, _ = dagster_instance_config(str(DEPLOY / "celery"))
    assert config["run_launcher"]["class"] == "DefaultRunLauncher"


def _validate_drain_run_config(executor: str, run_config: dict) -> dict:
    """Load the definitions as a deployment would (executor chosen by environment) in a fresh process."""
    script = (
        "import json, sys, dagster as dg\n"
        "from reminders_pipeline.definitions import defs\n"
        "job = defs().get_job_def('drain_job')\n"
        "result = dg.validate_run_config(job, json.loads(sys.argv[1]))\n"
        "print(json.dumps({'executor': job.executor_def.name, 'ok': bool(result)}))\n"
    )
    env = {
        **os.environ,
        "REMINDERS_DAGSTER_EXECUTOR": executor,
        "REMINDERS_CELERY_BROKER_URL": "pyamqp://guest@127.0.0.1//",
        "REMINDERS_CELERY_BACKEND_URL": "rpc://",
    }
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(run_config)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_drain_job_runs_on_the_celery_executor_with_the_example_run_config():
    run_config = yaml.safe_load((DEPLOY / "celery" / "drain_run_config.yaml").read_text())
    assert _validate_drain_run_config("celery", run_config) == {"executor": "celery", "ok": True}


def test_drain_job_runs_on_the_k8s_job_executor():
    run_config = {"execution": {"config": {"job_namespace": "reminders", "env_config_maps": ["reminders-env"]}}}
    assert _validate_drain_run_config("k8s_job", run_config) == {"executor": "k8s", "ok": True}


def test_the_dispatcher_has_its_own_run_slots_and_a_standalone_deployment():
    for name in ("k8s", "celery"):
        config, _ = dagster_instance_config(str(DEPLOY / name))
        limits = {
            (lim["key"], lim.get("value")): lim["limit"]
            for lim in config["concurrency"]["runs"]["tag_concurrency_limits"]
        }
        assert limits[("reminders/kind", "dispatch")] == 2, name  # one in flight, two during a handover
    (deployment,) = yaml.safe_load_all((DEPLOY / "k8s" / "dispatcher-deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["reminders", "-v", "dispatch"]
    assert {e["configMapRef"]["name"] for e in container["envFrom"] if "configMapRef" in e} == {"reminders-env"}
    # A rollout's SIGTERM lets sends on the wire settle: the grace period outlasts a send's timeout.
    from reminders_pipeline.config.settings import Settings

    assert pod["terminationGracePeriodSeconds"] > Settings().send_timeout_seconds


# -- the lock file the image and CI install ---------------------------------------------------------


def _locked() -> dict[str, str]:
    """requirements.lock's pins (``name==version``, maybe followed by a marker), by normalised name."""
    from packaging.utils import canonicalize_name

    text = (ROOT / "requirements.lock").read_text()
    return {canonicalize_name(name): v for name, v in re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", text, re.MULTILINE)}


def test_the_lock_pins_every_declared_dependency_within_its_range():
    """A dependency added to pyproject.toml without running bin/lock would be missing from CI's
    install and float in the image: this names it."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = _locked()
    for line in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in locked, (
            f"{requirement.name} is declared in pyproject.toml but not in requirements.lock: run bin/lock"
        )
        assert requirement.specifier.contains(Version(locked[name]), prereleases=True), (
            f"requirements.lock has {requirement.name}=={locked[name]}, outside pyproject.toml's {requirement}: run bin/lock"
        )


def test_the_image_installs_the_lock_on_the_python_the_suite_runs_on():
    from packaging.specifiers import SpecifierSet

    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM python:(\d+\.\d+)\S*", dockerfile, re.MULTILINE)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains(f"{base}.0") and f"{sys.version_info.major}.{sys.version_info.minor}" == base
    assert re.search(r"^RUN pip install .*-c requirements\.lock", dockerfile, re.MULTILINE)
    assert "COPY requirements.lock" in dockerfile
    assert "-r requirements.lock" in (ROOT / ".ci" / "run").read_text()
