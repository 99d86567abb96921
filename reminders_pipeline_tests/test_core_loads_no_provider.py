"""The sending and planning core runs on whatever sender the shell hands it: importing it loads no
provider's module and none of their libraries. The layering itself is import-linter's contract
(``[tool.importlinter]`` in pyproject.toml, run by ``.ci/run``)."""

from __future__ import annotations

import json
import subprocess
import sys

CORE = (
    "reminders_pipeline.sending.drain",
    "reminders_pipeline.sending.dispatch",
    "reminders_pipeline.planning.build",
    "reminders_pipeline.devices.actions",
    "reminders_pipeline.domain.notification",
)
PROVIDER_LIBRARIES = ("aioapns", "http_ece", "py_vapid")


def _loaded_after_importing(modules: tuple[str, ...]) -> list[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _providers_among(loaded: list[str]) -> list[str]:
    return [
        m
        for m in loaded
        if (m.startswith("reminders_pipeline.providers.") and m != "reminders_pipeline.providers.base")
        or m.split(".")[0] in PROVIDER_LIBRARIES
        or m.startswith("google.auth")
    ]


def test_importing_the_core_loads_no_provider_module_or_library():
    assert _providers_among(_loaded_after_importing(CORE)) == []


def test_the_check_sees_a_provider_when_one_is_loaded():
    loaded = _loaded_after_importing(("reminders_pipeline.providers.webpush",))
    assert "reminders_pipeline.providers.webpush" in _providers_among(loaded)
    assert "http_ece" in _providers_among(loaded)
