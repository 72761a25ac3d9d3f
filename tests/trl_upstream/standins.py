"""Local stand-ins for the hub repositories TRL's unit tests load (``trl-internal-testing/*``), built here with this
project's own code, nothing downloaded: tiny models from configs in a hub cache folder (found offline through
``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1``), a byte-level BPE tokenizer trained on local text, and the ``zen`` data set's
configurations as parquet files that :mod:`tests.trl_upstream.plugin` serves to ``datasets.load_dataset``."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

ORG = "trl-internal-testing"
CAUSAL_LM = f"{ORG}/tiny-Qwen2ForCausalLM-2.5"
SEQUENCE_CLASSIFICATION = f"{ORG}/tiny-Qwen2ForSequenceClassification-2.5"
ZEN = f"{ORG}/zen"
#: Qwen2.5's special tokens, ids after the trained vocabulary in this order
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: the test split's share of each zen configuration (the last rows, unshuffled)
TEST_ROWS = 2


def aphorisms() -> list[str]:
    """The Zen of Python's 19 aphorisms, from the standard library's ``this`` module (rot13 there)."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this
    lines = codecs.decode(this.s, "rot13").splitlines()
    return [line for line in lines[2:] if line.strip()]


def halves(line: str) -> tuple[str, str]:
    """A line cut after its first half of words: the prompt, then the completion with its leading space."""
    words = line.split(" ")
    cut = max(1, (len(words) + 1) // 2)
    return " ".join(words[:cut]), " " + " ".join(words[cut:]) if words[cut:] else " ..."


def zen_configs() -> dict[str, dict[str, list]]:
    """Each configuration of ``trl-internal-testing/zen`` TRL's tests load, in the columns it has: the text
    (standard) or the messages (conversational) of a language-modeling, prompt-only, prompt-completion, preference,
    implicit-prompt preference, unpaired preference and stepwise-supervision set, one row per aphorism."""
    lines = aphorisms()
    cuts = [halves(line) for line in lines]
    prompts = [p for p, _ in cuts]
    completions = [c for _, c in cuts]
    others = completions[7:] + completions[:7]  # another aphorism's ending: the rejected answer
    labels = [i % 3 != 1 for i in range(len(lines))]
    unpaired = [c if ok else o for c, o, ok in zip(completions, others, labels)]
    steps = [[c.split(",")[0], *("," + piece for piece in c.split(",")[1:])] for c in completions]  # cut at commas

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": f"How does this go on: {text}"}]

    def assistant(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text.strip()}]

    return {
        "standard_language_modeling": {"text": lines},
        "standard_prompt_only": {"prompt": prompts},
        "standard_prompt_completion": {"prompt": prompts, "completion": completions},
        "standard_preference": {"prompt": prompts, "chosen": completions, "rejected": others},
        "standard_implicit_prompt_preference": {"chosen": [p + c for p, c in cuts],
                                                "rejected": [p + o for p, o in zip(prompts, others)]},
        "standard_unpaired_preference": {"prompt": prompts,
                                         "completion": unpaired,
                                         "label": labels},
        "standard_stepwise_supervision": {"prompt": prompts, "completions": steps,
                                          "labels": [[(i + j) % 2 == 0 for j in range(len(s))]
                                                     for i, s in enumerate(steps)]},
        "conversational_language_modeling": {"messages": [user(p) + assistant(t) for p, t in zip(prompts, lines)]},
        "conversational_prompt_only": {"prompt": [user(p) for p in prompts]},
        "conversational_prompt_completion": {"prompt": [user(p) for p in prompts],
                                             "completion": [assistant(c) for c in completions]},
        "conversational_preference": {"prompt": [user(p) for p in prompts],
                                      "chosen": [assistant(c) for c in completions],
                                      "rejected": [assistant(o) for o in others]},
        "conversational_implicit_prompt_preference": {"chosen": [user(p) + assistant(c) for p, c in cuts],
                                                      "rejected": [user(p) + assistant(o)
                                                                   for p, o in zip(prompts, others)]},
        "conversational_unpaired_preference": {"prompt": [user(p) for p in prompts],
                                               "completion": [assistant(c) for c in unpaired],
                                               "label": labels},
    }  # fmt: skip


