"""The code location: every definition under ``reminders_pipeline/defs/``, found by Dagster's autoloader.

Loaded by ``workspace.yaml``, ``dagster dev -m reminders_pipeline.definitions``, ``dg list defs`` /
``dg check defs`` (``[tool.dg]`` in pyproject.toml names this module) and the tests. The project root
is given explicitly (no ``[tool.dg]`` lookup), so an installed package loads the same way as a checkout.
"""

import warnings
from pathlib import Path

import dagster as dg

from reminders_pipeline import defs as defs_package
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.defs.executors import job_executor

# Binding resources to a job a sensor targets (the dispatcher's) makes Dagster copy the sensor
# through its own beta ``owners`` parameter, later, when the repository is resolved in the webserver
# and daemon: a warning about Dagster's internals, not ours. Only that message is silenced.
warnings.filterwarnings(
    "ignore", message="Parameter `owners` of initializer `SensorDefinition", category=dg.BetaWarning
)


@dg.definitions
def defs() -> dg.Definitions:
    with warnings.catch_warnings():
        # The autoloader and BackfillPolicy announce themselves as preview/beta on every load;
        # docs/dagster.md records why we use them. Other warnings still show.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        warnings.simplefilter("ignore", dg.BetaWarning)
        tree = dg.ComponentTree.from_module(defs_module=defs_package, project_root=Path(__file__).parent.parent)
        # The one choice of executor, for every job that does not pin its own (the dispatcher's two
        # run in process), including the implicit one behind UI materializations and backfills.
        # In process by default: the multiprocess executor spawns a process per step (~2.6 CPU-s
        # each). REMINDERS_DAGSTER_EXECUTOR moves steps onto Celery or Kubernetes (deploy/).
        executor = job_executor(Settings.from_env().dagster_executor)
        return dg.Definitions.merge(tree.build_defs(), dg.Definitions(executor=executor))
