"""``accelerator_config`` and ``trainer.accelerator`` under torchrun, transformers' Trainer and hflight's on the same
script (issue 40, items 2 and 3), one library after the other in the same two processes (one start for both):

    torchrun --standalone --nproc_per_node 2 tests/jobs/accelcfg_job.py OUT transformers hflight

Each library starts as a process of its own would: the environment as the job found it (transformers' arguments set
``ACCELERATE_*`` variables) and no accelerate state but a new ``PartialState`` on the process group made for the first
library (the group is the only thing they share). Per library, several runs, one after the other (:data:`RUNS`), of a
tiny regression model with dropout whose inputs carry their sample id, so that each rank records the samples of every
micro-batch it trained on. Each rank writes ``OUT/<library>/<run>_rank<r>.json``: the samples seen, ``sync_gradients``
at each step event, the log history, the final weights, evaluation and prediction results, and what
``trainer.accelerator`` answers (layout, settings, collectives), with whether the process group is still up when
``train()`` returns (transformers' Trainer leaves it to the process's exit or ``end_training``, and so must hflight's:
the runs after it use it). The first run uses an accelerate ``PartialState`` made before the arguments
(``use_configured_state``).
"""

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gloo_exit  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from sync_records import SyncRecorder  # noqa: E402
from torch import nn  # noqa: E402

import hflight  # noqa: E402

#: run name -> (accelerator_config, training sizes and settings)
RUNS = {
    # an accelerate state made before the arguments, used as it is; evaluated after training on a loader of each
    # rank's own 6 samples (a get_eval_dataloader override: transformers does not deal it, every rank's loss kept)
    "configured_state": ({"use_configured_state": True}, dict(train=8, eval=6, batch=2, accumulation=1, epochs=1)),
    # each global batch of 4 cut in two; the last one (3 samples) cut unevenly; torch's RandomSampler with the
    # generator accelerate gives it; gradients synchronised at every micro-batch; non-blocking copies
    "split_uneven": (
        {
            "split_batches": True,
            "even_batches": False,
            "use_seedable_sampler": False,
            "non_blocking": True,
            "gradient_accumulation_kwargs": {"sync_each_batch": True},
        },
        dict(train=11, eval=12, batch=4, accumulation=2, epochs=2),
    ),  # fmt: skip
    # rank 0 reads two batches of 2 and sends them; the last global batch (1 sample) completed from the first; the
    # seedable sampler on data_seed; evaluation dispatched too (11 samples: padded, then cut)
    "dispatch": ({"dispatch_batches": True}, dict(train=13, eval=11, batch=2, accumulation=2, epochs=2, data_seed=7)),
    # an iterable dataset: dispatched by default (rank 0 reads the stream); evaluated after training on a stream of 11
    # (dispatched, the last global batch completed then cut)
    "iterable": ({}, dict(train=10, eval=0, batch=2, accumulation=1, max_steps=3)),
}


