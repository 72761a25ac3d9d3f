"""A run's host memory with and without save_async (issue 67, item 1): ``python save_async_memory.py OUT none|async``
trains a BERT of ~31 MB of parameters (94 MiB of state with Adam's moments) for 8 steps, a checkpoint every 2 with
``async``, and prints JSON: the state's bytes, the resident memory after the first step (the optimizer's state made)
and the process's peak (VmHWM)."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback  # noqa: E402

import hflight  # noqa: E402


def status(key: str) -> int:
    with open("/proc/self/status") as file:
        return next(int(line.split()[1]) * 1024 for line in file if line.startswith(key))


class AfterFirstStep(TrainerCallback):
    resident = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.resident = status("VmRSS")


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30000, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=32, num_labels=2)  # fmt: skip
    model = BertForSequenceClassification(config)
    data = datasets.Dataset.from_dict({"input_ids": [[5] * 16] * 64, "attention_mask": [[1] * 16] * 64,
                                       "labels": [0, 1] * 32})  # fmt: skip
    saving = {"save_async": True, "save_steps": 2} if mode == "async" else {"save_strategy": "no"}
    args = hflight.TrainingArguments(output_dir=out, max_steps=8, per_device_train_batch_size=4, report_to="none",
                                     disable_tqdm=True, use_cpu=True, logging_steps=100, **saving)  # fmt: skip
    first = AfterFirstStep()
    hflight.Trainer(model, args, train_dataset=data, callbacks=[first]).train()
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights and Adam's two moments
    print(json.dumps({"state": state, "after_first": first.resident, "peak": status("VmHWM")}))


if __name__ == "__main__":
    main()
