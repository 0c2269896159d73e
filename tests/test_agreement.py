"""Ranks agree before they train on: what one rank finds (a checkpoint, the data, a stop signal) every rank
acts on together, so that a run never trains mixed, and never leaves ranks waiting in a collective.
Both entry points; two "nodes" are two launches on this machine meeting at one port."""

import os
import pickle
import shutil
import signal
import sys

import numpy
import pytest
import torch
from checks import load_checkpoint, read_training_state
from helpers import (
    PER_TRAIN_FILE,
    TRAIN_IMAGES,
    VAL_IMAGES,
    check_no_gloo_thread_at_exit,
    cpu_env,
    exit_threads_env,
    finish,
    free_port,
    raw_flags,
    resume_flags,
    start,
    synthetic_batch,
    two_node_flags,
)
from helpers import (
    raw_ddp as run_raw,
)
from test_accel import CONFIGS, accel_env, accelerate_command, accelerate_launch, reliability_flags

import accel_train
import raw_ddp
from cifar_wrn import ema as ema_module
from cifar_wrn.accel_side import latest_checkpoint, resolve_accel_launch
from cifar_wrn.checkpoints import resume_disagreement, resume_problem, what_was_seen
from cifar_wrn.errors import agreed_problem
from cifar_wrn.model import ARCHITECTURE, WideResNet
from cifar_wrn.profiling import PHASES
from cifar_wrn.raw_side import resolve_raw_launch
from cifar_wrn.runlog import read_log


def two_nodes(node_flags: list[list], timeout=120):
    """Two raw_ddp.py "nodes" of one process each on this machine; node k gets node_flags[k]."""
    port = free_port()
    procs = [
        start(
            [sys.executable, "raw_ddp.py", *two_node_flags(k, port), *extra],
            env=cpu_env(CIFAR10_URL="http://127.0.0.1:9/cifar-10-python.tar.gz"),
        )  # no download possible
        for k, extra in enumerate(node_flags)
    ]
    return [finish(p, timeout) for p in procs]


def two_accel_nodes(node_flags: list[list], timeout=120):
    """The same for accel_train.py: torchrun with a static rendezvous, one process per "node"."""
    port = free_port()
    procs = [
        start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                2,
                "--node_rank",
                k,
                "--nproc_per_node",
                1,
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                "accel_train.py",
                "--cpu",
                *extra,
            ],
            env=accel_env(CIFAR10_URL="http://127.0.0.1:9/cifar-10-python.tar.gz"),
        )
        for k, extra in enumerate(node_flags)
    ]
    return [finish(p, timeout) for p in procs]


# ----------------------------------------------------------------------------- pure pieces


def test_agreed_problem_names_the_ranks():
    assert agreed_problem([None, None]) is None
    assert agreed_problem([None, "no data", "no data", "bad"]) == "ranks 1, 2: no data; rank 3: bad"


def test_resume_disagreement_lists_what_each_rank_sees():
    state = {"epoch": 2, "step": 0, "cumulative_time": 12.5}
    same = [(what_was_seen(state), None)] * 2
    assert resume_disagreement(same) is None
    message = resume_disagreement([(what_was_seen(state), None), (what_was_seen(None), None)])
    assert "rank 0 sees epoch 2, step 0 (Cumulative Time 12.5 s); rank 1 sees no checkpoint" in message
    assert resume_disagreement(same[:1] + [(what_was_seen(state), "width differs")]) == "rank 1: width differs"


def test_a_rank_that_cannot_read_the_checkpoint_is_reported_as_such():
    """Not as "sees no checkpoint" with the advice to start afresh: it found one, and says why it cannot use it."""
    state = {"epoch": 2, "step": 0, "cumulative_time": 12.5}
    unreadable = "/ck/state-2/random_states_1.pkl is missing (each rank resumes its own random streams from its file)"
    message = resume_disagreement([(what_was_seen(state), None), (what_was_seen(None), unreadable)])
    assert message == f"rank 1: {unreadable}"


