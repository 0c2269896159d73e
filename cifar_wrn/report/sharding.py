"""How the data and the gradients are split among the ranks: DistributedSampler's shards, Accelerate's rounds of
batches, and the bytes DDP all-reduces per step."""

import math

from .logs import Run

BUCKET_CAP_MB, FIRST_BUCKET_MB = 25, 1  # DDP's defaults: bucket_cap_mb, and the smaller first bucket
MIB = 1024 * 1024


def bucket_cap_mb(run: Run) -> float:
    """The run's DDP bucket cap: its recipe key ddp_bucket_cap_mb, else DDP's default."""
    cap = run.recipe.get("ddp_bucket_cap_mb", BUCKET_CAP_MB)
    return cap if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0 else BUCKET_CAP_MB


def shards(n: int, world: int, batch: int | None) -> dict:
    """DistributedSampler's arithmetic (drop_last=False): every rank takes ceil(n / world) indices, the list
    padded with repeats of its first ones; ranks n % world .. world-1 hold one repeat each. `steps`: the
    batches of `batch` per rank with BatchSampler's drop_last=True."""
    shard = math.ceil(n / world)
    padding = shard * world - n
    steps = shard // batch if batch else None
    return {
        "shard": shard,
        "padding": padding,
        "padded_ranks": list(range(world - padding, world)),
        "steps": steps,
        "dropped": shard - steps * batch if batch else None,
    }


def accelerate_shards(n: int, world: int, batch: int, drop_last: bool) -> dict:
    """Accelerate's prepare() of a plain DataLoader (accel_train.py's DataLoader path): the loader's batches dealt
    out in rounds, rank r taking batches r, r + W, ... With drop_last the short batch and a last incomplete
    round are dropped; without it (even_batches) the short batch and the last round are filled up with the first
    images again, which gather_for_metrics leaves out."""
    if drop_last:
        rounds = n // batch // world
        return {
            "shard": rounds * batch,
            "padding": 0,
            "padded_ranks": [],
            "steps": rounds,
            "unused": n - rounds * world * batch,
        }
    rounds = math.ceil(math.ceil(n / batch) / world)
    padded = [r for r in range(world) if any((j * world + r + 1) * batch > n for j in range(rounds))]
    return {
        "shard": rounds * batch,
        "padding": rounds * world * batch - n,
        "padded_ranks": padded,
        "steps": rounds,
        "unused": 0,
    }


def gradient_bytes(run: Run) -> tuple[int, int] | None:
    """(bytes all-reduced per step, estimated DDP buckets) from the header's parameter count: gradients in the
    parameters' dtype (fp32, also under bf16 autocast), half that with grad_compression bf16; buckets from
    DDP's caps (the first FIRST_BUCKET_MB, then the run's bucket_cap_mb each), an estimate: DDP fills buckets
    with whole tensors."""
    params = run.header.get("model_parameters")
    if not isinstance(params, int):
        return None
    grads = params * 4
    buckets = 1 + math.ceil(max(0, grads - FIRST_BUCKET_MB * MIB) / (bucket_cap_mb(run) * MIB))
    return grads // (2 if run.recipe.get("grad_compression") == "bf16" else 1), buckets


def ddp_buckets(run: Run) -> int | None:
    """DDP's buckets for the course's model of the header's width, counted as DDP fills them (its
    _compute_bucket_assignment_by_size): whole gradients in reverse order, a bucket closed once it reaches its
    cap (the first FIRST_BUCKET_MB, then bucket_cap_mb); None for another model (gradient_bytes estimates)."""
    import torch

    from ..model import ARCHITECTURE, WideResNet

    width = run.header.get("model_width")
    if run.header.get("architecture") != ARCHITECTURE or not isinstance(width, int):
        return None
    with torch.device("meta"):  # shapes only: no memory, no time
        sizes = [p.numel() * 4 for p in WideResNet(width=width).parameters()]
    buckets, filled = 0, 0
    for size in reversed(sizes):
        filled += size
        if filled >= (FIRST_BUCKET_MB if buckets == 0 else bucket_cap_mb(run)) * MIB:
            buckets, filled = buckets + 1, 0
    return buckets + (filled > 0)