def write_zen(root: Path) -> None:
    """Each zen configuration as ``<root>/zen/<config>/{train,test}.parquet``."""
    import datasets

    for config, columns in zen_configs().items():
        folder = root / "zen" / config
        folder.mkdir(parents=True, exist_ok=True)
        rows = datasets.Dataset.from_dict(columns)
        cut = len(rows) - TEST_ROWS
        rows.select(range(cut)).to_parquet(folder / "train.parquet")
        rows.select(range(cut, len(rows))).to_parquet(folder / "test.parquet")


def chat_template() -> str:
    """Qwen2.5's chat template as TRL installs it (``trl/chat_templates/qwen2_5.jinja``, read at build time, not kept
    in this project): TRL recognises it and swaps in its training template for ``assistant_only_loss``, as it does
    for the real model's tokenizer."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text(encoding="utf-8")


def tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on the Zen of Python, as transformers' ``Qwen2Tokenizer`` (Qwen2.5's
    pre-tokenizer and byte-level decoder), ``<|im_end|>`` its end of sequence, ``<|endoftext|>`` its padding, no
    beginning-of-sequence token, Qwen2.5's chat template."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    shape = transformers.Qwen2Tokenizer()  # Qwen2.5's pre-tokenizer, on an empty vocabulary
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = shape.backend_tokenizer.pre_tokenizer
    text = aphorisms()
    text += [json.dumps(row) for row in zen_configs()["conversational_language_modeling"]["messages"]]
    bpe.train_from_iterator(
        text * 4,
        trainers.BpeTrainer(
            vocab_size=vocab_size - len(SPECIAL),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    made = transformers.Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=None, bos_token=None,
                                       eos_token="<|im_end|>", pad_token="<|endoftext|>")  # fmt: skip
    made.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    made.chat_template = chat_template()
    made.model_max_length = 131072
    return made


def models(vocab: int, special: dict[str, int]) -> dict[str, object]:
    """The tiny Qwen2s, bf16 as the hub's are, weights drawn from a fixed seed: a causal LM (hidden size 8) and a
    sequence classifier with one label (hidden size 16), 2 layers, 4 heads over 2 key-value heads."""
    import torch
    import transformers

    shape = dict(vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                 intermediate_size=32, bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
                 tie_word_embeddings=False, max_position_embeddings=32768)  # fmt: skip
    built = {}
    for name, head, extra in ((CAUSAL_LM, transformers.Qwen2ForCausalLM, dict(hidden_size=8)),
                              (SEQUENCE_CLASSIFICATION, transformers.Qwen2ForSequenceClassification,
                               dict(hidden_size=16, num_labels=1))):  # fmt: skip
        torch.manual_seed(0)
        model = head(transformers.Qwen2Config(**shape, **extra))
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, torch.nn.Embedding):
                torch.nn.init.normal_(module.weight, std=0.02)
        built[name] = model.to(torch.bfloat16)
    return built


def generation_config(special: dict[str, int]):
    """Qwen2.5-Instruct's sampling defaults over this vocabulary's ids."""
    import transformers

    return transformers.GenerationConfig(bos_token_id=special["<|endoftext|>"], pad_token_id=special["<|endoftext|>"],
                                         eos_token_id=[special["<|im_end|>"], special["<|endoftext|>"]],
                                         do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
                                         repetition_penalty=1.05)  # fmt: skip


def hub_folder(cache: Path, repo_id: str) -> Path:
    """A snapshot folder of ``repo_id`` in the hub cache layout (``models--org--name/snapshots/<rev>``, its
    ``refs/main`` naming the revision), emptied."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    return snapshot


def build(root: Path) -> dict[str, str]:
    """Builds every stand-in under ``root`` (``hub/`` the hub cache, ``data/`` the data sets) and returns the
    environment that finds them: the variables a test process needs."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    root = Path(root).resolve()
    made = tokenizer()
    special = {token: made.convert_tokens_to_ids(token) for token in SPECIAL}
    for repo_id, model in models(len(made), special).items():
        snapshot = hub_folder(root / "hub", repo_id)
        model.save_pretrained(snapshot)
        made.save_pretrained(snapshot)
        generation_config(special).save_pretrained(snapshot)
    write_zen(root / "data")
    return environment(root)


def environment(root: Path) -> dict[str, str]:
    """The variables under which TRL's tests find the stand-ins built in ``root``: the hub cache, offline."""
    root = Path(root).resolve()
    return {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HFLIGHT_TRL_STANDINS": str(root / "data"),
            "HF_DATASETS_CACHE": str(root / "datasets_cache")}  # fmt: skip
