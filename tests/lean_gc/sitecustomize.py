"""Imported by every Python process the tests start (tests/helpers.py's cpu_env puts this folder on PYTHONPATH):
less garbage collection, which costs a test run of raw_ddp.py about a quarter of its CPU time.

A test run trains for about a second; the rest is three processes (the launcher and two ranks) importing torch
and, through DistributedDataParallel, torch._dynamo, then exiting. Python's cyclic garbage collector takes a
large share of both: during the imports it runs a collection every 700 new objects over a heap that grows to
millions (about 1 s of CPU per process), and at exit it collects once more over torch's whole module graph
(about 1.5 s per process). So here:
- the first generation is collected every 100,000 new objects instead of every 700 (the older generations keep
  their defaults): the same collections, less often;
- gc.freeze() is the last exit handler (registered first, so run last): the objects still alive move out of the
  collector's reach. The process still runs every other exit handler, flushes its files and frees what reference
  counting frees; only cyclic garbage left at exit is not collected (the operating system reclaims the memory,
  as after os._exit).
Neither changes what a program computes, prints or writes; Python promises no time for a collection.
Measured with bench/process_cost.py (same run with and without this folder, alternating; retired from bench/,
`git show a467745:bench/process_cost.py`; docs/record/benchmarks.md, "What a test run costs")."""

import atexit
import gc

gc.set_threshold(100_000)
atexit.register(gc.freeze)
