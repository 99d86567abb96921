"""Mutation testing of the modules that decide a send, with mutmut: does a slip in them break a test?

    .venv/bin/pip install -e '.[mutation]'       # mutmut, pinned; not in the lock, not in CI
    .venv/bin/python bench/mutate.py [--examples 30] [--max-children 2] [--only policy,claims] [--every N] [--report]

Scope (``SCOPES``): ``policy.py``, ``settlement.py``, ``faults.py``, the claim and settle statements
(``ledger/claims.py``) and the providers' answer mapping (the functions of ``apns.py``, ``webpush.py``,
``fcm.py`` and ``request_trace.py`` that turn an answer or a transport failure into a ``SendResult``).
Tests (``[tool.mutmut]`` in ``pyproject.toml``): those modules' unit tests and the model test, on
SQLite only, the model at ``--examples`` examples (``REMINDERS_MODEL_EXAMPLES``; CI runs 200). mutmut
runs, for each mutant, only the tests that called its function when the unmodified code ran.

mutmut works in ``mutants/`` (git-ignored) and keeps each mutant's result there, so ``--report``
reprints the table of the last runs, and ``.venv/bin/mutmut show NAME`` the diff of one mutant.
Prints one row per scope (mutants, killed, survived, timeout, other) and every survivor's name.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "reminders_pipeline"
ANSWER_FUNCTIONS = {
    "apns": ("x_result_from_apns", "x__instant_from_ms", "x_result_from_error"),
    "webpush": ("x_answer", "x_retry_after", "x_transport_failure"),
    "fcm": ("x_answer", "x_error_code", "x__message_id", "x_token_failure", "x_transport_failure"),
    "request_trace": ("x_transport_failure", "x_unreached"),
}
# Scope name -> mutant name patterns (mutmut names a mutant module.x_function__mutmut_N, or
# module.xǁClassǁmethod__mutmut_N for a method).
SCOPES: dict[str, list[str]] = {
    "policy": [f"{PKG}.policy.*"],
    "settlement": [f"{PKG}.settlement.*"],
    "faults": [f"{PKG}.faults.*"],
    "claims": [f"{PKG}.ledger.claims.*"],
    "answers": [f"{PKG}.{module}.{fn}__mutmut_*" for module, fns in ANSWER_FUNCTIONS.items() for fn in fns],
}
# mutmut's exit codes (its stats.status_by_exit_code); None: not run yet.
STATUS: dict[int | None, str] = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    None: "not checked",
}
STATUS.update(dict.fromkeys((36, 24, -24, 152, 255), "timeout"))
COLUMNS = ("killed", "survived", "timeout", "no tests", "not checked", "other")


def results() -> dict[str, str]:
    """Every mutant's status from mutmut's result files (``mutants/**/*.py.meta``)."""
    out: dict[str, str] = {}
    for meta in (ROOT / "mutants" / PKG).rglob("*.py.meta"):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = STATUS.get(code, f"other ({code})")
    return out


def in_scope(name: str, scope: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in SCOPES[scope])


def report(scopes: list[str]) -> int:
    """The table and every mutant tested but not killed; how many (0: every one tested was killed)."""
    status = results()
    print(f"| scope | mutants | {' | '.join(COLUMNS)} |")
    print("|---|---:|" + "---:|" * len(COLUMNS))
    open_ones: list[str] = []
    for scope in scopes:
        mine = {n: s for n, s in status.items() if in_scope(n, scope)}
        counts = Counter(s if s in COLUMNS else "other" for s in mine.values())
        print(f"| {scope} | {len(mine)} | {' | '.join(str(counts.get(c, 0)) for c in COLUMNS)} |")
        open_ones += sorted(n for n, s in mine.items() if s not in ("killed", "not checked"))
    for name in open_ones:
        print(f"{status[name]}: {name}")
    return len(open_ones)


def sampled(scopes: list[str], every: int) -> list[str]:
    """Every ``every``-th mutant of the scopes by mutmut's number (``…__mutmut_N``), named: a run that
    fits a time budget still spreads over every function. Needs the mutants a full run generated."""
    names = [n for n in results() if any(in_scope(n, scope) for scope in scopes)]
    if not names:
        sys.exit("no mutants generated yet: run once without --every")
    return sorted(n for n in names if int(n.rsplit("_", 1)[1]) % every == 0)


def run(scopes: list[str], examples: int, max_children: int, every: int) -> None:
    """One mutmut run over the scopes' mutants (each re-run, whatever an earlier run found)."""
    env = {**os.environ, "REMINDERS_MODEL_EXAMPLES": str(examples)}
    patterns = sampled(scopes, every) if every > 1 else [p for scope in scopes for p in SCOPES[scope]]
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *patterns]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=30, help="the model test's examples (CI: 200)")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--only", default=",".join(SCOPES), help=f"comma-separated scopes of {', '.join(SCOPES)}")
    parser.add_argument("--every", type=int, default=1, help="only every N-th mutant (by its number)")
    parser.add_argument("--report", action="store_true", help="print the last runs' results, run nothing")
    args = parser.parse_args()
    scopes = args.only.split(",")
    unknown = set(scopes) - set(SCOPES)
    if unknown:
        parser.error(f"unknown scopes: {sorted(unknown)}")
    if not args.report:
        run(scopes, args.examples, args.max_children, args.every)
    sys.exit(1 if report(scopes) else 0)


if __name__ == "__main__":
    main()
