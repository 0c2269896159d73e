"""Where an epoch of fast.yaml goes on a GPU; bench/gpu_speed.sh runs each mode as a step with its own time limit.

    python bench/gpu_speed.py fast --data-dir data --set batch_size=256     # to the criterion, per epoch: the split,
                                                                            # TFLOP/s, accuracy with and without TTA
    python bench/gpu_speed.py kernels --data-dir data --set batch_size=256  # top kernels of 10 training steps
    python bench/gpu_speed.py ab --data-dir data --set batch_size=256 --lever 'NAME|--set KEY=VALUE ...' ...
    python bench/gpu_speed.py synthetic DIR                                 # a tiny synthetic CIFAR-10 (dry run)

Every run is raw_ddp.py's own train_process, 1 rank, in this process, with measurements wrapped around the calls
it makes, never inside them: CUDA events (perf_counter on a CPU) as the clock starts and around recalibrate_bn,
which split an epoch into its training steps, the BatchNorm re-estimation and the rest; the cuDNN autotuning flag
and torch._dynamo's count of compiled frames as the clock starts and stops; in `fast`, a second validation without
flip TTA on the same weights after each epoch's own. Flags this script does not know go to raw_ddp.py.

FLOPs per image: torch.utils.flop_counter.FlopCounterMode over one training step's forward and backward
(convolutions and the linear layer: BatchNorm and elementwise work count none); achieved TFLOP/s = FLOPs per image
x images trained / the epoch's training-step seconds, as a share of the GPU's bf16 dense peak (PEAK_TFLOPS by
name; another GPU: "peak unknown").

`kernels`: one epoch cut short after --profile-steps SKIP STEPS, those steps under torch.profiler (its own
process: the profiler's hooks stay out of the timed runs): top kernels by GPU time, and the share of convolutions
and matrix products, BatchNorm, elementwise work, the optimizer's and EMA's foreach kernels.
`ab`: --repeats rounds; each runs fast.yaml as shipped, then each --lever ('NAME|raw_ddp.py flags'), 2 epochs a
run; a run that would end past --deadline seconds is not started. The table: each lever's median epoch time and
spread (min-max) against fast.yaml's. The runs share one process, so only the first is a cold start (cuDNN's
choices, compiled kernels and the CUDA context are kept): epoch 2 is the comparison, epoch 1 a median.
"""

import argparse
import itertools
import json
import pickle
import shlex
import signal
import socket
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy
import torch

import raw_ddp
from cifar_wrn import watch as watch_module
from cifar_wrn.model import WideResNet
from cifar_wrn.raw_side import resolve_raw_launch
from cifar_wrn.report.scaling import stopping_epoch
from cifar_wrn.runlog import read_log

PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A30", 165.0),
)  # bf16 dense, datasheets
KINDS = (  # (kind, name fragments), the first that matches: BatchNorm before convolution (cudnn::bn_...)
    ("BatchNorm", ("batch_norm", "batchnorm", "bn_fw", "bn_bw", "welford")),
    ("convolution and matmul", ("conv", "gemm", "xmma", "cutlass", "wgrad", "dgrad", "fprop", "addmm", "aten::mm")),
    ("optimizer and EMA (foreach)", ("multi_tensor", "foreach", "lerp")),
    ("fused by torch.compile", ("triton",)),
    (
        "elementwise and reductions",
        ("elementwise", "reduce", "add", "mul", "relu", "clamp", "threshold", "dropout", "copy"),
    ),
)
PROBE = None  # the run in progress: what the wrapped calls record


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, parts in KINDS if any(p in lower for p in parts)), "other")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


class Probe:
    def __init__(self, both_views=False, profile=None):
        self.epochs, self.no_tta, self.both_views, self.profile, self.profiler = [], [], both_views, profile, None

    @staticmethod
    def mark(device):
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def between(a, b) -> float:
        return a.elapsed_time(b) / 1000 if isinstance(a, torch.cuda.Event) else b - a


