"""Shared, distribution-free pieces of the CIFAR-10 WideResNet trainers (raw_ddp.py, accel_train.py)."""
