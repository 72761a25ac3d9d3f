"""A tensor-parallel training job for ``tests/test_tensor_parallel.py``: a tiny Llama loaded with
``from_pretrained(MODEL, tp_plan="auto")`` under torchrun (DTensor weights on transformers' mesh), trained by hflight's
Trainer; or the same model loaded whole and trained in one plain process, from scratch or resumed from a checkpoint.

    python tests/jobs/tp_job.py OUT --save-model MODEL                     # the tiny Llama, saved once
    torchrun --standalone --nproc_per_node=2 tests/jobs/tp_job.py OUT --model MODEL --tp
    torchrun --standalone --nproc_per_node=4 tests/jobs/tp_job.py OUT --model MODEL --fsdp 2 [--parallelism-config]
    python tests/jobs/tp_job.py OUT --model MODEL [--resume CKPT]
    ... [--best]   # evaluated every 2 steps, the best checkpoint kept (save_total_limit=1) and loaded at the end
    ... [--save-only-model]   # checkpoints of the whole model only (what transformers writes for a TP model),
                              # and trainer.save_model(OUT/final) after training
    ... [--then-best OUT2]    # then the same run with --best --save-only-model into OUT2, in the same processes

"best" (``--best``) is the highest evaluation loss (``greater_is_better=True``): the step-2 checkpoint, so that
loading it at the end shows.

Training: 4 steps of 4 blocks (seed 0; evaluation batches of 2, so that 6 blocks make several gathers),
max_grad_norm 0.5 (the tiny model's gradients are larger: every step clips),
a checkpoint every 2 steps. Global rank 0 writes ``OUT/result.json``: the world size, the tensor-parallel size, the
log history (with the gradient norms), whether the weights are DTensors, and ``OUT/weights.pt``: the whole weights
at the end (gathered from the shards) and the predictions of 6 blocks (gathered as tensors, and as pickled objects).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from hflight import Trainer, TrainerCallback, TrainingArguments
from hflight.checkpoints.sharded import full_model_state, is_sharded


def blocks(n, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 64, (n, 12), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model")
    parser.add_argument("--save-model")
    parser.add_argument(
        "--arch",
        default="llama",
        choices=["llama", "mixtral"],
        help="the model --save-model saves: a Llama, or a Mixtral (MoE: packed expert weights)",
    )
    parser.add_argument("--tp", action="store_true", help='from_pretrained(tp_plan="auto")')
    parser.add_argument("--fsdp", type=int, default=1, help="2-D: DistributedConfig(tp_size=2, fsdp_size=FSDP)")
    parser.add_argument("--replicate", type=int, default=1, help="HSDP x TP: DistributedConfig(dp_replicate_size=R)")
    parser.add_argument(
        "--parallelism-config",
        action="store_true",
        help="TrainingArguments(parallelism_config=ParallelismConfig(dp_shard_size=FSDP, tp_size=2))",
    )
    parser.add_argument("--resume")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--best", action="store_true", help="load_best_model_at_end with save_total_limit=1")
    parser.add_argument("--save-only-model", action="store_true")
    parser.add_argument(
        "--then-best",
        metavar="OUT2",
        help="then, in the same processes, the same run again with --best --save-only-model into OUT2",
    )
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if opts.save_model:
        torch.manual_seed(0)
        sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
        if opts.arch == "mixtral":
            model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **sizes))
        else:
            model = LlamaForCausalLM(LlamaConfig(**sizes))
        model.save_pretrained(opts.save_model)
        return 0
    train(opts)
    if opts.then_best:  # one launch for two runs: the processes' start is most of a job's cost
        train(argparse.Namespace(**{**vars(opts), "out": opts.then_best, "best": True, "save_only_model": True}))
    return 0


def train(opts):
    """The model loaded (whole, tensor-parallel or 2-D), trained, evaluated and its results written to ``opts.out``."""
    if opts.fsdp > 1 or opts.replicate > 1:
        from transformers.distributed import DistributedConfig

        layout = DistributedConfig(tp_size=2, fsdp_size=opts.fsdp, dp_replicate_size=opts.replicate)
        model = AutoModelForCausalLM.from_pretrained(opts.model, distributed_config=layout)
    elif opts.tp:
        model = AutoModelForCausalLM.from_pretrained(opts.model, tp_plan="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(opts.model)
    parallelism = {}
    if opts.parallelism_config:  # as a transformers user writes it beside the model's own layout
        from accelerate import ParallelismConfig

        parallelism["parallelism_config"] = ParallelismConfig(dp_replicate_size=opts.replicate,
                                                              dp_shard_size=opts.fsdp, tp_size=2)  # fmt: skip
    if opts.best:
        parallelism.update(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, save_total_limit=1,
                           metric_for_best_model="eval_loss", greater_is_better=True)  # fmt: skip
    args = TrainingArguments(output_dir=opts.out, per_device_train_batch_size=opts.batch, max_steps=4, save_steps=2,
                             per_device_eval_batch_size=2, logging_steps=1, learning_rate=1e-2, max_grad_norm=0.5,
                             use_cpu=True, seed=0, report_to="none", disable_tqdm=True,
                             include_num_input_tokens_seen="all", save_only_model=opts.save_only_model,
                             **parallelism)  # fmt: skip
    trainer = Trainer(model, args, train_dataset=blocks(64, 1), eval_dataset=blocks(6, 2))
    norms = []

    class AcceleratorNorm(TrainerCallback):
        """After the loop's clipping: ``trainer.accelerator.clip_grad_norm_`` over the whole model, as a user's code
        calls it (nothing left to clip: the norm is max_grad_norm on every layout)."""

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            norms.append(float(trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), 1e9)))

    trainer.add_callback(AcceleratorNorm())
    trainer.train(resume_from_checkpoint=opts.resume)
    metrics = trainer.evaluate()
    predictions = trainer.predict(blocks(6, 2)).predictions
    trainer.args.eval_use_gather_object = True  # gathered as pickled objects: once per data-parallel replica too
    pickled = trainer.predict(blocks(6, 2)).predictions
    if opts.save_only_model:  # and the whole model after training, as a user saves it (every process calls it)
        trainer.save_model(os.path.join(opts.out, "final"))
    # a user's own gather: every process's rows, as accelerate's (each tensor-parallel rank's too)
    gathered = trainer.accelerator.gather(torch.tensor([trainer.args.process_index]))
    whole = full_model_state(trainer.model)
    if trainer.is_world_process_zero():
        saved = {"weights": whole if whole is not None else trainer.model.state_dict(),
                 "predictions": torch.as_tensor(predictions), "pickled": torch.as_tensor(pickled)}  # fmt: skip
        torch.save(saved, os.path.join(opts.out, "weights.pt"))
        result = {"world_size": trainer.accelerator.num_processes, "tp_size": trainer.get_tp_size(),
                  "sharded": is_sharded(trainer.model), "log_history": trainer.state.log_history,
                  "loaded_sharded": [trainer.is_distributed_loading_by_transformers, trainer.place_model_on_device],
                  "eval": metrics, "accelerator_norms": norms, "accelerator_gather": gathered.tolist(),
                  "tokens_seen": trainer.state.num_input_tokens_seen,
                  "total_flos": trainer.state.total_flos,
                  "total_train_batch_size": trainer.get_total_train_batch_size(args),
                  "best": trainer.state.best_model_checkpoint and os.path.basename(trainer.state.best_model_checkpoint),
                  "kept": sorted(name for name in os.listdir(opts.out) if name.startswith("checkpoint-")),
                  "parallelism_config": None if (pc := trainer.accelerator.parallelism_config) is None else
                  [pc.dp_shard_size, pc.tp_size] + ([pc.dp_replicate_size] if opts.replicate > 1 else [])}  # fmt: skip
        with open(os.path.join(opts.out, "result.json"), "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    sys.exit(main())
