"""TrainingArguments fields that changed nothing in hflight, or changed something else than in transformers (issue 24):
each run with transformers' real Trainer and with hflight's on the same model, data and arguments, and compared."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
import transformers

import hflight

PAIR = (
    ("hf", transformers.Trainer, transformers.TrainingArguments),
    ("hl", hflight.Trainer, hflight.TrainingArguments),
)


def _padded(factory, n=24, length=16, seed=0):
    """A classification set whose rows end in padding (attention mask 0) of varied lengths."""
    data = factory.cls_dataset(n, length, seed=seed)
    rng = np.random.default_rng(seed + 1)
    keep = rng.integers(4, length + 1, size=n)
    mask = [[1] * k + [0] * (length - k) for k in keep]
    ids = [row[:k] + [0] * (length - k) for row, k in zip(data["input_ids"], keep)]
    return (
        data.remove_columns(["input_ids", "attention_mask"])
        .add_column("input_ids", ids)
        .add_column("attention_mask", mask)
    )


def _train_both(tmp_path, factory, train=None, evaluation=None, **fields):
    trainers = {}
    for name, trainer_cls, args_cls in PAIR:
        args = args_cls(output_dir=str(tmp_path / name), **factory.pair_args(**fields))
        trainer = trainer_cls(
            factory.cls_model(), args, train_dataset=train or factory.cls_dataset(16), eval_dataset=evaluation
        )
        trainer.train()
        trainers[name] = trainer
    return trainers["hf"], trainers["hl"]


# ---- include_num_input_tokens_seen -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["all", "non_padding"])
def test_include_num_input_tokens_seen_logs_as_transformers(tmp_path, factory, mode):
    hf, hl = _train_both(tmp_path, factory, train=_padded(factory, 16), include_num_input_tokens_seen=mode)
    assert hl.state.num_input_tokens_seen == hf.state.num_input_tokens_seen > 0
    if mode == "non_padding":
        assert hf.state.num_input_tokens_seen < 16 * 16  # the padding was not counted
    assert len(hl.state.log_history) == len(hf.state.log_history)
    for theirs, ours in zip(hf.state.log_history, hl.state.log_history):
        assert sorted(ours) == sorted(theirs)  # num_input_tokens_seen, train_runtime, train_tokens_per_second
        assert ours["num_input_tokens_seen"] == theirs["num_input_tokens_seen"]
    assert "train_tokens_per_second" in hl.state.log_history[0]


def test_non_padding_token_count_without_mask_or_pad_token_warns_on_transformers_logger(tmp_path, factory):
    """No attention mask and no tokenizer: both trainers count every token and say so, per micro-batch, on
    ``transformers.trainer``'s logger (where a script's transformers logging settings apply)."""
    train = factory.cls_dataset(8).remove_columns(["attention_mask"])
    seen, warnings_of = {}, {}
    for name, trainer_cls, args_cls in PAIR:
        records = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        logging.getLogger("transformers.trainer").addHandler(handler)
        try:
            args = args_cls(
                output_dir=str(tmp_path / name), **factory.pair_args(include_num_input_tokens_seen="non_padding")
            )
            trainer = trainer_cls(factory.cls_model(), args, train_dataset=train)
            trainer.train()
        finally:
            logging.getLogger("transformers.trainer").removeHandler(handler)
        seen[name] = trainer.state.num_input_tokens_seen
        warnings_of[name] = [r for r in records if "count non-padding tokens" in r.getMessage()]
    assert seen["hl"] == seen["hf"] == 8 * 16
    assert len(warnings_of["hl"]) == len(warnings_of["hf"]) == 2  # 8 rows in micro-batches of 4


# ---- eval_do_concat_batches, skip_memory_metrics ---------------------------------------------------------------------
def test_eval_do_concat_batches_false_returns_per_batch_arrays_as_transformers(tmp_path, factory):
    seen = {}

    def metrics(prediction):  # what compute_metrics receives: lists of per-batch arrays
        key = "hl" if "hl" in seen else "hf"
        seen[key + "_types"] = (type(prediction.predictions), type(prediction.label_ids))
        return {"batches": len(prediction.predictions)}

    outputs = {}
    for name, trainer_cls, args_cls in PAIR:
        args = args_cls(output_dir=str(tmp_path / name), **factory.pair_args(eval_do_concat_batches=False))
        evaluation = factory.cls_dataset(20, seed=1)  # 8 + 8 + 4
        trainer = trainer_cls(factory.cls_model(), args, eval_dataset=evaluation, compute_metrics=metrics)
        seen[name] = True
        outputs[name] = (trainer.evaluate(), trainer.predict(evaluation))
    (hf_eval, hf_pred), (hl_eval, hl_pred) = outputs["hf"], outputs["hl"]
    assert seen["hl_types"] == seen["hf_types"] == (list, list)
    assert hl_eval["eval_batches"] == hf_eval["eval_batches"] == 3
    assert abs(hl_eval["eval_loss"] - hf_eval["eval_loss"]) <= 1e-6
    assert isinstance(hl_pred.predictions, list) and isinstance(hl_pred.label_ids, list)
    assert [p.shape for p in hl_pred.predictions] == [p.shape for p in hf_pred.predictions]
    for ours, theirs in zip(hl_pred.predictions, hf_pred.predictions):
        np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)
    for ours, theirs in zip(hl_pred.label_ids, hf_pred.label_ids):
        np.testing.assert_array_equal(ours, theirs)


def test_skip_memory_metrics_false_reports_transformers_memory_metrics(tmp_path, factory):
    pytest.importorskip("psutil")  # transformers' tracker measures nothing without it
    evaluation = factory.cls_dataset(8, seed=1)
    hf, hl = _train_both(tmp_path, factory, factory.cls_dataset(8), evaluation, skip_memory_metrics=False)
    train_keys = {name: sorted(t.state.log_history[-1]) for name, t in (("hf", hf), ("hl", hl))}
    assert train_keys["hl"] == train_keys["hf"]
    assert {"init_mem_cpu_alloc_delta", "train_mem_cpu_peaked_delta", "before_init_mem_cpu"} <= set(train_keys["hl"])
    assert isinstance(hl.state.log_history[-1]["train_mem_cpu_alloc_delta"], int)
    eval_keys = [sorted(t.evaluate()) for t in (hf, hl)]
    assert eval_keys[1] == eval_keys[0] and "eval_mem_cpu_alloc_delta" in eval_keys[1]
    pred_keys = [sorted(t.predict(factory.cls_dataset(8, seed=1)).metrics) for t in (hf, hl)]
    assert pred_keys[1] == pred_keys[0] and "test_mem_cpu_peaked_delta" in pred_keys[1]


# ---- group_by_length -------------------------------------------------------------------------------------------------
def _ragged(factory, n, seed):
    """Rows of 4..16 tokens (no padding stored): lengths differ, so length grouping changes the batches."""
    data = factory.cls_dataset(n, 16, seed=seed)
    keep = np.random.default_rng(seed + 7).integers(4, 17, size=n)
    ids = [row[:k] for row, k in zip(data["input_ids"], keep)]
    return data.remove_columns(["input_ids", "attention_mask"]).add_column("input_ids", ids)


def _pad(rows):
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([r["labels"] for r in rows])}


def test_group_by_length_batches_and_prediction_order_as_transformers(tmp_path, factory):
    """The training sampler draws from torch's global generator (hflight seeded its own, so batches and losses
    differed); evaluation and test loaders are length-grouped too (transformers 5.23), predictions in that order."""
    train, evaluation = _ragged(factory, 24, 0), _ragged(factory, 20, 1)
    fields = dict(train_sampling_strategy="group_by_length", num_train_epochs=2, per_device_eval_batch_size=4)
    runs = {}
    for name, trainer_cls, args_cls in PAIR:
        args = args_cls(output_dir=str(tmp_path / name), **factory.pair_args(**fields))
        trainer = trainer_cls(
            factory.cls_model(), args, data_collator=_pad, train_dataset=train, eval_dataset=evaluation
        )
        trainer.train()
        runs[name] = trainer, trainer.predict(evaluation)
    (hf, hf_pred), (hl, hl_pred) = runs["hf"], runs["hl"]
    hf_losses = [e["loss"] for e in hf.state.log_history if "loss" in e]
    hl_losses = [e["loss"] for e in hl.state.log_history if "loss" in e]
    assert len(hl_losses) == len(hf_losses) == 12
    np.testing.assert_allclose(hl_losses, hf_losses, rtol=1e-5)
    np.testing.assert_array_equal(hl_pred.label_ids, hf_pred.label_ids)  # the length-grouped order
    assert list(hl_pred.label_ids) != list(evaluation["labels"])  # not the dataset's order
    np.testing.assert_allclose(hl_pred.predictions, hf_pred.predictions, atol=1e-5, rtol=0)


# ---- log_level="info": the messages of a checkpoint save -------------------------------------------------------------
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_log_level_info_names_the_checkpoint_folder_as_transformers(tmp_path, factory):
    """transformers' "Model weights saved in .../checkpoint-2/..." lines: hflight named its temporary folder."""
    saved = {}
    for name, trainer_cls, args_cls in PAIR:
        out = tmp_path / name
        fields = factory.pair_args(log_level="info", save_strategy="steps", save_steps=2, max_steps=2)
        trainer = trainer_cls(
            factory.cls_model(), args_cls(output_dir=str(out), **fields), train_dataset=factory.cls_dataset(8)
        )
        handler = _Lines()
        logging.getLogger("transformers").addHandler(handler)
        try:
            trainer.train()
        finally:
            logging.getLogger("transformers").removeHandler(handler)
            transformers.logging.set_verbosity_warning()
        saved[name] = sorted(line.replace(str(out), "OUT") for line in handler.lines if " saved in " in line)
    assert any("Model weights saved in OUT/checkpoint-2/model.safetensors" in line for line in saved["hf"])
    assert saved["hl"] == saved["hf"]


