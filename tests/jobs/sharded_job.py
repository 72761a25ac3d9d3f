"""A sharded training job for ``tests/test_sharding.py``: a tiny GPT-2 trained with FSDP2 (or DeepSpeed) under torchrun,
or resumed from a checkpoint on another number of processes (sharded or not).

    torchrun --standalone --nproc_per_node=2 tests/jobs/sharded_job.py OUT --form SHARDED_STATE_DICT
    torchrun --standalone --nproc_per_node=2 tests/jobs/sharded_job.py OUT --form FULL_STATE_DICT --save-async
    torchrun --standalone --nproc_per_node=2 tests/jobs/sharded_job.py OUT --deepspeed ZERO3.json
    torchrun --standalone --nproc_per_node=4 tests/jobs/sharded_job.py OUT --resume CKPT
    torchrun --standalone --nproc_per_node=1 tests/jobs/sharded_job.py OUT --resume CKPT
    torchrun --standalone --nproc_per_node=2 tests/jobs/sharded_job.py OUT --no-fsdp
    python tests/jobs/sharded_job.py OUT --resume CKPT --no-fsdp
    torchrun --standalone --nproc_per_node=2 --max-restarts=2 tests/jobs/sharded_job.py OUT --auto \
        --fault SIGTERM,5,0,substep --fault SIGKILL,6,0,writing,1

Training: 6 steps of 4 blocks per process (seed 0, dropout on), a checkpoint every 3 steps, then ``save_model``. Rank 0
writes ``OUT/result.json``: the world size, the log history, whether the parameters are sharded (DTensors), and for
each rank the elements of every parameter it holds (its local shard) and of the whole parameter. Resuming: a callback
gathers, once the run restored the checkpoint and before its first step, the whole model and optimizer states
(parameters by name) and rank 0 saves them to ``OUT/restored.pt``; the run then trains to its end. ``--record``: every
process records the file-system calls of ``train()`` and ``save_model()`` (``tests/durability.py``) into
``OUT/recorded/fs_events_<rank>.json``, for the power-loss replay. ``--save-async``: the checkpoints written in the
background (``save_async``).
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from hflight import Trainer, TrainingArguments
from hflight.checkpoints.sharded import full_model_state, is_sharded, named_optimizer_state


def blocks(n, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 64, (n, 16), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


class DumpRestored(TrainerCallback):
    """At ``on_train_begin`` (the checkpoint restored, nothing trained): the whole states, saved by rank 0."""

    def __init__(self, path):
        self.path = path

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        whole = full_model_state(model)
        states = {"model": model.state_dict() if whole is None else whole,
                  "optimizer": named_optimizer_state(model, optimizer, full=True)}  # fmt: skip
        if state.is_world_process_zero:
            torch.save(states, self.path)


def local_elements(model):
    from torch.distributed.tensor import DTensor

    return {name: [p.to_local().numel() if isinstance(p, DTensor) else p.numel(), p.numel()]
            for name, p in model.named_parameters()}  # fmt: skip


def recording(out):
    """Test code: this process's file-system calls recorded from now on (``tests/durability.py``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from durability import Recorder

    recorder = Recorder(out)
    recorder.install()
    return recorder


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--form", default="SHARDED_STATE_DICT")
    parser.add_argument("--resume")
    parser.add_argument("--no-fsdp", action="store_true")
    parser.add_argument("--deepspeed", help="a DeepSpeed config file: ZeRO instead of FSDP2")
    parser.add_argument("--hsdp", help="REPLICATE,SHARD: parallelism_config's dp_replicate_size, dp_shard_size")
    parser.add_argument("--auto", action="store_true", help="train(resume_from_checkpoint='auto'), as a restart does")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        help="SIGNAL,STEP,RANK,MOMENT[,ATTEMPT]: cluster_faults.SignalAt in torchrun's attempt ATTEMPT only (0: the "
        "first); repeated, one fault per attempt",
    )
    parser.add_argument("--record", action="store_true", help="record the file-system calls for the replay")
    parser.add_argument("--save-async", action="store_true", help="save_async: checkpoints written in the background")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    sharding = {} if opts.no_fsdp else {
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": opts.form},
    }  # fmt: skip
    if opts.deepspeed:
        sharding = {"deepspeed": opts.deepspeed}
    if opts.hsdp:
        from accelerate import ParallelismConfig

        replicate, shard = map(int, opts.hsdp.split(","))
        sharding["parallelism_config"] = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)
    args = TrainingArguments(output_dir=opts.out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, save_steps=3, logging_steps=1, learning_rate=1e-2, use_cpu=True, seed=0,
                             report_to="none", disable_tqdm=True, save_async=opts.save_async,
                             **sharding)  # fmt: skip
    torch.manual_seed(0)  # the arguments first: with ZeRO-3 they connect the processes the model is partitioned over
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16))
    dump = opts.resume and not opts.deepspeed  # (a DeepSpeed run's optimizer holds ZeRO's flat partitions)
    callbacks = [DumpRestored(os.path.join(opts.out, "restored.pt"))] if dump else []
    for fault in opts.fault:
        from cluster_faults import SignalAt

        name, step, rank, moment, *attempt = fault.split(",")
        callbacks.append(SignalAt(int(step), name, target="self", rank=int(rank), moment=moment,
                                  attempt=int(attempt[0]) if attempt else 0))  # fmt: skip
    trainer = Trainer(model, args, train_dataset=blocks(96, 1), callbacks=callbacks)
    recorder = recording(opts.out) if opts.record else None
    trainer.train(resume_from_checkpoint="auto" if opts.auto else opts.resume)
    if recorder is not None and trainer.is_world_process_zero():
        recorder.returned("train")
    trainer.save_model()  # every process, as transformers' examples call it
    if recorder is not None:
        if trainer.is_world_process_zero():
            recorder.returned("save_model")
        recorder.remove()
        recorded = Path(opts.out, "recorded")  # not beside the files the replay checks
        recorded.mkdir(exist_ok=True)
        recorder.dump(recorded / f"fs_events_{trainer.accelerator.process_index}.json")
    elements = trainer.accelerator.world.gather_objects([local_elements(trainer.model)])
    if trainer.is_world_process_zero():
        result = {"world_size": trainer.accelerator.num_processes, "elements": elements,
                  "sharded": is_sharded(trainer.model), "log_history": trainer.state.log_history}  # fmt: skip
        with open(os.path.join(opts.out, "result.json"), "w") as handle:
            json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