def test_resume_problem_names_a_different_data_size():
    recipe = {"epochs": 3, "lr_schedule": "constant"}
    checkpoint = {
        "world_size": 2,
        "model_width": 4,
        "architecture": ARCHITECTURE,
        "recipe": recipe,
        "train_images": 320,
        "val_images": 101,
        "steps_per_epoch": 5,
    }
    data = {"train_images": 320, "val_images": 101, "steps_per_epoch": 5}
    assert resume_problem(checkpoint, recipe, 2, 4, data) is None
    problem = resume_problem(checkpoint, recipe, 2, 4, dict(data, train_images=160, steps_per_epoch=2))
    assert "train images = 320, this run has 160" in problem and "--train-subset" in problem
    old = {k: v for k, v in checkpoint.items() if k not in data}  # written before the sizes were stored
    assert resume_problem(old, recipe, 2, 4, data) is None


def test_ema_warms_up_and_lives_on_the_model_device():
    assert [round(float(ema_module.warmed_up_decay(0.999, n)), 3) for n in (0, 8, 80)] == [0.1, 0.5, 0.9]
    assert ema_module.warmed_up_decay(0.99, 10_000) == numpy.float32(0.99)  # float32, as on the device
    # device=: on a GPU the update counter must live with the weights (NCCL broadcasts only CUDA tensors);
    # the meta device stands in for "not the CPU" here
    assert ema_module.build_ema(WideResNet(width=4).to("meta"), decay=0.9).n_averaged.device.type == "meta"
    model = WideResNet(width=4)
    ema = ema_module.build_ema(model, decay=0.99)
    ema.update_parameters(model)  # the first update copies the weights
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update_parameters(model)  # after 1 update the decay is min(0.99, 2/11): mostly the new weights
    decay = 2 / 11
    for averaged, old, new in zip(ema.module.parameters(), before, model.parameters()):
        assert torch.allclose(averaged, decay * old + (1 - decay) * new, atol=1e-6)


def test_ema_without_host_syncs_averages_bit_for_bit_as_the_device_counter_did():
    """WarmedUpEMA keeps its counter on the host; the AveragedModel it replaced read it on the
    device (`multi_avg_fn` below is that version's). Ten updates of moving weights and BatchNorm statistics:
    every tensor bit for bit equal, and a state_dict round trip carries the counter on."""

    def device_counter_update(ema_tensors, model_tensors, num_updates):  # the replaced multi_avg_fn
        if torch.is_floating_point(ema_tensors[0]):
            n = num_updates.to(torch.float32)
            weight = 1 - torch.clamp((1 + n) / (10 + n), max=0.99)
            torch._foreach_lerp_(ema_tensors, model_tensors, weight)
        else:
            torch._foreach_copy_(ema_tensors, model_tensors)

    torch.manual_seed(0)
    model = WideResNet(width=4)
    ema = ema_module.build_ema(model, decay=0.99)
    reference = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=device_counter_update, use_buffers=True)
    for _ in range(10):
        with torch.no_grad():
            model(torch.randn(8, 3, 32, 32))  # training mode: new BatchNorm statistics and counters
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        ema.update_parameters(model)
        reference.update_parameters(model)
    assert all(torch.equal(a, b) for a, b in zip(ema.state_dict().values(), reference.state_dict().values()))
    assert ema.updates == 10
    resumed = ema_module.build_ema(WideResNet(width=4), decay=0.99)
    resumed.load_state_dict(ema.state_dict())
    assert resumed.updates == 10
    for averaged in (ema, resumed):
        averaged.update_parameters(model)
    assert all(torch.equal(a, b) for a, b in zip(ema.state_dict().values(), resumed.state_dict().values()))