class Tiny(nn.Module):
    """A regression model with dropout; column 0 of ``x`` is the sample's id, recorded by every training forward."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.hidden, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        self.drop = nn.Dropout(0.2)
        self.seen: list[list[int]] = []

    def forward(self, x, labels=None):
        if self.training:
            self.seen.append(x[:, 0].long().tolist())
        prediction = self.out(self.drop(torch.tanh(self.hidden(x[:, 1:])))).squeeze(-1)
        if labels is None:  # predicted without labels: no loss
            return {"logits": prediction}
        return {"loss": ((prediction - labels) ** 2).mean(), "logits": prediction}


def rows(n: int, offset: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(n + offset)
    features = torch.randn(n, 4, generator=generator)
    return [{"x": torch.cat([torch.tensor([float(i)]), features[i]]), "labels": features[i].sum() * 0.3}
            for i in range(n)]  # fmt: skip


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __iter__(self):
        yield from self.items


def surface(trainer, eval_rows: list[dict]) -> dict:
    """What trainer.accelerator answers on this rank (values that must be transformers')."""
    acc, rank = trainer.accelerator, trainer.args.process_index
    answers = {name: getattr(acc, name) for name in (
        "num_processes", "process_index", "local_process_index", "is_main_process", "is_local_main_process",
        "split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "non_blocking",
        "gradient_accumulation_steps", "mixed_precision", "sync_gradients", "use_distributed")}  # fmt: skip
    answers["distributed_type"] = str(acc.distributed_type)
    answers["state"] = [acc.state.num_processes, acc.state.process_index, str(acc.state.distributed_type)]
    answers["plugin_kwargs"] = acc.gradient_state.plugin_kwargs
    mine = torch.arange(rank + 2, dtype=torch.float32) + 10 * rank  # rank 0: 2 values, rank 1: 3
    answers["gather"] = acc.gather(torch.tensor([rank, rank + 1])).tolist()
    answers["gather_scalar"] = acc.gather(torch.tensor(float(rank))).tolist()
    answers["pad"] = acc.pad_across_processes(mine, dim=0, pad_index=-1).tolist()
    answers["pad_first"] = acc.pad_across_processes(mine[None], dim=-1, pad_index=-2, pad_first=True).tolist()
    for reduction in ("sum", "mean", "max"):
        answers[f"reduce_{reduction}"] = acc.reduce(torch.tensor([rank + 1.0, 2.0 * rank]), reduction).tolist()
    if eval_rows:  # gather_for_metrics over a prepared loader: each sample once
        ids = [acc.gather_for_metrics(batch["x"][:, 0].contiguous()).tolist()
               for batch in trainer.get_eval_dataloader(eval_rows)]  # fmt: skip
        answers["gather_for_metrics"] = ids
    return answers


def run_one(library, name: str, config: dict, sizes: dict, out: Path) -> None:
    train_rows, eval_rows = rows(sizes["train"]), rows(sizes["eval"], offset=100)
    train = Stream(train_rows) if name == "iterable" else train_rows
    args = library.TrainingArguments(
        output_dir=str(out / name), use_cpu=True, report_to="none", disable_tqdm=True, seed=3, learning_rate=0.05,
        per_device_train_batch_size=sizes["batch"], per_device_eval_batch_size=sizes["batch"],
        gradient_accumulation_steps=sizes["accumulation"], num_train_epochs=sizes.get("epochs", 1),
        max_steps=sizes.get("max_steps", -1), data_seed=sizes.get("data_seed"), logging_steps=1, save_strategy="no",
        dataloader_pin_memory=False, accelerator_config=config,
    )  # fmt: skip
    recorder = SyncRecorder()
    model = Tiny()
    trainer = library.Trainer(model, args, train_dataset=train, callbacks=[recorder])
    recorder.trainer = trainer
    trainer.train()
    group_after_train = torch.distributed.is_initialized()
    result = {"seen": model.seen, "sync": recorder.events, "log_history": trainer.state.log_history,
              "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()}}  # fmt: skip
    if name == "iterable":
        result["eval_stream"] = trainer.evaluate(Stream(rows(11, offset=100)))
        # no labels: no losses; every one of the 11 predictions kept (issue 55)
        unlabelled = [{"x": row["x"]} for row in rows(11, offset=100)]
        result["predict_stream"] = trainer.predict(Stream(unlabelled)).predictions.tolist()
    if name == "configured_state":  # (not after "iterable": transformers' stopped stream is still accelerate's
        # active loader there, its last batch's remainder cutting every batch of an unprepared loader's gathers)
        own = rows(12, offset=200)[trainer.args.process_index :: 2]
        evaluated = trainer.get_eval_dataloader
        trainer.get_eval_dataloader = lambda eval_dataset=None: torch.utils.data.DataLoader(own, batch_size=2)
        result["eval_own_loader"] = trainer.evaluate()
        trainer.get_eval_dataloader = evaluated
        # an evaluation sampler giving each sample twice (TRL's GRPO and RLOO repeat each prompt): 7 samples are 14
        # rows, dealt in 4 global batches of 2 per rank, the last evened out; counted and cut as transformers
        # (issue 55: the losses were cut to the dataset's 7)
        trainer._get_eval_sampler = lambda dataset: [i for i in range(len(dataset)) for _ in range(2)]
        result["eval_repeated"] = trainer.evaluate(rows(7, offset=300))
        result["predict_repeated"] = trainer.predict(rows(7, offset=300)).predictions.tolist()
        del trainer._get_eval_sampler
    if eval_rows:
        result["eval"] = trainer.evaluate(eval_rows)
        predicted = trainer.predict(eval_rows)
        result["predictions"] = predicted.predictions.tolist()
    result["accelerator"] = {**surface(trainer, eval_rows), "group_after_train": group_after_train}
    rank = trainer.args.process_index
    (out / f"{name}_rank{rank}.json").write_text(json.dumps(result, default=str), encoding="utf-8")


def main() -> int:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    from accelerate.state import AcceleratorState, GradientState, PartialState

    environment = dict(os.environ)
    for name in names:
        os.environ.clear()
        os.environ.update(environment)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState(cpu=True)  # the state "configured_state" uses (made before any TrainingArguments)
        library = {"transformers": transformers, "hflight": hflight}[name]
        (out / name).mkdir(parents=True, exist_ok=True)
        for run, (config, sizes) in RUNS.items():
            run_one(library, run, json.loads(json.dumps(config)), sizes, out / name)
    if names[-1] == "transformers":  # transformers' side ends without the interpreter's teardown (tests/gloo_exit.py)
        gloo_exit.exit_without_teardown()
    torch.distributed.barrier()
    gc.collect()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
