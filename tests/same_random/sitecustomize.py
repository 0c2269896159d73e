"""Put on PYTHONPATH by tests/test_speed_levers.py: inductor then draws dropout's masks from torch's generator as
eager PyTorch does (fallback_random), so that a compiled run compares with an eager one weight by weight."""

import torch._inductor.config

torch._inductor.config.fallback_random = True
