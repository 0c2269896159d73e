#!/usr/bin/env bash
# The project at its floors: every dependency at the lowest version pyproject.toml admits, in a scratch venv, runs
# the quick tier and a stop and resume of each trainer. Not run by CI (the venv takes several GB from the
# registry); run it when a floor in pyproject.toml changes, or code starts using something newer
# (docs/development.md, "The floors").
#
#   tests/floors.sh [VENV]      # VENV: the scratch venv, made if missing, reused if present
#                               # (default: ${TMPDIR:-/tmp}/cifar-wrn-floors); PYTHON=python3.X picks the Python
#
# Each dependency of pyproject.toml must read NAME>=VERSION: that VERSION is installed exactly (a pip constraint),
# with the test extra (its newest versions within their bounds). Exit status: 0 when both runs passed.
set -euo pipefail
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_DIR"
VENV=${1:-${TMPDIR:-/tmp}/cifar-wrn-floors}
PYTHON=${PYTHON:-python3}

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# pyproject.toml's floors as pip constraints (tomllib: Python 3.11 or newer).
"$VENV/bin/python" - >"$VENV/floors.txt" <<'EOF'
import re
import tomllib

for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    floor = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)", requirement.strip())
    if floor is None:
        raise SystemExit(f"pyproject.toml: {requirement!r} is not NAME>=VERSION, so it has no floor to test")
    print(f"{floor[1]}=={floor[2]}")
EOF
echo "floors: $(tr '\n' ' ' <"$VENV/floors.txt")"
# Editable, as docs/development.md installs: the tests import this checkout either way. Rerun on a reused venv,
# it points the install here and puts back any floor another install moved.
"$VENV/bin/python" -m pip install -q -c "$VENV/floors.txt" -e '.[test]'
"$VENV/bin/python" - "$VENV/floors.txt" <<'EOF'
import sys
from importlib.metadata import version

from packaging.requirements import Requirement

floors = [Requirement(line) for line in open(sys.argv[1]).read().split()]
found = {r.name: version(r.name) for r in floors}
print("installed:", " ".join(f"{name} {v}" for name, v in found.items()), "| Python", sys.version.split()[0])
wrong = [f"{r.name} {found[r.name]}" for r in floors if found[r.name] not in r.specifier]
if wrong:
    raise SystemExit(f"not at the floor: {', '.join(wrong)}")
EOF

status=0
pytest=("$VENV/bin/python" -m pytest -q -n 2 -p no:cacheprovider)  # 2 workers: as fast as 4 on 2 cores
echo "== the quick tier"
SECONDS=0
"${pytest[@]}" || status=1
echo "(quick tier: ${SECONDS} s)"
# Each trainer stopped and resumed (the quick tier resumed raw_ddp.py once already:
# test_resumed_run_equals_uninterrupted_run), the refusals, and the preemption signals.
echo "== stop and resume, both trainers"
SECONDS=0
"${pytest[@]}" --runslow \
    tests/test_accel.py::test_resumed_run_equals_uninterrupted_run_and_bad_resumes_are_refused \
    tests/test_accel.py::test_sigusr1_to_the_ranks_checkpoints_and_exits_75 \
    tests/test_reliability.py::test_a_stop_signal_checkpoints_and_the_run_resumes_exactly \
    tests/test_reliability.py::test_sigusr1_to_the_launcher_checkpoints_and_exits_75 \
    tests/test_reliability.py::test_resume_refusals \
    tests/test_resume_rules.py \
    tests/test_untrusted_inputs.py::test_accel_resume_with_ema_is_exact || status=1
echo "(stop and resume: ${SECONDS} s)"
exit "$status"
