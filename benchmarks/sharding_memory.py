"""Model-state memory per process under DDP, FSDP2, DeepSpeed ZeRO-3 and tensor parallelism, at 1, 2 and 4 processes
(issue 35, item 6; issue 48).

Each run is ``torchrun --standalone --nproc_per_node=N`` of this script's worker: hflight's Trainer trains a GPT-2
(default: 12 layers of 768, about 124M parameters, 500 MB of fp32 weights) for a few steps on the CPU with AdamW, and
every process reports, from the tensors it holds itself:

- parameters: its weights (FSDP2: the DTensor's local shard; ZeRO-3: DeepSpeed's partition ``ds_tensor``);
- gradients: its gradients, measured before the optimizer step (FSDP2: local shards; ZeRO-3: the flat buffer of
  its gradient partitions);
- optimizer: Adam's moments, and ZeRO-3's fp32 master copy of its partition (DDP and FSDP2 step the weights
  themselves);
- peak RSS (``ru_maxrss``: everything the process ever held, the model as built before sharding included);
- the time of a step after the first (its median), against DDP at the same number of processes.

The table prints the per-process maximum of each, and each strategy's model-state bytes (parameters + gradients +
optimizer) as a fraction of DDP's at the same N. Target (full sharding): <= 1/N + 10% of DDP's.

Tensor parallelism (rows ``tp``: TP over all N processes, ``from_pretrained(..., tp_plan="auto")``; ``tp_fsdp2``: at 4
processes, ``DistributedConfig(tp_size=2, fsdp_size=2)``: FSDP2 across, TP inside) trains a Llama of the same layers and
width (transformers' plans exist for Llama, not GPT-2), saved by each process and loaded with the plan. Its ``x DDP`` is
against that Llama unsharded (its whole parameters x 4: weights, gradients, Adam's two moments, what DDP holds), and its
step time has no DDP ratio (another model). The last column, ``TP'd share``, is the fraction of the weights the
tensor-parallel plan shards (the DTensors with a ``tp`` dimension) that each process holds: 1/tp, halved again by FSDP2
in ``tp_fsdp2``. The row's ``x DDP`` is above it: the norms stay whole, and transformers 5.23 shards the embedding's
weight over ``tp`` but gives it a whole gradient (a ``Replicate`` DTensor), so ``grads MiB`` is above ``params MiB``
there.

    python benchmarks/sharding_memory.py                          # 124M parameters, 1 2 4 processes, 4 steps
    python benchmarks/sharding_memory.py --layers 2 --hidden 64 --processes 1 2 --steps 2   # a quick look
    python benchmarks/sharding_memory.py --strategies fsdp2 tp --processes 2             # some rows (and DDP's)

Runs are one after another (the CPU's cores are shared by the N processes of a run); a step's time on a 2-core
machine with 4 processes measures mostly the contention, not the strategy. ``--at-once`` starts every run together
(the memory columns hold, the step times do not; the test suite's quick check).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20
STRATEGIES = ("ddp", "fsdp2", "zero3")
#: tensor-parallel rows: TP over every process (N > 1), and 2 x 2 (FSDP2 x TP, N = 4)
TENSOR_PARALLEL = ("tp", "tp_fsdp2")
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}  # fmt: skip


def cpu() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


# ---- the worker (one process of a torchrun job) ----------------------------------------------------------------------
def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    partition = getattr(tensor, "ds_tensor", None)  # ZeRO-3: the process's partition of the parameter
    if partition is not None:
        tensor = partition
    return tensor.numel() * tensor.element_size()


def _optimizer_bytes(optimizer) -> int:
    """Bytes of every tensor of the optimizer's state (and, for DeepSpeed's ZeRO optimizer, its fp32 partitions)."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    total = sum(_local_bytes(v) for state in inner.state.values() for v in state.values() if torch.is_tensor(v))
    for group in getattr(optimizer, "fp32_partitioned_groups_flat", []) or []:
        total += _local_bytes(group)
    return total


def _whole_bytes(tensor) -> int:
    """Bytes of the whole tensor, of which a DTensor holds a shard."""
    return tensor.numel() * tensor.element_size()