def install_probes() -> None:
    """Wraps Watch.start_epoch / end_epoch and raw_ddp.py's recalibrate_bn, validate, train_epoch (globals)."""
    start_epoch, end_epoch = watch_module.Watch.start_epoch, watch_module.Watch.end_epoch
    recalibrate, validate, train_epoch = raw_ddp.recalibrate_bn, raw_ddp.validate, raw_ddp.train_epoch

    def on_start(self, progress):
        start_epoch(self, progress)
        images = self.run.data.steps_per_epoch * self.run.global_batch_size
        record = dict(images=images, cudnn_benchmark=torch.backends.cudnn.benchmark, frames=compiled_frames())
        PROBE.epochs.append(record | {"start": Probe.mark(self.run.device)})

    def on_recalibrate(network, *args):
        device = next(network.parameters()).device
        PROBE.epochs[-1]["recalibration_start"] = Probe.mark(device)
        recalibrate(network, *args)
        PROBE.epochs[-1]["recalibration_end"] = Probe.mark(device)

    def on_end(self):
        seconds = end_epoch(self)  # the clock's stop: synchronised, so the events are done
        e = PROBE.epochs[-1]
        e["frames_in_clock"] = compiled_frames() - e.pop("frames")
        e["train_steps"] = Probe.between(e.pop("start"), e["recalibration_start"])
        e["recalibration"] = Probe.between(e.pop("recalibration_start"), e.pop("recalibration_end"))
        return seconds

    def on_validate(run, recipe):
        result = validate(run, recipe)
        if PROBE.both_views and run.recipe.tta_flip:
            shipped, run.recipe = run.recipe, replace(run.recipe, tta_flip=False)
            try:
                PROBE.no_tta.append(validate(run, recipe)[1])
            finally:
                run.recipe = shipped
        return result

    def on_train_epoch(recipe, run, loader, progress, watch, checkpointer):
        if PROBE.profile and PROBE.profiler is None:
            loader = profiled(loader, run.device, *PROBE.profile)
        return train_epoch(recipe, run, loader, progress, watch, checkpointer)

    watch_module.Watch.start_epoch, watch_module.Watch.end_epoch = on_start, on_end
    raw_ddp.recalibrate_bn, raw_ddp.validate, raw_ddp.train_epoch = on_recalibrate, on_validate, on_train_epoch


def profiled(loader, device, skip: int, steps: int):
    """The loader's batches until skip + steps; torch.profiler over steps skip .. skip + steps - 1."""
    kinds = torch.profiler.ProfilerActivity
    PROBE.profiler = torch.profiler.profile(activities=[kinds.CPU] + [kinds.CUDA] * (device.type == "cuda"))
    sync, i = (torch.cuda.synchronize if device.type == "cuda" else lambda: None), -1
    for i, batch in enumerate(loader):
        if i == skip:
            sync()
            PROBE.profiler.start()
        if i == skip + steps:
            break
        yield batch
    sync()
    if i >= skip:
        PROBE.profiler.stop()


