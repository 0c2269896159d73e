"""Where an epoch's training time goes: data, forward, backward, optimizer, other.

PhaseTimer puts a timestamp at each phase boundary of every step. On CUDA the timestamps are events
on the GPU's stream (so a phase is what the GPU timeline spent on it, host waits included, with no
synchronisation until the epoch ends); on the CPU they are perf_counter readings (CPU work is
synchronous; DDP's backward returns only after its all-reduce has finished). When profiling is off
the timer is disabled and each call returns at once.
"""

import contextlib
import time

import torch

PHASES = ("data", "forward", "backward", "optimizer", "other")


class PhaseTimer:
    """--profile's phase times, and --trace's torch.profiler (started here, stepped by each "other" mark,
    stopped by the first totals(): the trace covers steps 3-5 of the first epoch this process runs)."""

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
        """A new epoch: returns its start on the epoch clock (synchronized_clock), and starts the phase marks."""
        t0 = synchronized_clock(device)
        if self.enabled:
            self.marks = [(None, self._now())]
        return t0

    def mark(self, phase: str) -> None:
        """The phase that has just ended (the time since the previous mark belongs to it)."""
        if self.enabled:
            self.marks.append((phase, self._now()))
        if phase == "other" and self.tracer:  # the step's last mark
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
    """Rank 0's per-epoch table: seconds and share of the epoch per phase, their sum, the all-reduce estimate."""
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
    """--trace DIR: a torch.profiler trace of steps 3-5 of this rank (every kernel; for TensorBoard or
    Perfetto), started; None without --trace. Call .step() after each step and .stop() after the epoch."""
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
    """perf_counter once the GPU has finished what it was told: the clock measures work, not launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def allreduce_cost(forward, backward, no_sync, zero_grad, raw_model, device, repeats: int = 3) -> float:
    """Seconds per step that gradient synchronisation adds to backward (--profile): the same batch's
    backward timed with DDP's all-reduce and inside no_sync() (no all-reduce). All ranks must call it
    together. BatchNorm statistics, random state and gradients are put back as they were."""
    with state_restored(raw_model, device):
        seconds = []
        for context in (contextlib.nullcontext, no_sync):  # with the all-reduce, then without it
            seconds.append(backward_seconds(forward, backward, context, device, repeats))
            zero_grad(set_to_none=True)
    return max(seconds[0] - seconds[1], 0.0)


@contextlib.contextmanager
def state_restored(raw_model: torch.nn.Module, device: torch.device):
    """Put the BatchNorm buffers and the random state back on exit: an extra measurement (--profile's
    all-reduce estimate) must not change what the run does next."""
    buffers = [b.clone() for b in raw_model.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # as recalibrate_bn
            yield
    finally:
        with torch.no_grad():
            for saved, buffer in zip(buffers, raw_model.buffers()):
                buffer.copy_(saved)


def backward_seconds(forward, backward, context, device: torch.device, repeats: int) -> float:
    """Best of `repeats` timings of backward(forward()), forward and backward inside context() (DDP's
    no_sync, say); only the backward is timed. Gradients are set to None afterwards by the caller."""
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