def record_evaluation_broadcasts(monkeypatch):
    """Record what cifar_wrn.agreement broadcasts (as a group of several would: one process broadcasts nothing)
    and the EMA built (cifar_wrn.ema.build_ema, which cifar_wrn.optim calls)."""
    from cifar_wrn import agreement

    calls, emas = [], []
    original_broadcast, original_build = agreement.dist.broadcast, ema_module.build_ema

    def broadcast(tensor, *args, **kwargs):
        calls.append(tensor)
        return original_broadcast(tensor, *args, **kwargs)

    def build(*args, **kwargs):
        emas.append(original_build(*args, **kwargs))
        return emas[-1]

    monkeypatch.setattr(agreement, "_grouped", lambda: True)
    monkeypatch.setattr(agreement.dist, "broadcast", broadcast)
    monkeypatch.setattr(ema_module, "build_ema", build)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # and its thread count
    return calls, emas


def check_only_network_buffers(calls, emas):
    (ema,) = emas
    network = {t.data_ptr() for t in ema.module.buffers()}
    assert calls and all(t.data_ptr() in network for t in calls), "a tensor other than the network's buffers"
    assert all(t.device == next(ema.module.parameters()).device for t in calls)


@pytest.mark.slow  # DataLoader worker processes (started inside the project's code)
def test_ema_run_broadcasts_only_the_network_buffers_raw(cifar_dir, monkeypatch):
    """Before evaluation rank 0's BatchNorm statistics are broadcast. With an EMA, AveragedModel.buffers() also
    holds its update counter: broadcasting it is useless, and on GPUs (a CPU tensor through NCCL) a crash."""
    calls, emas = record_evaluation_broadcasts(monkeypatch)
    # --master-port: run in-process, without the launcher that would otherwise host the rendezvous on a port of
    # its own (raw_ddp.py's __main__), so rank 0 binds this one itself
    flags = raw_flags(cifar_dir, "--num-gpus", 1, "--epochs", 1, "--set", "ema_decay=0.9", "--master-port", free_port())
    args, recipe = resolve_raw_launch(raw_ddp.parse_args([str(f) for f in flags]))
    raw_ddp.train_process(0, args, recipe)
    check_only_network_buffers(calls, emas)


@pytest.mark.slow  # DataLoader worker processes (started inside the project's code)
def test_ema_run_broadcasts_only_the_network_buffers_accel(cifar_dir, monkeypatch):
    """accel_train.py passes the same network (one process forms no group, so the call itself is recorded)."""
    from accelerate.state import AcceleratorState

    from cifar_wrn import agreement

    calls, emas = record_evaluation_broadcasts(monkeypatch)
    monkeypatch.setattr(agreement, "_grouped", lambda: False)
    monkeypatch.setattr(accel_train, "buffers_from_rank_0", lambda network: calls.extend(network.buffers()))
    args, recipe = resolve_accel_launch(
        accel_train.parse_args([str(f) for f in reliability_flags(cifar_dir, "--epochs", 1, "--set", "ema_decay=0.9")])
    )
    try:
        accel_train.train_process(0, args, recipe)
    finally:
        AcceleratorState._reset_state(True)  # Accelerate's state is process-wide
    check_only_network_buffers(calls, emas)


# ----------------------------------------------------------------------------- resume: one decision for all
# The checkpoints after epoch 1 are conftest's resume_runs (raw_ddp.py's and accel_train.py's, 2 processes each),
# copied: a node resuming, or refusing to, must not write into the shared ones.


@pytest.mark.slow
@pytest.mark.xdist_group("resume_runs")
def test_auto_resume_where_one_node_sees_a_checkpoint_stops_both_raw(cifar_dir, tmp_path, resume_runs):
    ck = resume_runs.copy("raw/ck", tmp_path)
    node0, node1 = two_nodes(
        [
            resume_flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", ck, "--auto-resume"),
            resume_flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", tmp_path / "empty", "--auto-resume"),
        ]
    )
    for node in (node0, node1):
        assert node.returncode == 2 and node.seconds < 120, node.stderr
        assert "rank 0 sees epoch 1, step 0" in node.stderr and "rank 1 sees no checkpoint" in node.stderr
        assert "Epoch = " not in node.stdout and "Traceback" not in node.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("resume_runs")