# ---- resuming: the arguments' resume_from_checkpoint, transformers' warning -----------------------------------------
def _checkpointed(tmp_path, factory):
    """Each trainer's own checkpoint-2 (save_steps=2), for the resume tests."""
    folders = {}
    for name, trainer_cls, args_cls in PAIR:
        fields = factory.pair_args(save_strategy="steps", save_steps=2, max_steps=2)
        args = args_cls(output_dir=str(tmp_path / f"first-{name}"), **fields)
        trainer_cls(factory.cls_model(), args, train_dataset=factory.cls_dataset(16)).train()
        folders[name] = str(tmp_path / f"first-{name}" / "checkpoint-2")
    return folders


def test_resume_as_transformers_args_field_unread_and_changed_arguments_warned(tmp_path, factory):
    """``args.resume_from_checkpoint`` is for scripts: ``train()`` without the argument starts from step 0 in both;
    resuming with other logging/saving steps logs transformers' warning, in its words."""
    folders = _checkpointed(tmp_path, factory)
    steps, warnings = {}, {}
    for name, trainer_cls, args_cls in PAIR:
        fields = factory.pair_args(max_steps=3, resume_from_checkpoint=folders[name])
        trainer = trainer_cls(factory.cls_model(), args_cls(output_dir=str(tmp_path / name), **fields),
                              train_dataset=factory.cls_dataset(16))  # fmt: skip
        trainer.train()
        steps[name] = [e["step"] for e in trainer.state.log_history if "loss" in e]

        fields = factory.pair_args(max_steps=3, save_strategy="steps", save_steps=3)
        args = args_cls(output_dir=str(tmp_path / f"resumed-{name}"), **fields)
        trainer = trainer_cls(factory.cls_model(), args, train_dataset=factory.cls_dataset(16))
        handler = _Lines()
        logging.getLogger("transformers").addHandler(handler)
        logging.Logger.warning_once.cache_clear()  # transformers warns once per process and message
        try:
            trainer.train(resume_from_checkpoint=folders[name])
        finally:
            logging.getLogger("transformers").removeHandler(handler)
        warnings[name] = [line for line in handler.lines if "(from trainer_state.json)" in line]
    assert steps["hl"] == steps["hf"] == [1, 2, 3]
    assert warnings["hl"] == warnings["hf"] != []
    assert "save_steps: 3 (from args) != 2 (from trainer_state.json)" in warnings["hl"][0]


