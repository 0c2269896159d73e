"""Steps on random tensors before the clock, so compilation, autotuning and memory growth precede epoch 1;
undone after."""

import copy
import time

import torch


def warm_up(run, recipe) -> float:
    """recipe.startup_steps steps and a validation forward; the seconds taken."""
    if not recipe.startup_steps:
        return 0.0
    t0, device, ema, optimizer, scheduler = time.perf_counter(), run.device, run.ema, run.optimizer, run.scheduler
    modules = [m for m in (run.raw_model, ema) if m is not None]
    weights = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules]
    states = [copy.deepcopy(part.state_dict()) for part in (optimizer, scheduler)]
    cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    random_images = lambda n: torch.randn(n, 3, 32, 32, device=device).contiguous(memory_format=run.layout)
    images, labels = random_images(recipe.batch_size), torch.randint(0, 10, (recipe.batch_size,), device=device)
    run.model.train()
    for _ in range(recipe.startup_steps):
        with torch.autocast(**run.autocast):
            loss = run.criterion(run.model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if ema is not None:
            ema.update_parameters(run.raw_model)
    run.network.eval()
    with torch.no_grad(), torch.autocast(**run.autocast):
        run.network(random_images(recipe.eval_batch_size))
    run.network.train()
    for module, state in zip(modules, weights):
        module.load_state_dict(state)  # copies into the same tensors: DDP and the optimizer keep theirs
    for part, state in zip((optimizer, scheduler), states):
        part.load_state_dict(state)
    optimizer.zero_grad(set_to_none=True)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, device)
        torch.cuda.synchronize(device)
    return round(time.perf_counter() - t0, 3)
