"""What the two trainers (raw_ddp.py, accel_train.py) share."""
