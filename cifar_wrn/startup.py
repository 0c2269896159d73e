"""One-time start-up before the clock: a few training steps and a validation batch on synthetic tensors of the
real shapes, so that kernel loading, cuDNN's autotuning, torch.compile and the allocator's growth (and DDP's
bucket rebuild, when the model is DDP-wrapped) fall before epoch 1, then every state put back as it was: the
weights, BatchNorm statistics, optimizer, scheduler, EMA and random streams. No training image is touched, as
MLPerf's rules ask of warm-up. The run trains afterwards exactly as it would have without it."""

import copy
import time

import torch


def _snapshot(modules: list[torch.nn.Module], optimizer, scheduler, device) -> dict:
    return {
        "modules": [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def _restore(saved: dict, modules: list[torch.nn.Module], optimizer, scheduler, device) -> None:
    for module, state in zip(modules, saved["modules"]):
        module.load_state_dict(state)  # copies into the same tensors: DDP and the optimizer keep theirs
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    optimizer.zero_grad(set_to_none=True)
    torch.set_rng_state(saved["cpu_rng"])
    if saved["cuda_rng"] is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"], device)


def warm_up(run, recipe) -> float:
    """recipe.startup_steps training steps (through run.model, as the loop trains) and one validation forward, then
    everything restored; returns the seconds it took (0 when off)."""
    if not recipe.startup_steps:
        return 0.0
    t0 = time.perf_counter()
    device, model, raw_model, ema, optimizer, scheduler = (
        run.device,
        run.model,
        run.raw_model,
        run.ema,
        run.optimizer,
        run.scheduler,
    )
    modules = [raw_model] + ([ema] if ema is not None else [])
    saved = _snapshot(modules, optimizer, scheduler, device)
    random_images = lambda n: torch.randn(n, 3, 32, 32, device=device).contiguous(memory_format=run.layout)
    images, labels = random_images(recipe.batch_size), torch.randint(0, 10, (recipe.batch_size,), device=device)
    model.train()
    for _ in range(recipe.startup_steps):
        with torch.autocast(**run.autocast):
            loss = run.criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if ema is not None:
            ema.update_parameters(raw_model)
    run.network.eval()
    with torch.no_grad(), torch.autocast(**run.autocast):
        run.network(random_images(recipe.eval_batch_size))
    run.network.train()
    _restore(saved, modules, optimizer, scheduler, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round(time.perf_counter() - t0, 3)
