"""``reminders``: the command-line shell over the core.

Exit codes: 0 done; 1 the environment is not ready (a database not at this release's migration
head, a failed check); 2 a bad argument or setting, and nothing was written. A command that reports
a result prints it as JSON on stdout, except ``check``, whose one line per relationship is read by a
person; long ones also show progress on stderr when it is a terminal.

``root`` holds the command tree's root and the commands that run the pipeline; ``devices`` and
``queue`` are their own modules, and ``context`` what every command shares.
"""

from reminders_pipeline.cli.root import main

__all__ = ["main"]
