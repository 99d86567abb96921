"""A pytest plugin for bench/mutate.py's mutmut runs (``-p bench.mutmut_plugin`` in ``[tool.mutmut]``):
every other test before the model test, the model test's failures unshrunk, and the claim's
statement rebuilt for each test.

mutmut stops at a mutant's first failing test: the model test (seconds) last lets a unit test kill
a mutant in milliseconds first. Hypothesis shrinks a failing sequence before it reports it, seconds
that say nothing here: only whether the mutant is caught counts. ``ledger.claims`` builds the
claim's statement once per process (``functools.cache``): kept, a mutant of the functions that
build it would act in whichever test built it first and be credited to that test alone.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings

settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("mutation")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: "test_model.py" in item.nodeid)  # stable: the rest keep their order


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The claim's statement is built once per process (``functools.cache``): rebuilt for each test,
    every test that claims runs the functions that build it, so mutmut maps them to those tests."""
    from reminders_pipeline.ledger import claims

    claims._claim_statement.cache_clear()
