"""Imported by every Python process the tests start (tests/conftest.py's cpu_env puts this folder on PYTHONPATH).

At exit, a Python process that imported torch (and torch._dynamo, which DistributedDataParallel imports) spends
about 1.5 s of CPU in the interpreter's last garbage collections over torch's module graph; a test run of
raw_ddp.py has three such processes (launcher and two ranks), so that is ~4 of its ~20 CPU-seconds. gc.freeze()
as the last exit handler (registered first, so run last) moves every object out of the collector's reach: the
process still runs every other exit handler, flushes its files and frees what reference counting frees; only
cyclic garbage left at exit is not collected (the operating system reclaims it, as after os._exit). The tests
check what the programs do, and no program of this project relies on a collection at exit. Measured with
bench/process_cost.py."""
import atexit
import gc

atexit.register(gc.freeze)
