"""Where an epoch's training time goes: data, forward, backward, optimizer, other.

Marks are CUDA events (no sync until the epoch ends), or perf_counter on the CPU.
"""

import contextlib
import time

import torch

PHASES = ("data", "forward", "backward", "optimizer", "other")


class PhaseTimer:
    """--profile's phase times, and --trace's profiler (stopped by the first totals())."""

    def __init__(self, device: torch.device, enabled: bool, trace_dir: str | None = None, rank: int = 0):
        self.enabled, self.cuda = enabled, device.type == "cuda"
        self.marks = []
        self.tracer = start_tracer(trace_dir, device, rank)

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, device: torch.device) -> float:
        t0 = synchronized_clock(device)
        if self.enabled:
            self.marks = [(None, self._now())]
        return t0

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Mark the phases from hooks, so that the training step itself carries no timer: the forward begins
        (data ends) and ends, the optimizer step begins (backward ends) and ends."""
        model.register_forward_pre_hook(lambda module, inputs: self.mark("data"))
        model.register_forward_hook(lambda module, inputs, outputs: self.mark("forward"))
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.mark("backward"))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.mark("optimizer"))

    def mark(self, phase: str) -> None:
        """End `phase`: the time since the previous mark is its."""
        if self.enabled:
            self.marks.append((phase, self._now()))
        if phase == "other" and self.tracer:
            self.tracer.step()

    def totals(self) -> dict:
        """Seconds per phase since start(); synchronises the GPU once."""
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


def profile_table(profile: dict, epoch_time: float, comm_estimate: float | None, epoch: int) -> str:
    names = {
        "data": "data (waiting for the next batch)",
        "forward": "forward",
        "backward": "backward (+ overlapped all-reduce)",
        "optimizer": "optimizer step",
        "other": "other (LR, EMA, step agreement)",
    }
    lines = [f"  Profile of epoch {epoch} (rank 0)          seconds   share"]
    for phase in PHASES:
        lines.append(f"    {names[phase]:36s}{profile[phase]:8.3f}  {100 * profile[phase] / epoch_time:5.1f}%")
    total = sum(profile[p] for p in PHASES)
    lines.append(f"    {'sum of the parts / epoch time':36s}{total:8.3f}  {100 * total / epoch_time:5.1f}%")
    if comm_estimate is not None:
        lines.append(
            f"    {'all-reduce cost estimate (no_sync)':36s}{comm_estimate:8.3f}"
            f"  {100 * comm_estimate / epoch_time:5.1f}%"
        )
    return "\n".join(lines)


def start_tracer(trace_dir: str | None, device: torch.device, rank: int):
    """A started profiler tracing steps 3-5 into trace_dir, or None."""
    if not trace_dir:
        return None
    tracer = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
        + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []),
        schedule=torch.profiler.schedule(wait=2, warmup=1, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, worker_name=f"rank{rank}"),
    )
    tracer.start()
    return tracer


def synchronized_clock(device: torch.device) -> float:
    """perf_counter after a GPU sync: the clock measures work, not launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def allreduce_cost(forward, backward, no_sync, zero_grad, raw_model, device, repeats: int = 3) -> float:
    """Seconds the all-reduce adds to a backward (timed with and without no_sync); all ranks must call it."""
    with state_restored(raw_model, device):
        seconds = []
        for context in (contextlib.nullcontext, no_sync):
            seconds.append(backward_seconds(forward, backward, context, device, repeats))
            zero_grad(set_to_none=True)
    return max(seconds[0] - seconds[1], 0.0)


@contextlib.contextmanager
def state_restored(raw_model: torch.nn.Module, device: torch.device):
    """A measurement must not change the run: restore buffers and random state."""
    buffers = [b.clone() for b in raw_model.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        with torch.no_grad():
            for saved, buffer in zip(buffers, raw_model.buffers()):
                buffer.copy_(saved)


def backward_seconds(forward, backward, context, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        with context():
            loss = forward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            backward(loss)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
