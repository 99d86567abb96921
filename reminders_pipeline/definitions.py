"""The code location: every definition under ``reminders_pipeline/defs/``, found by Dagster's autoloader.

Loaded by ``workspace.yaml``, ``dagster dev -m reminders_pipeline.definitions`` and the tests. The
project root is given explicitly (no ``[tool.dg]`` lookup), so an installed package loads the same
way as a checkout.
"""

import warnings
from pathlib import Path

import dagster as dg

from reminders_pipeline import defs as defs_package


@dg.definitions
def defs() -> dg.Definitions:
    with warnings.catch_warnings():
        # The autoloader and BackfillPolicy announce themselves as preview/beta on every load;
        # docs/dagster.md records why we use them. Other warnings still show.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        warnings.simplefilter("ignore", dg.BetaWarning)
        tree = dg.ComponentTree.from_module(defs_module=defs_package, project_root=Path(__file__).parent.parent)
        # In process for every job, including the implicit one behind UI materializations and
        # backfills: the default multiprocess executor spawns a process per step (~2.6 CPU-s each).
        return dg.Definitions.merge(tree.build_defs(), dg.Definitions(executor=dg.in_process_executor))
