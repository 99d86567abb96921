"""The full drain of two revisions against each other: what a change to the send path costs.

    .venv/bin/python bench/ab_drain.py BASE [--change REV] [--pairs 12] [--n 5000]

BASE (and ``--change``; default: the working tree as it stands) is checked out into a throwaway
git worktree, and each tree runs its own ``bench/bench_drain.py --rounds 1`` with its own package
on ``PYTHONPATH``: one round is raw aioapns, then the full drain on SQLite and on PostgreSQL, all
against that round's mock. The trees alternate, the order flipped every pair, so the machine's
drift hits both alike, and each drain is read over the raw aioapns of its own round.

Per database it prints both trees' ratios and medians, the paired difference (change - base),
how many pairs the change is ahead, a two-sided sign test, and a verdict: ``behind`` or ``ahead`` when the
sign test says so (p < 0.05, the change behind or ahead in most pairs), ``too few pairs`` when no
split of them could (fewer than 6), else ``within noise``. At the default 12 pairs the change is
behind from 10 of 12; with rounds that range ±0.15 here, a step of a few per cent needs more. The
issue's rule: every change to ``sending/``, ``providers/`` or the claims records this on both
databases in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATABASES = ("sqlite", "postgresql")


def worktree(rev: str, parent: Path) -> Path:
    """``rev`` checked out, detached, under ``parent`` (``main`` removes it when done)."""
    path = parent / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
    return path


def one_round(tree: Path, n: int) -> dict[str, float]:
    """One round of ``tree``'s own bench_drain: each database's drain over raw aioapns."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run(
        [sys.executable, str(tree / "bench" / "bench_drain.py"), "--rounds", "1", "--n", str(n)],
        cwd=tree, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"bench_drain failed in {tree}:\n{done.stderr[-4000:]}")
    runs = json.loads(done.stdout)["runs"]
    raw = runs["raw_aioapns"][0]["sends_per_s"]
    return {db: runs[f"drain_{db}"][0]["sends_per_s"] / raw for db in DATABASES}


def sign_test(ahead: int, behind: int) -> float:
    """Two-sided p of ``ahead`` against ``behind`` under a fair coin (ties dropped)."""
    n = ahead + behind
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(ahead, behind) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _verdict(p: float, ahead: int, behind: int, pairs: int) -> str:
    if pairs < 6:
        return "too few pairs"
    if p < 0.05:
        return "behind" if behind > ahead else "ahead"
    return "within noise"


def verdict(base: list[float], change: list[float]) -> dict[str, object]:
    diffs = [c - b for b, c in zip(base, change)]
    ahead, behind = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    p = sign_test(ahead, behind)
    return {
        "base": [round(x, 3) for x in base],
        "change": [round(x, 3) for x in change],
        "base_median": round(statistics.median(base), 3),
        "change_median": round(statistics.median(change), 3),
        "paired_difference_median": round(statistics.median(diffs), 3),
        "change_ahead": f"{ahead} of {len(diffs)}",
        "sign_test_p": round(p, 3),
        "verdict": _verdict(p, ahead, behind, len(diffs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the revision to compare against")
    parser.add_argument("--change", help="the revision measured (default: the working tree as it stands)")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--n", type=int, default=5000)
    args = parser.parse_args()
    if args.pairs < 1 or args.n < 1:
        parser.error("--pairs and --n must be at least 1")
    for rev in filter(None, (args.base, args.change)):
        known = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "-q", "--verify", f"{rev}^{{commit}}"],
                               capture_output=True)  # fmt: skip
        if known.returncode != 0:
            parser.error(f"{rev!r} names no commit")
    with tempfile.TemporaryDirectory(prefix="ab-drain-") as tmp:
        made: list[Path] = []
        try:
            made.append(worktree(args.base, Path(tmp)))
            if args.change:
                made.append(worktree(args.change, Path(tmp)))
            trees = {"base": made[0], "change": made[1] if args.change else ROOT}
            rounds: dict[str, list[dict[str, float]]] = {"base": [], "change": []}
            for pair in range(args.pairs):
                for side in ("base", "change") if pair % 2 == 0 else ("change", "base"):
                    rounds[side].append(one_round(trees[side], args.n))
        finally:
            for tree in made:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    result = {
        "base": args.base,
        "change": args.change or "working tree",
        "n": args.n,
        "pairs": args.pairs,
        "drain_over_raw_aioapns": {
            db: verdict([r[db] for r in rounds["base"]], [r[db] for r in rounds["change"]]) for db in DATABASES
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
