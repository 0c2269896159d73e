"""Training steps outside the epochs, undone after: the warm-up before the clock (compilation, autotuning and memory
growth precede epoch 1), and --profile's all-reduce estimate. Both run the entry point's own train_step."""

import contextlib
import copy
import time

import torch

from .profiling import synchronized_clock


def warm_up(run, step, resumed: bool = False) -> float:
    """recipe.startup_steps of step(recipe, run, images, labels) on random tensors, and a validation forward; the
    seconds taken. A resumed DDP run takes at least one: DDP reorders its gradient buckets after a process's first
    backward, which the run never stopped did at its first step, and from 3 ranks on the all-reduce's order of
    additions follows the buckets' layout."""
    recipe = run.recipe
    steps = max(recipe.startup_steps, int(resumed and run.ddp is not None))
    if not steps:
        return 0.0
    t0, device = time.perf_counter(), run.device
    with undone(run):
        random_images = lambda n: torch.randn(n, 3, 32, 32, device=device).contiguous(memory_format=run.layout)
        images, labels = random_images(recipe.batch_size), torch.randint(0, 10, (recipe.batch_size,), device=device)
        run.model.train()
        for _ in range(steps):
            step(recipe, run, images, labels)
        run.network.eval()
        with torch.no_grad(), torch.autocast(**run.autocast):
            run.network(random_images(recipe.eval_batch_size))
        run.network.train()
    return round(synchronized_clock(device) - t0, 3)


def allreduce_cost(run, step, images: torch.Tensor, repeats: int = 3) -> float:
    """Seconds DDP's all-reduce adds to a training step on `images` (with vs without no_sync), undone after."""
    labels = torch.zeros(len(images), dtype=torch.int64, device=images.device)  # only the time counts
    seconds = []
    with undone(run):
        for context in (contextlib.nullcontext, run.ddp.no_sync):
            best = float("inf")
            for _ in range(repeats):
                with context():
                    t0 = synchronized_clock(run.device)
                    step(run.recipe, run, images, labels)
                    best = min(best, synchronized_clock(run.device) - t0)
            seconds.append(best)
    return max(seconds[0] - seconds[1], 0.0)


@contextlib.contextmanager
def undone(run):
    """The weights, EMA, optimizer and schedule as they were before, and the random streams."""
    device, in_place = run.device, run.recipe.compile_optimizer
    parts = [part for part in (run.raw_model, run.ema, run.optimizer, run.scheduler) if part is not None]
    saved = [copy.deepcopy(part.state_dict()) for part in parts]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
    for part, state in zip(parts, saved):
        restore(part, state, in_place)
    run.optimizer.zero_grad(set_to_none=True)


def restore(part, state: dict, in_place: bool) -> None:
    """A module copies into its own tensors (DDP and the optimizer keep theirs); `in_place`: an optimizer's state
    tensors too, as a compiled step guards their identity (optim.compilable made them all before the warm-up)."""
    if not (in_place and isinstance(part, torch.optim.Optimizer)):
        return part.load_state_dict(state)
    tensors = lambda tree: [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    torch._foreach_copy_(tensors(part.state_dict()), tensors(state))
