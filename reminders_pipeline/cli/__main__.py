"""``python -m reminders_pipeline.cli``: the ``reminders`` command."""

from reminders_pipeline.cli import main

main()
