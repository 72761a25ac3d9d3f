"""Seq2Seq prediction with generation under Lightning's DDP on CPU (gloo), or in one process, for the
multi-process test of generated outputs.

    python tests/jobs/seq2seq_ddp_job.py OUT --devices 2     # two processes
    python tests/jobs/seq2seq_ddp_job.py OUT --devices 1     # one process
    python tests/jobs/seq2seq_ddp_job.py OUT --devices 2 --one-process-first OUT1   # one process, then two
    torchrun --nproc_per_node 2 tests/jobs/seq2seq_ddp_job.py OUT --library transformers   # transformers' own

An untrained tiny BART (tests/seq2seq_data.py) generates up to 12 new tokens for 11 examples in batches of 2 per
process, stopping at a frequent token, so generated lengths differ between batches and between processes, and the
last global batch is padded with a repeat. predict() is the first call: under DDP it is the call that launches the
processes. Rank 0 writes ``OUT/result.json`` (predictions, labels, metrics). With ``--one-process-first OUT1`` the
launching process predicts in one process first (into ``OUT1``), before its DDP trainer launches the other rank: one
Python process fewer than a job of its own.
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402
import gloo_exit  # noqa: E402
import seq2seq_data  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DataCollatorForSeq2Seq  # noqa: E402

import hflight  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--library", choices=["hflight", "transformers"], default="hflight")
    parser.add_argument("--one-process-first", metavar="OUT1")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if opts.one_process_first and "LOCAL_RANK" not in os.environ:  # the launching process, before the launch
        predict(opts.one_process_first, 1, "hflight")
    predict(opts.out, opts.devices, opts.library)
    return 0


def predict(out, devices, library_name):
    tokenizer = seq2seq_data.tokenizer(Path(out) / f"tokenizer-{os.environ.get('LOCAL_RANK', '0')}")
    records = seq2seq_data.summarization_records(11, seed=5)
    sources = tokenizer([r["text"] for r in records], max_length=32, truncation=True)
    targets = tokenizer(text_target=[r["summary"] for r in records], max_length=12, truncation=True)
    data = datasets.Dataset.from_dict({"input_ids": sources["input_ids"], "attention_mask": sources["attention_mask"],
                                       "labels": targets["input_ids"]})  # fmt: skip
    model = seq2seq_data.bart_model(len(tokenizer), dropout=0.0)
    model.generation_config.max_length = 2  # nothing padded to the model's length: batches keep their own lengths
    library = {"hflight": hflight, "transformers": transformers}[library_name]
    Seq2SeqTrainer = library.Seq2SeqTrainer  # noqa: N806
    if library_name == "hflight":  # Lightning launches the processes
        where = {"accelerator": "cpu", "devices": devices, "strategy": "ddp" if devices > 1 else "auto"}
    else:  # torchrun launched them
        where = {"use_cpu": True, "ddp_backend": "gloo"}
    args = library.Seq2SeqTrainingArguments(
        output_dir=str(out), per_device_eval_batch_size=2, predict_with_generate=True, report_to="none",
        disable_tqdm=True, **where,
    )  # fmt: skip

    def compute_metrics(prediction):
        return {"generated": int((prediction.predictions != -100).sum()), "rows": len(prediction.predictions)}

    trainer = Seq2SeqTrainer(
        model=model, args=args, processing_class=tokenizer, compute_metrics=compute_metrics,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
    )  # fmt: skip
    # the token the untrained model generates most for the first example: as EOS it ends some generations early
    with torch.no_grad():
        probe = model.generate(torch.tensor(data[:1]["input_ids"]), max_new_tokens=12)[0, 1:].tolist()
    prediction = trainer.predict(data, max_new_tokens=12, eos_token_id=max(set(probe), key=probe.count))
    if trainer.is_world_process_zero():
        result = {
            "world_size": trainer.lightning_trainer.world_size
            if library_name == "hflight"
            else trainer.args.world_size,
            "predictions": prediction.predictions.tolist(),
            "label_ids": prediction.label_ids.tolist(),
            "metrics": prediction.metrics,
        }
        (Path(out) / "result.json").write_text(json.dumps(result))
    if library_name == "transformers" and torch.distributed.is_initialized():
        gloo_exit.exit_without_teardown()  # rank 0 has written result.json


if __name__ == "__main__":
    sys.exit(main())