def _tensor_parallel_share(model) -> float | None:
    """The fraction of the tensor-parallel weights' bytes (DTensors sharded over a ``tp`` mesh dimension) this process
    holds (None: no such weight)."""
    from torch.distributed.tensor import DTensor, Shard

    local = whole = 0
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        names = p.device_mesh.mesh_dim_names or ()
        if any(n == "tp" and isinstance(place, Shard) for n, place in zip(names, p.placements, strict=True)):
            local, whole = local + _local_bytes(p), whole + _whole_bytes(p)
    return local / whole if whole else None


def _llama(opts: argparse.Namespace):
    """A Llama of the benchmark's layers and width (transformers' tensor-parallel plans cover Llama, not GPT-2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=50304, hidden_size=opts.hidden, intermediate_size=4 * opts.hidden,
                         num_hidden_layers=opts.layers, num_attention_heads=max(4, opts.hidden // 64),
                         num_key_value_heads=max(4, opts.hidden // 64), max_position_embeddings=256)  # fmt: skip
    return LlamaForCausalLM(config)


def _tensor_parallel_model(strategy: str, opts: argparse.Namespace):
    """The Llama loaded under torchrun with transformers' plan: TP over every process, or 2 x N/2. Each process saves
    the same seeded model into a folder of its own first (no process waits for another's files)."""
    import torch
    from transformers import LlamaForCausalLM

    path = os.path.join(opts.out, f"llama-{os.environ.get('RANK', '0')}")
    torch.manual_seed(0)
    _llama(opts).save_pretrained(path)
    if strategy == "tp":
        return LlamaForCausalLM.from_pretrained(path, tp_plan="auto")
    from transformers.distributed import DistributedConfig

    layout = DistributedConfig(tp_size=2, fsdp_size=int(os.environ["WORLD_SIZE"]) // 2)
    return LlamaForCausalLM.from_pretrained(path, distributed_config=layout)


def _gradient_bytes(model, optimizer) -> int:
    buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if buffer is not None:  # ZeRO-3: the process's gradient partitions, in one flat buffer
        return _local_bytes(buffer)
    return sum(_local_bytes(p.grad) for p in model.parameters())


def worker(opts: argparse.Namespace) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    from hflight import Trainer, TrainingArguments

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    sharding = {
        "ddp": {},
        "tp": {},
        "tp_fsdp2": {},
        "fsdp2": {"fsdp": "full_shard auto_wrap", "fsdp_config": {"transformer_layer_cls_to_wrap": ["GPT2Block"]}},
        "zero3": {"deepspeed": ZERO3},
    }[opts.strategy]
    args = TrainingArguments(opts.out, per_device_train_batch_size=1, max_steps=opts.steps, learning_rate=1e-4,
                             logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             disable_tqdm=True, **sharding)  # fmt: skip
    torch.manual_seed(0)
    config = GPT2Config(n_embd=opts.hidden, n_layer=opts.layers, n_head=max(1, opts.hidden // 64), n_positions=256)
    if opts.strategy in TENSOR_PARALLEL:
        model = _tensor_parallel_model(opts.strategy, opts)
    else:
        model = GPT2LMHeadModel(config)
    vocab = model.config.vocab_size
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (64, opts.seq_len))]

    class Measure(TrainerCallback):
        def __init__(self):
            self.figures: dict = {}
            self.begun = 0.0
            self.steps: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begun = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.figures["gradients"] = _gradient_bytes(model, _engine_optimizer(trainer) or optimizer)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.steps.append(time.perf_counter() - self.begun)
            engine_optimizer = _engine_optimizer(trainer) or optimizer
            self.figures["parameters"] = sum(_local_bytes(p) for p in model.parameters())
            self.figures["whole_parameters"] = sum(_whole_bytes(p) for p in model.parameters())
            self.figures["tp_share"] = _tensor_parallel_share(model)
            self.figures["optimizer"] = _optimizer_bytes(engine_optimizer)

    measure = Measure()
    trainer = Trainer(model, args, train_dataset=data, callbacks=[measure])
    trainer.train()
    figures = {**measure.figures, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "step_s": statistics.median(measure.steps[1:] or measure.steps)}  # fmt: skip
    everyone = trainer.accelerator.world.gather_objects([figures])
    if trainer.is_world_process_zero():
        Path(opts.out, "figures.json").write_text(json.dumps(everyone))


def _engine_optimizer(trainer):
    """DeepSpeed's ZeRO optimizer (which holds the partitions), when the run has an engine."""
    engine = (
        getattr(trainer.lightning_trainer.strategy, "deepspeed_engine", None) if trainer.lightning_trainer else None
    )
    return getattr(engine, "optimizer", None)


# ---- the driver ------------------------------------------------------------------------------------------------------
def start(strategy: str, processes: int, opts: argparse.Namespace, root: Path) -> tuple[subprocess.Popen, Path]:
    out = root / f"{strategy}-{processes}"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", f"--nproc_per_node={processes}", __file__, "--worker", strategy,
               "--out", str(out), "--layers", str(opts.layers), "--hidden", str(opts.hidden),
               "--seq-len", str(opts.seq_len), "--steps", str(opts.steps)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
    out.mkdir(parents=True)
    with open(out / "output.log", "w") as log:  # a file, not a pipe: runs started together never block
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return job, out


def finish(strategy: str, processes: int, job: subprocess.Popen, out: Path) -> list[dict]:
    if job.wait() != 0:
        output = (out / "output.log").read_text(errors="replace")
        raise SystemExit(f"{strategy} on {processes} failed:\n{output[-6000:]}")
    return json.loads((out / "figures.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES + TENSOR_PARALLEL,
                        default=list(STRATEGIES + TENSOR_PARALLEL),
                        help="the rows to run (default: all); ddp runs too with fsdp2 or zero3, their "
                             "reference")  # fmt: skip
    parser.add_argument("--at-once", action="store_true",
                        help="start every run together (a quick look at the memory columns; the step times then "
                             "measure the runs' contention with each other and are not comparable)")  # fmt: skip
    parser.add_argument("--worker", choices=STRATEGIES + TENSOR_PARALLEL, dest="strategy", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.strategy:
        worker(opts)
        return
    root = Path(tempfile.mkdtemp(prefix="hflight-sharding-memory-"))
    print(f"GPT-2, {opts.layers} layers of {opts.hidden}, sequences of {opts.seq_len}, batch 1 per process, AdamW; "
          f"CPU: {cpu()} ({os.cpu_count()} cores)")  # fmt: skip
    header = f"{'strategy':<8}{'N':>3}{'params MiB':>12}{'grads MiB':>11}{'optim MiB':>11}{'state MiB':>11}"
    print(header + f"{'x DDP':>8}{'1/N+10%':>9}{'peak RSS MiB':>14}{'step s':>8}{'x DDP':>7}{'TP share':>10}")
    chosen = set(opts.strategies) | ({"ddp"} if {"fsdp2", "zero3"} & set(opts.strategies) else set())
    runs = [(strategy, processes) for processes in opts.processes for strategy in STRATEGIES if strategy in chosen]
    runs += [("tp", n) for n in opts.processes if n > 1 and "tp" in chosen]
    runs += [("tp_fsdp2", n) for n in opts.processes if n == 4 and "tp_fsdp2" in chosen]
    # one after another, or (--at-once) all started here (FSDP2 on 1 process: torchrun's one rank, as transformers)
    started = {run: start(*run, opts, root) for run in runs if opts.at_once}
    reference = {}
    for strategy, processes in runs:
        job, out = started.get((strategy, processes)) or start(strategy, processes, opts, root)
        ranks = finish(strategy, processes, job, out)
        worst = {key: max(rank[key] or 0 for rank in ranks) for key in ranks[0]}
        state = worst["parameters"] + worst["gradients"] + worst["optimizer"]
        if strategy in TENSOR_PARALLEL:  # against the same Llama unsharded: weights, gradients, Adam's 2 moments
            share, step_ratio = state / (4 * worst["whole_parameters"]), "-"
        else:
            ddp = reference.setdefault(processes, {"state": state, "step_s": worst["step_s"]})
            share, step_ratio = state / ddp["state"], f"{worst['step_s'] / ddp['step_s']:.2f}"
        tp_share = f"{worst['tp_share']:.3f}" if worst["tp_share"] else "-"
        print(f"{strategy:<8}{processes:>3}{worst['parameters'] / MIB:>12.1f}{worst['gradients'] / MIB:>11.1f}"
              f"{worst['optimizer'] / MIB:>11.1f}{state / MIB:>11.1f}{share:>8.3f}{1 / processes + 0.1:>9.3f}"
              f"{worst['peak_rss'] / MIB:>14.0f}{worst['step_s']:>8.2f}{step_ratio:>7}{tp_share:>10}")  # fmt: skip
    if opts.at_once:
        print("(--at-once: the runs shared the CPU, so their step times are not comparable)")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