def test_auto_resume_where_one_node_sees_a_checkpoint_stops_both_accel(cifar_dir, tmp_path, resume_runs):
    ck = resume_runs.copy("accel/ck", tmp_path)
    node_flags = lambda folder: [
        str(f) for f in reliability_flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", folder, "--auto-resume")[1:]
    ]
    node0, node1 = two_accel_nodes([node_flags(ck), node_flags(tmp_path / "empty")])
    for node in (node0, node1):
        assert node.returncode != 0 and node.seconds < 120
        assert "rank 0 sees epoch 1, step 0" in node.stderr and "rank 1 sees no checkpoint" in node.stderr
        assert 'accel_train.py", line' not in node.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("resume_runs")
@pytest.mark.parametrize("case", ["no checkpoint on node 1", "random_states_1.pkl missing"])
def test_a_node_that_cannot_resume_stops_both_accel(cifar_dir, tmp_path, resume_runs, case):
    """--resume where node 1 lacks the checkpoint (it once stopped alone before the group formed, leaving node 0
    in the rendezvous for --dist-timeout), or lacks its own random-state file (it once stopped alone after the
    agreement): both nodes stop together within seconds of forming the group, each with the same line.
    --dist-timeout 300: a node left waiting would be killed by the test's timeout."""
    ck = resume_runs.copy("accel/ck", tmp_path)
    folder = ck / (ck / "LATEST").read_text().strip()
    node1_dir = tmp_path / "empty" if case.startswith("no checkpoint") else ck
    if case.startswith("random_states"):
        (folder / "random_states_1.pkl").unlink()
    node_flags = lambda directory: [
        str(f)
        for f in reliability_flags(
            cifar_dir, "--epochs", 2, "--checkpoint-dir", directory, "--resume", "--dist-timeout", 300
        )[1:]
    ]
    expected = (
        f"rank 1: --resume: no checkpoint in {node1_dir}"
        if case.startswith("no checkpoint")
        else f"rank 1: {folder / 'random_states_1.pkl'} is missing"
    )
    for node in two_accel_nodes([node_flags(ck), node_flags(node1_dir)], timeout=240):
        assert node.returncode != 0 and node.seconds < 180, node.stderr[-3000:]  # start-up (~20 s quiet,
        # much more under 4 loaded workers); a node left waiting would take --dist-timeout (300 s) more
        assert "error: cannot resume from " in node.stderr and expected in node.stderr, node.stderr[-3000:]
        assert "Epoch = " not in node.stdout and 'accel_train.py", line' not in node.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("resume_runs")
def test_resume_with_another_data_size_is_refused(cifar_dir, tmp_path, resume_runs):
    ck = resume_runs.copy("raw/ck", tmp_path / "raw")
    other = run_raw(
        "--num-gpus",
        2,
        *resume_flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", ck, "--resume"),
        "--train-subset",
        TRAIN_IMAGES // 2,
        env=exit_threads_env(tmp_path / "threads", cpu_env()),
    )
    assert other.returncode == 2 and "Epoch = " not in other.stdout
    assert f"train images = {TRAIN_IMAGES}, this run has {TRAIN_IMAGES // 2}" in other.stderr
    # the refusal ends the run through an exception, which holds the loop's frame: still no gloo thread at exit
    check_no_gloo_thread_at_exit(tmp_path / "threads")
    ack = resume_runs.copy("accel/ck", tmp_path / "accel")
    other = accelerate_launch(
        CONFIGS / "two_cpus.yaml",
        *reliability_flags(cifar_dir, "--checkpoint-dir", ack, "--epochs", 2, "--resume", "--val-subset", 51),
        env=exit_threads_env(tmp_path / "accel_threads", accel_env()),
    )
    assert other.returncode != 0 and not other.stdout.count("Epoch = ")
    assert f"val images = {VAL_IMAGES}, this run has 51" in other.stderr
    check_no_gloo_thread_at_exit(tmp_path / "accel_threads")


