"""Where an epoch's time goes: marks are CUDA events (no sync until the epoch ends), or perf_counter."""

import time

import torch

PHASES = ("data", "forward", "backward", "optimizer", "other")


class PhaseTimer:
    """--profile's phase times; --trace's profiler of steps 3-5, stopped by totals()."""

    def __init__(self, device: torch.device, enabled: bool, trace_dir: str | None = None, rank: int = 0):
        self.enabled, self.cuda, self.marks, self.tracer = enabled, device.type == "cuda", [], None
        if trace_dir:
            profiler, kinds = torch.profiler, torch.profiler.ProfilerActivity
            self.tracer = profiler.profile(
                activities=[kinds.CPU, kinds.CUDA] if self.cuda else [kinds.CPU],
                schedule=profiler.schedule(wait=2, warmup=1, active=3, repeat=1),
                on_trace_ready=profiler.tensorboard_trace_handler(trace_dir, worker_name=f"rank{rank}"),
            )
            self.tracer.start()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, device: torch.device) -> float:
        t0 = synchronized_clock(device)
        self.marks = [(None, self._now())] if self.enabled else []
        return t0

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """Marks from hooks: the training step itself carries no timer."""
        model.register_forward_pre_hook(lambda *_: self.mark("data"))
        model.register_forward_hook(lambda *_: self.mark("forward"))
        optimizer.register_step_pre_hook(lambda *_: self.mark("backward"))
        optimizer.register_step_post_hook(lambda *_: self.mark("optimizer"))

    def mark(self, phase: str):
        if self.enabled:
            self.marks.append((phase, self._now()))
        if phase == "other" and self.tracer:
            self.tracer.step()

    def totals(self) -> dict:
        """Seconds per phase since start(); one GPU sync."""
        if self.tracer:
            self.tracer.stop()
            self.tracer = None
        if not self.enabled:
            return {}
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(PHASES, 0.0)
        for (_, before), (phase, after) in zip(self.marks, self.marks[1:]):
            out[phase] += before.elapsed_time(after) / 1000 if self.cuda else after - before
        return out


def profile_table(profile: dict, epoch_time: float, comm_estimate: float, epoch: int) -> str:
    names = (
        "data (waiting for the next batch)",
        "forward",
        "backward (+ overlapped all-reduce)",
        "optimizer step",
        "other (LR, EMA, step agreement)",
    )
    rows = [*zip(names, (profile[p] for p in PHASES))]
    rows += [
        ("sum of the parts / epoch time", sum(profile.values())),
        ("all-reduce cost estimate (no_sync)", comm_estimate),
    ]
    lines = [f"    {name:36s}{seconds:8.3f}  {100 * seconds / epoch_time:5.1f}%" for name, seconds in rows]
    return "\n".join([f"  Profile of epoch {epoch} (rank 0)          seconds   share", *lines])


def synchronized_clock(device: torch.device) -> float:
    """perf_counter after a GPU sync: the clock measures work, not launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