# ---- full_determinism, fp16 on the CPU ------------------------------------------------------------------------------
@pytest.fixture
def restored_determinism(monkeypatch):
    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "FLASH_ATTENTION_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def test_full_determinism_environment_as_transformers(tmp_path, factory, restored_determinism):
    watched = ("CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "FLASH_ATTENTION_DETERMINISTIC")
    seen = {}
    for name, trainer_cls, args_cls in PAIR:
        args = args_cls(output_dir=str(tmp_path / name), **factory.pair_args(full_determinism=True, max_steps=1))
        trainer_cls(factory.cls_model(), args, train_dataset=factory.cls_dataset(8)).train()
        seen[name] = [os.environ.get(v) for v in watched] + [torch.are_deterministic_algorithms_enabled()]
    assert seen["hl"] == seen["hf"]
    assert seen["hl"][0] == ":16:8"


def test_fp16_on_cpu_runs_as_transformers(tmp_path, factory):
    """transformers (accelerate) enables neither fp16 autocast nor a gradient scaler on the CPU: its fp16 run is its
    fp32 run; Lightning would run bf16-mixed (grad norms differed by up to 1.3e-3). The two runs are identical: every
    logged value (timings aside) and every weight, bit for bit."""
    hf, hl = _train_both(tmp_path, factory, fp16=True, use_cpu=True)
    assert len(hl.state.log_history) == len(hf.state.log_history) > 1
    timings = ("runtime", "per_second")
    for theirs, ours in zip(hf.state.log_history, hl.state.log_history, strict=True):
        assert ours.keys() == theirs.keys()
        assert {k: v for k, v in ours.items() if not k.endswith(timings)} == {
            k: v for k, v in theirs.items() if not k.endswith(timings)
        }
    weights = hf.model.state_dict()
    assert all(torch.equal(value, weights[key]) for key, value in hl.model.state_dict().items())
    assert hl.lightning_trainer.precision == "32-true"


def test_bf16_on_cpu_is_transformers_bit_for_bit(tmp_path, factory):
    """``bf16=True, use_cpu=True``: autocast spans the forward only, the backward runs outside it, as accelerate
    arranges it. Lightning's precision context spans the whole training_step, and the autograd engine carries the
    caller's autocast state into the backward pass: with hflight's backward inside it, a 3-layer BERT with dropout
    differed by up to 1.3e-3 in grad norm and 3.9e-3 in 52 of 52 prediction rows (AMD EPYC with AVX512_BF16)."""
    import numpy as np
    from transformers import BertForQuestionAnswering

    seen = {}
    for name, trainer_cls, args_cls in PAIR:
        fields = factory.pair_args(bf16=True, use_cpu=True, num_train_epochs=2, train_sampling_strategy="random")
        args = args_cls(output_dir=str(tmp_path / name), **fields)
        torch.manual_seed(0)
        model = BertForQuestionAnswering(
            factory.config(0.1, hidden_size=64, intermediate_size=128, num_hidden_layers=3)
        )
        trainer = trainer_cls(model, args, train_dataset=factory.qa_dataset(40))
        trainer.train()
        history = [{k: v for k, v in e.items() if not k.endswith(("runtime", "per_second"))}
                   for e in trainer.state.log_history]  # fmt: skip
        seen[name] = history, trainer.predict(factory.qa_dataset(26, seed=1)).predictions
    assert seen["hl"][0] == seen["hf"][0] and sum("grad_norm" in e for e in seen["hf"][0]) == 20
    for ours, theirs in zip(seen["hl"][1], seen["hf"][1], strict=True):
        np.testing.assert_array_equal(ours, theirs)


# ---- a model that resizes a buffer when it loads ---------------------------------------------------------------------
class _Order(torch.utils.data.Dataset):
    def __init__(self, size=10):
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randn((size, 10), generator=generator)
        self.data[:, 0] = torch.arange(size)
        self.labels = torch.randint(0, 10, (size,), generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.labels[i]}


class _Recording(torch.nn.Module):
    """Records the rows it saw in a buffer that grows (empty at construction): only its own loading can take a
    checkpoint's buffer, by resizing it first."""

    adapts = True

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(10, 10, bias=False)
        self.register_buffer("seen", torch.empty(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        if self.adapts and "seen" in state_dict and state_dict["seen"].shape != self.seen.shape:
            self.seen = state_dict["seen"].clone()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, input_ids, labels=None):
        logits = self.fc(input_ids)
        self.seen = torch.cat([self.seen, input_ids[:, 0].long()])
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_a_model_that_resizes_its_buffer_resumes_as_with_transformers(tmp_path, factory):
    """transformers' test_resume_batch_order: the buffer is [0] at construction and [12] in checkpoint-6; the
    model's own loading takes it, so the run resumes (hflight's shape check refused it); a model whose loading does
    not adapt is still refused before anything changes."""
    fields = dict(per_device_train_batch_size=2, num_train_epochs=3, optim="sgd", learning_rate=0.1, seed=42,
                  save_strategy="steps", save_steps=1, logging_steps=1, report_to="none", disable_tqdm=True,
                  save_only_model=False)  # fmt: skip
    seen = {}
    for name, trainer_cls, args_cls in PAIR:
        trainer_cls(_Recording(), args_cls(str(tmp_path / name), **fields), train_dataset=_Order()).train()
        resumed = trainer_cls(_Recording(), args_cls(str(tmp_path / f"{name}-r"), **fields), train_dataset=_Order())
        resumed.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-6"))
        seen[name] = resumed.model.seen.tolist()
        assert len(seen[name]) == 30
    assert seen["hl"] == seen["hf"]

    rigid = _Recording()
    rigid.adapts = False
    before = {k: v.clone() for k, v in rigid.state_dict().items()}
    trainer = hflight.Trainer(
        rigid, hflight.TrainingArguments(str(tmp_path / "rigid"), **fields), train_dataset=_Order()
    )
    with pytest.raises(ValueError, match=r"seen: \[12\] in the file, \[0\] in the model"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "hl" / "checkpoint-6"))
    assert all(torch.equal(v, before[k]) for k, v in rigid.state_dict().items())