def as_a_checkpoint_of_the_earlier_model(path) -> bytes:
    """Rewrite a checkpoint file as the project's earlier model wrote it (no architecture; its own keys)."""
    state = torch.load(path, weights_only=True)
    del state["architecture"]
    if "model" in state:  # raw_ddp.py's: the earlier model's names
        state["model"] = {k.replace("input_block.cbr", "stem"): v for k, v in state["model"].items()}
    torch.save(state, path)
    return path.read_bytes()


@pytest.mark.slow
@pytest.mark.xdist_group("resume_runs")
def test_a_checkpoint_of_the_earlier_model_is_refused_and_kept(cifar_dir, tmp_path, resume_runs):
    """A checkpoint written before the model became the course's cannot continue: one error line, said by each
    rank, that the model changed; the checkpoint is left as it was."""
    ck = resume_runs.copy("raw/ck", tmp_path / "raw")
    before = as_a_checkpoint_of_the_earlier_model(ck / "checkpoint.pt")
    raw = run_raw("--num-gpus", 2, *resume_flags(cifar_dir, "--epochs", 2, "--checkpoint-dir", ck, "--auto-resume"))
    ack = resume_runs.copy("accel/ck", tmp_path / "accel")
    state = ack / (ack / "LATEST").read_text().strip() / "training_state.pt"
    accel_before = as_a_checkpoint_of_the_earlier_model(state)
    accel = accelerate_launch(
        CONFIGS / "two_cpus.yaml", *reliability_flags(cifar_dir, "--checkpoint-dir", ack, "--epochs", 2, "--resume")
    )
    for result in (raw, accel):
        errors = {line for line in result.stderr.splitlines() if line.startswith("error:")}
        assert result.returncode != 0 and "Epoch = " not in result.stdout, result.stderr[-3000:]
        assert len(errors) == 1 and "the model changed" in errors.pop(), result.stderr[-3000:]
        assert "an earlier, non-course WideResNet" in result.stderr
    assert raw.returncode == 2 and "Traceback" not in raw.stderr
    assert (ck / "checkpoint.pt").read_bytes() == before and state.read_bytes() == accel_before
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "checkpoint.pt"]  # the runs' lock (one run a folder)


# ----------------------------------------------------------------------------- data: every node has it


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["raw", "accel"])
def test_a_node_without_the_data_stops_every_node(cifar_dir, tmp_path, trainer):
    empty = tmp_path / "empty"
    if trainer == "raw":
        nodes = two_nodes([raw_flags(cifar_dir, "--epochs", 1), raw_flags(empty, "--epochs", 1)])
    else:
        nodes = two_accel_nodes(
            [[str(f) for f in reliability_flags(data_dir, "--epochs", 1)[1:]] for data_dir in (cifar_dir, empty)]
        )
    for node in nodes:
        assert node.returncode != 0 and node.seconds < 120
        assert f"node 1: CIFAR-10 is not in {empty / 'cifar-10-batches-py'}" in node.stderr, node.stderr[-2000:]
        assert "Epoch = " not in node.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("trainer", ["raw", "accel"])
