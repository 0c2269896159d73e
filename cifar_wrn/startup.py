"""Steps on random tensors before the clock, so compilation, autotuning and memory growth precede epoch 1;
undone after."""

import copy
import time

import torch

from .profiling import synchronized_clock


def warm_up(run, resumed: bool = False) -> float:
    """recipe.startup_steps steps and a validation forward; the seconds taken. A resumed DDP run takes at least one:
    DDP reorders its gradient buckets after a process's first backward, which the run never stopped did at its first
    step, and from 3 ranks on the all-reduce's order of additions follows the buckets' layout."""
    recipe = run.recipe
    steps = max(recipe.startup_steps, int(resumed and run.ddp is not None))
    if not steps:
        return 0.0
    t0, device, optimizer = time.perf_counter(), run.device, run.optimizer
    parts = [part for part in (run.raw_model, run.ema, optimizer, run.scheduler) if part is not None]
    saved = [copy.deepcopy(part.state_dict()) for part in parts]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        random_images = lambda n: torch.randn(n, 3, 32, 32, device=device).contiguous(memory_format=run.layout)
        images, labels = random_images(recipe.batch_size), torch.randint(0, 10, (recipe.batch_size,), device=device)
        run.model.train()
        for _ in range(steps):
            with torch.autocast(**run.autocast):
                loss = run.criterion(run.model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            run.optimizer_step()
            run.scheduler.step()
        run.network.eval()
        with torch.no_grad(), torch.autocast(**run.autocast):
            run.network(random_images(recipe.eval_batch_size))
        run.network.train()
    for part, state in zip(parts, saved):
        restore(part, state, in_place=recipe.compile_optimizer)
    optimizer.zero_grad(set_to_none=True)
    return round(synchronized_clock(device) - t0, 3)


def restore(part, state: dict, in_place: bool) -> None:
    """A module copies into its own tensors (DDP and the optimizer keep theirs); `in_place`: an optimizer's state
    tensors too, as a compiled step guards their identity (optim.compilable made them all before the warm-up)."""
    if not (in_place and isinstance(part, torch.optim.Optimizer)):
        return part.load_state_dict(state)
    tensors = lambda tree: [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    torch._foreach_copy_(tensors(part.state_dict()), tensors(state))
