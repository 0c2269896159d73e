"""Test-only faults, for the failures a test cannot cause for real, set up once before the training loop.

The tests make every fault they can for real: a non-finite loss from a learning rate that diverges, a
stop from a signal, a bad file on disk. What remains injected is read from the environment here, once,
when the entry point wraps its loss function (with_test_faults); with no such variable set, as in every
real run, the loss function is returned as it is and nothing here runs again.

    CIFAR_WRN_TEST_RAISE_IN_RANK=r   rank r raises in its first forward pass: a rank that crashes (a bug,
                                     a driver error) while the others wait for it in a collective
"""

import os


def with_test_faults(criterion, rank: int):
    """The loss function the training loop calls: `criterion` itself unless a test asked for a fault."""
    raise_in_rank = os.environ.get("CIFAR_WRN_TEST_RAISE_IN_RANK")
    if raise_in_rank is None or int(raise_in_rank) != rank:
        return criterion

    def crashes(*args, **kwargs):
        raise RuntimeError(f"injected test fault in rank {rank}")

    return crashes
