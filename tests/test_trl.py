"""TRL's trainers on hflight (``hflight.trl``, issue 47, items 3 and 4), one process: each trainer run with TRL on
transformers and with the one import changed, same seed, compared step for step on everything TRL logs (losses,
gradient norms, ``num_tokens``, ``mean_token_accuracy``, rewards, margins, log-probabilities; times apart), and the
trained weights; SFT on plain text, on conversations with a chat template, with packing, with completion-only and
assistant-only loss and with a LoRA ``peft_config``; DPO, Reward, GRPO with a Python reward function, KTO, RLOO and
Distillation. A TRL config stays what it is, and what hflight's loop never calls refuses by name."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import transformers

from .tiny_lm import columns, conversations, gpt2, tokenizer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
hflight_trl = importlib.import_module("hflight.trl")  # once TRL is there, hflight's module must import

#: the logged values that are times, not results (train_runtime, eval_samples_per_second, ...)
TIMES = ("step_time", "_runtime", "_per_second")


def reward_length(completions, **kwargs) -> list[float]:
    """GRPO's and RLOO's reward: longer completions score higher."""
    return [len(completion.split()) / 10 for completion in completions]


@dataclasses.dataclass
class Fresh:
    """An input each run builds anew (a model, a tokenizer), so that both libraries start from the same state."""

    make: object

    def __call__(self):
        return self.make()


COMMON = dict(per_device_train_batch_size=4, max_steps=4, logging_steps=1, learning_rate=1e-3, seed=0,
              report_to="none", disable_tqdm=True, bf16=False)  # fmt: skip


def compare(tmp_path, name: str, config: dict, **trainer_inputs) -> dict[str, list[dict]]:
    """``name`` (e.g. "SFT") with TRL on transformers and with hflight.trl, ``config`` beside :data:`COMMON`; every
    logged value but the times must be the same, step for step, and so must the trained weights. Returns the logs."""
    runs = {}
    for library, module in (("trl", trl), ("hflight", hflight_trl)):
        trainer_cls = getattr(module, f"{name}Trainer")
        args = getattr(trl, f"{name}Config")(str(tmp_path / library), **{**COMMON, **config})
        inputs = {key: value() if isinstance(value, Fresh) else value for key, value in trainer_inputs.items()}
        trainer = trainer_cls(args=args, **inputs)
        trainer.train()
        logs = [{k: v for k, v in entry.items() if not k.endswith(TIMES)} for entry in trainer.state.log_history]
        weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
        runs[library] = logs, weights, trainer
    (theirs, their_weights, _), (ours, our_weights, trainer) = runs["trl"], runs["hflight"]
    assert isinstance(trainer, getattr(trl, f"{name}Trainer")) and isinstance(trainer, transformers.Trainer)
    assert isinstance(trainer.args, getattr(trl, f"{name}Config"))
    steps = {**COMMON, **config}["max_steps"]
    assert len([e for e in ours if "loss" in e]) == (steps if steps > 0 else len(theirs) - 1) > 0 and ours == theirs
    assert their_weights.keys() == our_weights.keys() and their_weights
    assert all(torch.equal(our_weights[k], their_weights[k]) for k in their_weights)
    return {"trl": theirs, "hflight": ours}


def sft_inputs(dataset) -> dict:
    return dict(model=Fresh(gpt2), train_dataset=dataset, processing_class=Fresh(tokenizer))


def test_sft_on_plain_text(tmp_path):
    logs = compare(tmp_path, "SFT", {}, **sft_inputs(columns(64, text=(5, 20))))
    assert {"num_tokens", "mean_token_accuracy", "entropy"} <= logs["hflight"][0].keys()


def test_sft_on_conversations_with_a_chat_template(tmp_path):
    compare(tmp_path, "SFT", {}, **sft_inputs(conversations(64)))


def test_sft_with_packing(tmp_path):
    """Packed sequences, a whole epoch: its last batch is short, where TRL gathers a 0-d token count for its metrics
    (accelerate keeps what it cannot cut to the batch's remainder)."""
    data = columns(56, text=(5, 20))  # 25 packed sequences: the last batch holds 1
    logs = compare(tmp_path, "SFT", dict(packing=True, max_length=32, max_steps=-1, num_train_epochs=1),
                   **sft_inputs(data))  # fmt: skip
    assert len(logs["hflight"]) == 8  # 7 steps and the summary


def test_sft_with_completion_only_loss(tmp_path):
    compare(tmp_path, "SFT", dict(completion_only_loss=True),
            **sft_inputs(columns(64, prompt=(3, 8), completion=(3, 8))))  # fmt: skip


def test_sft_with_assistant_only_loss(tmp_path):
    compare(tmp_path, "SFT", dict(assistant_only_loss=True), **sft_inputs(conversations(64)))


def test_sft_with_a_lora_peft_config(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM")
    compare(tmp_path, "SFT", {}, peft_config=lora, **sft_inputs(columns(64, text=(5, 20))))


def test_dpo(tmp_path):
    logs = compare(tmp_path, "DPO", {}, model=Fresh(gpt2), ref_model=Fresh(gpt2), processing_class=Fresh(tokenizer),
                   train_dataset=columns(32, prompt=(3, 10), chosen=(3, 10), rejected=(3, 10)))  # fmt: skip
    assert {"rewards/chosen", "rewards/margins", "logps/chosen"} <= logs["hflight"][-2].keys()


def test_reward(tmp_path):
    scorer = Fresh(lambda: gpt2(head=transformers.GPT2ForSequenceClassification, num_labels=1))
    logs = compare(tmp_path, "Reward", {}, model=scorer, processing_class=Fresh(tokenizer),
                   train_dataset=columns(32, chosen=(3, 10), rejected=(3, 10)))  # fmt: skip
    assert {"accuracy", "margin"} <= logs["hflight"][0].keys()


def test_reward_of_a_float16_model_under_bf16_autocast(tmp_path):
    """TRL's configs default to ``bf16=True``; a float16 model so trained on the CPU clips and steps its float16
    gradients outside autocast, as transformers does (TRL's ``test_train_model_dtype``; under Lightning's autocast the
    clipping raised). Its weights stay float16 and move, and every step's loss, gradient norm, rewards, accuracy and
    margin are TRL's on transformers: autocast covers the model's forward only and its outputs come back float32, as
    accelerate's, so TRL's ``-logsigmoid(chosen - rejected)`` runs in float32 (under Lightning's step-wide autocast it
    ran in bfloat16: step-1 loss 0.69921875 against 0.69878042)."""

    def scorer() -> torch.nn.Module:  # a Qwen2 (RMSNorm: GPT-2's LayerNorm refuses float16 weights under autocast)
        torch.manual_seed(0)
        sizes = dict(vocab_size=64, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
        config = transformers.Qwen2Config(**sizes, intermediate_size=32, pad_token_id=61, num_labels=1)
        return transformers.Qwen2ForSequenceClassification(config).half()

    runs = {}
    for library, module in (("trl", trl), ("hflight", hflight_trl)):
        args = trl.RewardConfig(str(tmp_path / library), **{**COMMON, "bf16": True, "use_cpu": True})
        trainer = module.RewardTrainer(model=scorer(), args=args, processing_class=tokenizer(),
                                       train_dataset=columns(32, chosen=(3, 10), rejected=(3, 10)))  # fmt: skip
        trainer.train()
        runs[library] = trainer
    before = scorer()
    for trainer in runs.values():
        weights = dict(trainer.model.named_parameters())
        assert {p.dtype for p in weights.values()} == {torch.float16}
        assert not torch.equal(weights["score.weight"], before.score.weight)
    logs = {library: [e for e in t.state.log_history if "loss" in e] for library, t in runs.items()}
    assert len(logs["hflight"]) == len(logs["trl"]) == 4
    assert logs["hflight"] == logs["trl"]


def test_grpo_with_a_python_reward_function(tmp_path):
    """GRPO generates inside the training loop with transformers' generate (vLLM is not available here)."""
    logs = compare(tmp_path, "GRPO", dict(num_generations=4, max_completion_length=8), model=Fresh(gpt2),
                   reward_funcs=reward_length, processing_class=Fresh(tokenizer),
                   train_dataset=columns(32, prompt=(3, 8)))  # fmt: skip
    assert {"reward", "reward_std", "completions/mean_length"} <= logs["hflight"][0].keys()


def test_grpo_evaluates_an_iterable_eval_set_given_to_evaluate(tmp_path):
    """GRPO's ``get_eval_dataloader`` turns ``trainer.accelerator.dataloader_config.dispatch_batches`` off for an
    iterable eval set (TRL's ``test_evaluate_with_eval_dataset[iterable_dataset]``): set for the loaders prepared after
    it, the arguments' ``accelerator_config`` left as it is, as accelerate's copy; the metrics are TRL's."""
    results = {}
    for library, module in (("trl", trl), ("hflight", hflight_trl)):
        args = trl.GRPOConfig(str(tmp_path / library), **{**COMMON, "num_generations": 4, "max_completion_length": 8,
                                                          "per_device_eval_batch_size": 4})  # fmt: skip
        trainer = module.GRPOTrainer(model=gpt2(), reward_funcs=reward_length, args=args, processing_class=tokenizer(),
                                     train_dataset=columns(8, prompt=(3, 8)))  # fmt: skip
        metrics = trainer.evaluate(eval_dataset=columns(8, prompt=(3, 8), seed=1).to_iterable_dataset())
        settings = (trainer.accelerator.dataloader_config.dispatch_batches, args.accelerator_config.dispatch_batches)
        results[library] = {k: v for k, v in metrics.items() if not k.endswith((*TIMES, "_time"))}, settings
    assert results["hflight"] == results["trl"] and results["hflight"][1] == (False, None)
    assert {"eval_reward", "eval_completions/mean_length"} <= results["hflight"][0].keys()


def test_kto(tmp_path):
    data = columns(32, prompt=(3, 8), completion=(3, 8)).add_column("label", [i % 2 == 0 for i in range(32)])
    compare(tmp_path, "KTO", {}, model=Fresh(gpt2), ref_model=Fresh(gpt2), processing_class=Fresh(tokenizer),
            train_dataset=data)  # fmt: skip


def test_rloo_with_a_python_reward_function(tmp_path):
    """RLOO builds its reference model from the policy's folder, as from a hub name."""
    gpt2().save_pretrained(tmp_path / "policy")
    compare(tmp_path, "RLOO", dict(num_generations=4, max_completion_length=8), model=str(tmp_path / "policy"),
            reward_funcs=reward_length, processing_class=Fresh(tokenizer),
            train_dataset=columns(32, prompt=(3, 8)))  # fmt: skip


def test_distillation(tmp_path):
    compare(tmp_path, "Distillation", dict(max_completion_length=8), model=Fresh(gpt2),
            teacher_model=Fresh(lambda: gpt2(seed=1)), processing_class=Fresh(tokenizer),
            train_dataset=columns(32, prompt=(3, 8), completion=(3, 8)))  # fmt: skip


#: each config's own fields (none of transformers' TrainingArguments) set away from their defaults
TRL_ONLY = {
    "DistillationConfig": dict(max_completion_length=8, temperature=0.7),
    "DPOConfig": dict(max_length=77, precompute_ref_log_probs=True),
    "GRPOConfig": dict(num_generations=4, max_completion_length=8),
    "KTOConfig": dict(max_length=77, beta=0.2),
    "RewardConfig": dict(max_length=77, center_rewards_coefficient=0.01),
    "RLOOConfig": dict(num_generations=4, max_completion_length=8),
    "SFTConfig": dict(max_length=77, packing=True, dataset_text_field="prompt"),
}


@pytest.mark.parametrize("name", hflight_trl.CONFIGS)
def test_a_trl_config_given_to_hflight_is_its_twin_field_for_field(tmp_path, name):
    """TRL's own fields (``max_length``, ``packing``, ``num_generations``, ...) set away from their defaults, and
    transformers' too, are all on the trainer's arguments."""
    import hflight

    defaults, given = {f.name: f.default for f in dataclasses.fields(getattr(trl, name))}, TRL_ONLY[name]
    assert not set(given) & {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert all(defaults[field] != value for field, value in given.items())
    theirs = getattr(trl, name)(str(tmp_path), bf16=False, report_to="none", logging_steps=3, warmup_steps=0.1,
                                **given)  # fmt: skip
    ours = hflight.Trainer(model=gpt2(), args=theirs).args
    assert type(ours) is getattr(hflight_trl, name) and isinstance(ours, type(theirs))
    differing = [f.name for f in dataclasses.fields(theirs) if getattr(ours, f.name) != getattr(theirs, f.name)]
    assert differing == [] and {field: getattr(ours, field) for field in given} == given


def test_a_subclass_of_a_trl_config_stays_one(tmp_path):
    """A script's own subclass of ``trl.SFTConfig`` (a field and a method of its own) given to a trainer of
    hflight.trl: the trainer's arguments are still an instance of it, and of TRL's config, every field kept."""

    @dataclasses.dataclass
    class MySFTConfig(trl.SFTConfig):
        prompt_style: str = "plain"

        def styled(self) -> str:
            return f"{self.prompt_style}/{self.max_length}"

    args = MySFTConfig(str(tmp_path), prompt_style="chat", max_length=48, **COMMON)
    trainer = hflight_trl.SFTTrainer(args=args, model=gpt2(), processing_class=tokenizer(),
                                     train_dataset=columns(8, text=(5, 9)))  # fmt: skip
    assert isinstance(trainer.args, MySFTConfig) and isinstance(trainer.args, trl.SFTConfig)
    assert isinstance(trainer.args, hflight_trl.SFTConfig) and trainer.args.styled() == "chat/48"
    differing = [f.name for f in dataclasses.fields(args) if getattr(trainer.args, f.name) != getattr(args, f.name)]
    assert differing == []


@pytest.mark.parametrize("given", [True, False, "batch"])
def test_grpo_s_scale_rewards_takes_trl_s_booleans(tmp_path, given):
    """GRPO's ``scale_rewards`` is annotated ``str`` and takes True/False for "group"/"none" (TRL's
    ``test_train_scale_rewards[True]``/``[False]``, refused by hflight's type check before): as TRL's config."""
    theirs = trl.GRPOConfig(str(tmp_path), bf16=False, report_to="none", scale_rewards=given)
    ours = hflight_trl.GRPOConfig(str(tmp_path), bf16=False, report_to="none", scale_rewards=given)
    assert ours.scale_rewards == theirs.scale_rewards == {True: "group", False: "none"}.get(given, given)


def test_what_hflight_never_calls_refuses_by_name(tmp_path):
    """A method of transformers' Trainer that hflight's loop never calls raises when TRL's code (or a script) calls
    it, and a TRL trainer's subclass that overrides one is refused when it is built."""
    trainer = hflight_trl.SFTTrainer(args=trl.SFTConfig(str(tmp_path), **COMMON), model=gpt2(),
                                     processing_class=tokenizer(), train_dataset=columns(8, text=(5, 9)))  # fmt: skip
    refused = r"SFTTrainer\._inner_training_loop: transformers\.Trainer\._inner_training_loop is not part of hflight's"
    with pytest.raises(NotImplementedError, match=refused):
        trainer._inner_training_loop()
    custom = type("MySFT", (hflight_trl.SFTTrainer,), {"_save_rng_state": lambda self, output_dir: None})
    with pytest.raises(TypeError, match=r"MySFT\._save_rng_state overrides transformers\.Trainer\._save_rng_state"):
        custom(args=trl.SFTConfig(str(tmp_path), **COMMON), model=gpt2(), processing_class=tokenizer(),
               train_dataset=columns(8, text=(5, 9)))  # fmt: skip


def test_sft_evaluated_during_training_logs_trl_s_evaluation_metrics(tmp_path):
    """Evaluation every 2 steps: TRL logs its evaluation metrics (``eval_mean_token_accuracy``, ``eval_entropy``,
    ``eval_num_tokens``) from its evaluation mode, known by the model's mode when it logs, as on transformers."""
    logs = compare(tmp_path, "SFT", dict(eval_strategy="steps", eval_steps=2),
                   eval_dataset=columns(16, text=(5, 20), seed=1), **sft_inputs(columns(64, text=(5, 20))))  # fmt: skip
    evaluations = [e for e in logs["hflight"] if "eval_loss" in e]
    assert len(evaluations) == 2 and {"eval_mean_token_accuracy", "eval_entropy"} <= evaluations[0].keys()


def test_hflight_s_training_arguments_become_the_trainer_s_config_with_hflight_s_fields(tmp_path):
    """TRL makes an SFTConfig of transformers' TrainingArguments; hflight's (with Lightning's fields set) become
    hflight.trl's SFTConfig, those fields kept, and train as TRL's own conversion of transformers' arguments does."""
    import hflight

    runs = {}
    for library, args in (
        ("trl", transformers.TrainingArguments(str(tmp_path / "trl"), **{**COMMON, "bf16": False})),
        ("hflight", hflight.TrainingArguments(str(tmp_path / "hflight"), accelerator="cpu", devices=1, **COMMON)),
    ):
        trainer_cls = trl.SFTTrainer if library == "trl" else hflight_trl.SFTTrainer
        trainer = trainer_cls(args=args, model=gpt2(), processing_class=tokenizer(),
                              train_dataset=columns(32, text=(5, 20)))  # fmt: skip
        trainer.train()
        runs[library] = trainer
    ours = runs["hflight"].args
    assert isinstance(ours, trl.SFTConfig) and (ours.accelerator, ours.devices) == ("cpu", 1)
    logs = [[{k: v for k, v in e.items() if not k.endswith(TIMES)} for e in t.state.log_history] for t in runs.values()]
    assert logs[0] == logs[1]
