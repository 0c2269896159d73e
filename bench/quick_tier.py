"""Wall time of the quick test tier (`python -m pytest -q`) at two commits, alternating.

    python bench/quick_tier.py 61300ae [HEAD] [--rounds 2]

Each commit is checked out into a temporary git worktree, and `python -m pytest -q -p no:cacheprovider` runs
there (pytest puts the worktree first on sys.path, so each tier imports its own cifar_wrn), the two commits
taking turns so that load on a shared machine falls on both. Prints each run's wall time, its pass/skip line and
the tests that failed, and the ratio of the medians (new / old: below 1 is faster).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_tier(tree: Path) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=tree, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]  # -q's short summary
    return seconds, "\n".join([lines[-1] if lines else f"no output (exit {done.returncode})", *failed])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the baseline commit")
    parser.add_argument("new", nargs="?", default="HEAD", help="the commit to compare (default HEAD)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    commits = {"old": args.old, "new": args.new}
    times = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="quick-tier-") as tmp:
        trees = {side: Path(tmp) / side for side in commits}
        for side, commit in commits.items():
            subprocess.run(["git", "worktree", "add", "-q", "--detach", trees[side], commit], cwd=REPO, check=True)
        try:
            for round_ in range(1, args.rounds + 1):
                for side, commit in commits.items():
                    seconds, summary = one_tier(trees[side])
                    times[side].append(seconds)
                    print(f"round {round_}  {commit:>10}  {seconds:7.1f} s  {summary}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO)
    old, new = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"median {args.old}: {old:.1f} s, {args.new}: {new:.1f} s, ratio new/old {new / old:.2f}")


if __name__ == "__main__":
    main()
