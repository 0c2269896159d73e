"""Put on PYTHONPATH by tests/test_raw_ddp.py's and test_accel.py's images/sec tests: in every Python process
started with it, rank 1 ends each training epoch twice as late as it would (a sleep as long as the
epoch so far, just before its epoch clock stops: after the last step's all-reduce, so rank 0's clock does not wait
for it), so that the two ranks' rates clearly differ, however loaded the machine; each rank writes the epoch
time its clock measured to $SLOW_RANK_DIR/rank-<r>-epoch-<e>. Nothing in the trainers knows of it."""

import os
import runpy
from pathlib import Path

# Python imports one sitecustomize: this one shadows tests/lean_gc's, so run that one too.
runpy.run_path(str(Path(__file__).parents[1] / "lean_gc" / "sitecustomize.py"))

if os.environ.get("SLOW_RANK_DIR"):
    import time

    from cifar_wrn import watch

    end_epoch = watch.Watch.end_epoch

    def slow_end_epoch(self):
        if self.run.rank == 1:
            time.sleep(self.seconds())
        seconds = end_epoch(self)
        Path(os.environ["SLOW_RANK_DIR"], f"rank-{self.run.rank}-epoch-{self.progress.epoch + 1}").write_text(
            repr(seconds)
        )
        return seconds

    watch.Watch.end_epoch = slow_end_epoch
