"""python -m cifar_wrn.report, as the command cifar-wrn-report: run logs into the course's report material."""

import sys

from .cli import main

sys.exit(main())
