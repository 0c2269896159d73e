"""Put on PYTHONPATH by tests/test_seeds.py for bench/sync_count.py on the CPU, where CUDA's sync debug mode warns
of nothing: each EMA update warns twice of a synchronisation, as that mode would, and once of something else.
Nothing in bench/ knows of it."""

import warnings

from cifar_wrn.ema import WarmedUpEMA

update_parameters = WarmedUpEMA.update_parameters


def update_parameters_warning(self, model):
    for _ in range(2):
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
    warnings.warn("something else", stacklevel=1)
    return update_parameters(self, model)


WarmedUpEMA.update_parameters = update_parameters_warning
