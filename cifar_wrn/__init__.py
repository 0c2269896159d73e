"""Shared, distribution-free pieces of the CIFAR-10 WideResNet trainers (raw_ddp.py, accel_train.py).

model   the fixed WideResNet
data    loading and validating CIFAR-10, augmentation, the padding mask for exact evaluation
recipe  hyperparameters (one dataclass, YAML recipes), optimizer and LR schedule
runlog  the per-epoch line, the JSON-lines log, the git commit
"""