def test_malformed_labels_stop_every_rank_with_a_line_naming_the_file(cifar_dir, tmp_path, trainer, nodes):
    """data_batch_1 whose labels are None (a TypeError on the rank that read it, once): 2 processes reading it,
    or two "nodes" of which only node 1's copy is bad. A rank left waiting would wait --dist-timeout (300 s);
    the bound of 120 s is start-up (slow on a loaded CI machine) plus the agreement."""
    shutil.copytree(cifar_dir, tmp_path / "bad")
    path = tmp_path / "bad" / "cifar-10-batches-py" / "data_batch_1"
    with open(path, "wb") as f:
        pickle.dump({**synthetic_batch(PER_TRAIN_FILE, seed=1), "labels": None}, f)
    data_dirs = [tmp_path / "bad"] if nodes == 1 else [cifar_dir, tmp_path / "bad"]
    if trainer == "raw":
        node_flags = [
            raw_flags(data_dir, "--epochs", 1, "--num-gpus", 3 - nodes, "--dist-timeout", 300) for data_dir in data_dirs
        ]
        results = [run_raw(*node_flags[0], timeout=200)] if nodes == 1 else two_nodes(node_flags, timeout=200)
    else:
        node_flags = [
            [str(f) for f in reliability_flags(data_dir, "--epochs", 1, "--dist-timeout", 300)[1:]]
            for data_dir in data_dirs
        ]
        results = (
            [accelerate_launch(CONFIGS / "two_cpus.yaml", "--cpu", *node_flags[0])]
            if nodes == 1
            else two_accel_nodes(node_flags, timeout=200)
        )
    for result in results:
        assert result.returncode != 0 and result.seconds < 120, result.stderr[-3000:]
        assert f"node {nodes - 1}: {path}: 'labels' must be a list of integers 0-9, found NoneType" in result.stderr
        assert "Traceback" not in result.stderr if trainer == "raw" else 'accel_train.py", line' not in result.stderr
        assert "Epoch = " not in result.stdout


# ----------------------------------------------------------------------------- --profile after a resume


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["raw", "accel"])
def test_profile_after_a_resume_at_the_last_step_of_an_epoch(cifar_dir, tmp_path, trainer):
    """A stop at the epoch's last step leaves a checkpoint with step == steps_per_epoch: the resumed epoch
    runs no step, and --profile must still report it (it once used the batch of a step never run). Epochs of
    one step (64 images, 2 x 32) make every stop one at an epoch's last step: a real SIGTERM, whenever it comes."""
    ck, one_step = tmp_path / "ck", ["--train-subset", 64, "--checkpoint-dir", tmp_path / "ck"]
    if trainer == "raw":
        command = lambda *extra: [
            sys.executable,
            "raw_ddp.py",
            "--num-gpus",
            2,
            *raw_flags(cifar_dir, *one_step, *extra),
        ]
        env, state = cpu_env(), lambda: load_checkpoint(ck)
    else:
        command = lambda *extra: accelerate_command(
            CONFIGS / "two_cpus.yaml", *reliability_flags(cifar_dir, *one_step, *extra)
        )
        env, state = accel_env(), lambda: read_training_state(latest_checkpoint(ck))
    proc = start(command("--epochs", 50, "--log-json", tmp_path / "stopped.jsonl"), env=env)
    from helpers import wait_for_epoch

    wait_for_epoch(tmp_path / "stopped.jsonl")
    os.killpg(proc.pid, signal.SIGTERM) if trainer == "raw" else proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, 90)
    epoch = state()["epoch"]  # the epochs finished before the one stopped at its last step
    assert state()["step"] == 1 and f"stopped by a signal at epoch {epoch + 1}, step 1" in stopped.stderr, (
        stopped.stderr[-2000:]
    )
    resumed = finish(
        start(command("--epochs", epoch + 2, "--resume", "--profile", "--log-json", tmp_path / "l.jsonl"), env=env), 180
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"epoch {epoch + 1}, step 1 of 1" in resumed.stdout and resumed.stdout.count("Epoch = ") == 2
    _, epochs = read_log(tmp_path / "l.jsonl")
    assert epochs[0]["comm_estimate"] == 0.0 and set(epochs[0]["profile"]) == set(PHASES)
    assert 0.0 <= epochs[1]["comm_estimate"] < epochs[1]["epoch_time"]  # measured, and a part of the epoch
