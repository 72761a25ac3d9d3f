"""Tiny causal language models and text data built locally (a support module: tests/test_trl.py, tests/test_peft.py
and tests/jobs/finetune_job.py use it): a word-level tokenizer with a chat template, GPT-2s of 2 layers, LoRA on them,
and datasets of random words."""

from __future__ import annotations

import random

import torch
import transformers

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} "
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<eos>{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %} {% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of 57 words, the chat roles and four special tokens, with a chat template that marks
    the assistant's turns (for ``assistant_only_loss``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(57)} | {"user": 57, "assistant": 58, "system": 59}
    vocab |= {"[UNK]": 60, "[PAD]": 61, "<eos>": 62, "<bos>": 63}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    made = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="<eos>", bos_token="<bos>")  # fmt: skip
    made.chat_template = CHAT_TEMPLATE
    return made


def gpt2(seed: int = 0, head=transformers.GPT2LMHeadModel, **config) -> torch.nn.Module:
    """A 2-layer GPT-2 over :func:`tokenizer`'s 64 ids, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return head(transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                        bos_token_id=63, eos_token_id=62, pad_token_id=61, **config))  # fmt: skip


def lora(model: torch.nn.Module, r: int = 4) -> torch.nn.Module:
    """``model`` with a LoRA adapter on its attention."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=["c_attn"], task_type="CAUSAL_LM"))


def text(rng: random.Random, shortest: int, longest: int) -> str:
    return " ".join(f"w{rng.randrange(57)}" for _ in range(rng.randrange(shortest, longest)))


def columns(n: int, seed: int = 0, **lengths: tuple[int, int]):
    """A dataset of ``n`` rows, each column a text of random words of (shortest, longest) length."""
    import datasets

    rng = random.Random(seed)
    return datasets.Dataset.from_dict({name: [text(rng, *span) for _ in range(n)] for name, span in lengths.items()})


def conversations(n: int, seed: int = 0):
    """``n`` conversations of a user's turn and the assistant's (``messages``)."""
    import datasets

    rng = random.Random(seed)
    turns = [[{"role": "user", "content": text(rng, 3, 8)}, {"role": "assistant", "content": text(rng, 3, 8)}]
             for _ in range(n)]  # fmt: skip
    return datasets.Dataset.from_dict({"messages": turns})


def token_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of 16 random ids, their own labels (a causal LM's training set without a tokenizer)."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": row, "labels": row} for row in torch.randint(0, 57, (n, 16), generator=generator)]