def train(flags: list[str], log: Path, probe: Probe) -> dict:
    """One raw_ddp.py run, 1 rank, in this process; its log's epochs with what the probes measured."""
    global PROBE
    PROBE = probe
    argv = [*flags, "--num-gpus", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    settings, recipe = resolve_raw_launch(raw_ddp.parse_args([*argv, "--log-json", str(log), "--progress", "off"]))
    started, frames = time.perf_counter(), compiled_frames()
    raw_ddp.train_process(0, settings, recipe)
    header, epochs = read_log(log)
    for record, measured in zip(epochs, probe.epochs):
        record.update(measured, rest=record["epoch_time"] - measured["train_steps"] - measured["recalibration"])
    wall, frames = time.perf_counter() - started, compiled_frames() - frames
    return dict(recipe=header["recipe"], epochs=epochs, wall=wall, frames=frames, no_tta=probe.no_tta)


def flops_per_image(flags: list[str]) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs per image of the model and layout the flags give, bf16 autocast."""
    from torch.utils.flop_counter import FlopCounterMode

    settings, recipe = resolve_raw_launch(raw_ddp.parse_args(flags))
    device = torch.device("cuda" if settings.device == "cuda" else "cpu")
    layout = recipe.memory_format
    model = WideResNet(width=settings.model_width).to(device, memory_format=layout)
    images = torch.randn(2, 3, 32, 32, device=device).contiguous(memory_format=layout)
    forward, backward = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with forward, torch.autocast(device.type, torch.bfloat16, enabled=recipe.precision == "bf16"):
        loss = model(images).float().logsumexp(1).mean()
    with backward:
        loss.backward()
    return forward.get_total_flops() / 2, (forward.get_total_flops() + backward.get_total_flops()) / 2


def gpu() -> tuple[str, float | None]:
    if not torch.cuda.is_available():
        return "no GPU (CPU)", None
    name = torch.cuda.get_device_name()
    return name, next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def throughput(epoch: dict, flops: float, peak: float | None) -> str:
    tflops = flops * epoch["images"] / max(epoch["train_steps"], 1e-9) / 1e12
    return f"{tflops:.3g} | " + (f"{100 * tflops / peak:.1f} %" if peak else "peak unknown")


def header_lines(flags) -> tuple[list[str], float, float | None]:
    forward, step = flops_per_image(flags)
    name, peak = gpu()
    peak_text = f"{peak:g} TFLOP/s bf16 dense" if peak else "peak unknown (not in PEAK_TFLOPS)"
    lines = [f"GPU: {name}; peak: {peak_text}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"]
    lines.append(f"FLOPs per image (FlopCounterMode): forward {forward / 1e9:.3f} G, training step {step / 1e9:.3f} G")
    return lines, step, peak


def fast(flags: list[str], out: Path) -> str:
    """fast.yaml as the flags give it, to its criterion: per epoch the split, TFLOP/s, accuracy with/without TTA."""
    lines, flops, peak = header_lines(flags)
    result = train(flags, out / "fast.jsonl", Probe(both_views=True))
    (out / "fast.json").write_text(json.dumps(result))
    epochs, recipe = result["epochs"], result["recipe"]
    lines.append(
        f"cuDNN autotuning (torch.backends.cudnn.benchmark) as the clock starts: {epochs[0]['cudnn_benchmark']}"
    )
    lines += [
        "",
        "| epoch | epoch s | training steps s | re-estimation s | rest s | TFLOP/s | share of peak | "
        "val acc (flip TTA) | val acc (no TTA) | frames compiled in the clock |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    no_tta = result["no_tta"] or [e["val_accuracy"] for e in epochs]  # tta_flip off: the same numbers
    for e, plain in zip(epochs, no_tta):
        lines.append(
            f"| {e['epoch']} | {e['epoch_time']:.3f} | {e['train_steps']:.3f} | {e['recalibration']:.3f} | "
            f"{e['rest']:.3f} | {throughput(e, flops, peak)} | {e['val_accuracy']:.4f} | {plain:.4f} | "
            f"{e['frames_in_clock']} |"
        )
    for what, accuracies in (("with flip TTA", [e["val_accuracy"] for e in epochs]), ("without TTA", no_tta)):
        hit = stopping_epoch(accuracies, recipe["target_accuracy"], recipe["patience"])
        met = f"met at epoch {hit + 1}" if hit is not None else f"not met in {len(epochs)} epochs"
        at = f", Cumulative Time {epochs[hit]['cumulative_time']:.2f} s" if hit is not None else ""
        lines.append(f"criterion {what}: {met}{at}")
    return "\n".join(lines)


def kernel_table(profiler, top: int = 15) -> str:
    """Top kernels by device time (a CPU: aten operators by self CPU time), and the share of each kind."""
    events = profiler.key_averages()
    cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    rows = [(e.key, e.count, e.self_device_time_total) for e in cuda] or [
        (e.key, e.count, e.self_cpu_time_total) for e in events if e.key.startswith("aten::")
    ]
    total = sum(t for _, _, t in rows) or 1.0
    what = "GPU kernels by GPU time" if cuda else "no GPU: aten operators by self CPU time stand in for kernels"
    lines = [f"Kernels ({what}), {total / 1000:.1f} ms in all", "", "| kernel | calls | ms | share | kind |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for name, calls, t in sorted(rows, key=lambda r: -r[2])[:top]:
        lines.append(f"| {name[:90]} | {calls} | {t / 1000:.2f} | {100 * t / total:.1f} % | {kind_of(name)} |")
    shares = {}
    for name, _, t in rows:
        shares[kind_of(name)] = shares.get(kind_of(name), 0.0) + t
    lines += ["", "| kind | ms | share |", "| --- | --- | --- |"]
    lines += [
        f"| {k} | {t / 1000:.2f} | {100 * t / total:.1f} % |" for k, t in sorted(shares.items(), key=lambda s: -s[1])
    ]
    return "\n".join(lines)


def stopped(*_):
    raise TimeoutError


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})" if values else "-"


def kernels(flags, profile: tuple, out: Path) -> str:
    """One epoch cut short, its steps profile[0] .. sum(profile) - 1 under torch.profiler."""
    probe = Probe(profile=profile)
    train([*flags, "--epochs", "1", "--set", "extra_epochs=0"], out / "kernels.jsonl", probe)
    return kernel_table(probe.profiler)


def ab(flags, levers: list[str], repeats: int, deadline: float, out: Path) -> str:
    started = time.perf_counter()
    lines, flops, peak = header_lines(flags)
    configs = [("fast.yaml", [])] + [(n.strip(), shlex.split(r)) for n, _, r in (x.partition("|") for x in levers)]
    runs, walls = {name: [] for name, _ in configs}, {}
    signal.signal(signal.SIGTERM, stopped)  # the step's time limit: the table of the runs done, then exit
    try:
        for round_, (index, (name, extra)) in itertools.product(range(repeats), enumerate(configs)):
            left = deadline - (time.perf_counter() - started)
            if walls.get(name, walls.get("fast.yaml", 0)) * 1.2 > left:
                print(f"ab: round {round_ + 1}, {name}: not started ({left:.0f} s left)", flush=True)
                continue
            log = out / f"ab-{round_ + 1}-{index:02d}.jsonl"
            result = train([*flags, *extra, "--epochs", "2", "--set", "extra_epochs=0"], log, Probe())
            walls[name] = result["wall"]
            runs[name].append(result)
            times = " ".join(f"{e['epoch_time']:.3f}" for e in result["epochs"])
            print(f"ab: round {round_ + 1}, {name}: epochs {times} s, {result['wall']:.1f} s in all", flush=True)
    except TimeoutError:
        print(f"ab: stopped by the time limit in round {round_ + 1}, {name}", flush=True)
    (out / "ab.json").write_text(json.dumps(runs))
    reference = statistics.median([r["epochs"][-1]["epoch_time"] for r in runs["fast.yaml"]] or [float("nan")])
    lines += [
        "",
        f"A/B, 2 epochs a run, interleaved rounds (up to {repeats}): median (min-max) seconds",
        "",
        "| lever | runs | epoch 2 s | vs fast.yaml | epoch 1 s | training steps s | re-estimation s | TFLOP/s | "
        "share of peak | cuDNN autotuning | frames compiled (all, in the clock) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [ab_row(name, runs[name], reference, flops, peak) for name, _ in configs]
    return "\n".join(lines)


def ab_row(name: str, results: list[dict], reference: float, flops: float, peak: float | None) -> str:
    """One lever's row: median (min-max) over its complete runs; epoch 2 against fast.yaml's median."""
    last = [r["epochs"][-1] for r in results if len(r["epochs"]) == 2]
    if not last:
        return f"| {name} | 0 | not run | | | | | | | | |"
    second = statistics.median(e["epoch_time"] for e in last)
    typical = dict(last[0], train_steps=statistics.median(e["train_steps"] for e in last))
    frames = f"{sum(r['frames'] for r in results)}, {sum(e['frames_in_clock'] for r in results for e in r['epochs'])}"
    cells = [
        name,
        len(last),
        spread([e["epoch_time"] for e in last]),
        f"{100 * (second / reference - 1):+.1f} %",
        spread([r["epochs"][0]["epoch_time"] for r in results]),
        spread([e["train_steps"] for e in last]),
        spread([e["recalibration"] for e in last]),
        throughput(typical, flops, peak),
        last[0]["cudnn_benchmark"],
        frames,
    ]
    return "| " + " | ".join(map(str, cells)) + " |"


def synthetic(folder: Path, per_file: int = 64, val: int = 101) -> None:
    """CIFAR-10's python layout with learnable images: each class its own mean colour plus noise."""
    folder = folder / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    palette = numpy.random.default_rng(1234).integers(30, 225, (10, 3))
    for name, n, seed in [*((f"data_batch_{i}", per_file, i) for i in range(1, 6)), ("test_batch", val, 99)]:
        rng = numpy.random.default_rng(seed)
        labels = rng.integers(0, 10, n)
        images = numpy.clip(palette[labels][:, :, None, None] + rng.normal(0, 25, (n, 3, 32, 32)), 0, 255)
        batch = {"data": images.astype(numpy.uint8).reshape(n, 3072), "labels": labels.tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["fast", "kernels", "ab", "synthetic"])
    p.add_argument("folder", nargs="?", help="synthetic: where to write cifar-10-batches-py/")
    p.add_argument("--out", default="runs/gpu_speed", help="the runs' JSON logs and MODE.md, the table")
    p.add_argument("--lever", action="append", default=[], help="ab: 'NAME|raw_ddp.py flags', repeatable")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--deadline", type=float, default=float("inf"), help="ab: seconds; no run starts that would end later"
    )
    p.add_argument("--profile-steps", type=int, nargs=2, default=(20, 10), metavar=("SKIP", "STEPS"))
    args, flags = p.parse_known_args(argv)
    if args.mode == "synthetic":
        synthetic(Path(args.folder or "data"))
        return 0
    install_probes()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--recipe", "fast", *flags]
    if args.mode == "fast":
        table = fast(flags, out)
    elif args.mode == "kernels":
        table = kernels(flags, tuple(args.profile_steps), out)
    else:
        table = ab(flags, args.lever, args.repeats, args.deadline, out)
    print(table, flush=True)
    (out / f"{args.mode}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
