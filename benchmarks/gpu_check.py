"""The GPU check: hflight against transformers on one CUDA device, in one table (issue 56, item 5).

    python benchmarks/gpu_check.py                    # everything, about 5 minutes on an H200
    python benchmarks/gpu_check.py --quick            # fewer steps and checkpoints
    python benchmarks/gpu_check.py --only fp32,checkpoint
    python benchmarks/gpu_check.py --skip compile,mrc
    python benchmarks/gpu_check.py --cpu-smoke        # the same code on the CPU at tiny sizes (the suite runs it)

Each check trains the same model on the same data with the same seed through ``transformers.Trainer`` and
``hflight.Trainer`` in this process, one after the other (the previous run's model released, its GPU memory emptied):

- parity (``fp32``, ``bf16``, ``fp16`` with the default optimizer, ``fp16_sgd`` with ``optim="sgd"``, ``grad_ckpt``,
  ``liger``, ``compile``, ``sft_lora``): GPT-2 124M built from ``GPT2Config()`` on random token ids, every step logged;
  each step's loss and gradient norm (relative difference) and the trained weights (largest absolute difference) must
  agree within the row's tolerance: 1e-6 (the runs are expected identical), 5e-6 for ``torch_compile``. ``liger``
  trains a Llama of GPT-2's size (Liger has no kernels for GPT-2, whose row would compare nothing) and also fails
  unless hflight's model runs Liger's kernels; hflight trains first there, because Liger patches the modeling classes
  themselves. ``sft_lora`` is TRL's ``SFTTrainer`` with a LoRA ``peft_config`` on TRL's defaults (``bf16``),
  ``hflight.trl``'s against ``trl``'s (tests/tiny_lm.py's tokenizer, GPT-2 and texts; every logged value but times);
- ``device``: the device of hflight's model after ``train()`` (``fp32``'s run) must be ``cuda:0``;
- ``perf``: the peak GPU memory of training GPT-2 124M (``torch.cuda.max_memory_allocated``, the previous model
  collected first; target <= 1.02x transformers'), the time of a step (best of 3 blocks of steps) and of
  ``evaluate()`` (best of 3 calls);
- ``checkpoint``: the stall of a mid-run checkpoint of GPT-2 124M with AdamW's state (1.5 GB) for transformers,
  hflight (synchronous, durable) and hflight ``save_async=True`` (targets: <= 1.1x and <= 0.15x transformers'): the
  time the training thread loses to it, i.e. what the steps from one checkpoint to the next took beyond as many
  median steps without one (a background write slowing the steps beside it counts); the median of the run's mid-run
  checkpoints, each one's in the notes. Checkpoints are 50 steps apart, and before the step that ends with a
  checkpoint the run waits (uncounted) until the previous one is published, so that checkpoints are farther apart
  than a write;
- ``mrc``: the main job, ``python train.py +experiment=mrc`` (``trainer=default``) and with ``trainer=gpu_bf16``, as
  subprocesses started first (they run beside the parity rows, never beside the timed ones): their F1.

Only parity rows and ``device`` decide the exit status (1 when one fails or crashes; a crash of any row is reported in
its row, and the table is printed all the same); the other rows print their ratio against the target. Without CUDA
the script says so and exits 0. ``--cpu-smoke`` runs every check that does not need CUDA on the CPU with tiny models
(fp16, Liger and torch_compile are skipped, memory is not measured), the main job with a few steps: the suite's
test of this script (tests/test_gpu_check.py). Outputs go to a temporary folder (``--dir``), removed at the end.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: the checks, in the order they run: the main job starts first and runs beside the parity rows; the timed rows wait
#: for it; the two that compile kernels (the longest) come last
CHECKS = ("mrc", "fp32", "bf16", "fp16", "fp16_sgd", "grad_ckpt", "sft_lora", "perf", "checkpoint", "liger", "compile")
#: checks that cannot run on the CPU (skipped by --cpu-smoke)
CUDA_ONLY = ("fp16", "fp16_sgd", "liger", "compile")
#: the main job (from the checkout's root) and its two runs: name -> extra overrides
MAIN_JOB = [sys.executable, "train.py", "+experiment=mrc"]
MAIN_RUNS = {"fp32": [], "bf16": ["trainer=gpu_bf16"]}
#: F1 of the by-hand run on one H200 (issue 56), printed beside ours
MAIN_REFERENCE = {"fp32": 86.79, "bf16": 94.42}
#: logged values that are times, never compared
TIMES = ("_runtime", "_per_second", "step_time")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each check is."""

    gpt2: dict  # GPT2Config's arguments ({}: GPT-2 124M)
    llama: dict  # LlamaConfig's (Liger's row)
    seq_len: int
    batch: int
    parity_steps: int
    warmup_steps: int  # steps before the timed blocks
    block_steps: int  # steps per timed block (3 blocks)
    eval_examples: int
    save_steps: int
    checkpoints: int  # mid-run checkpoints
    main_job: tuple[str, ...] = ()  # extra overrides of the main job
    blocks: int = 3
    eval_rounds: int = 3


FULL = Sizes(gpt2={}, llama=dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                                  num_key_value_heads=12, vocab_size=32000, max_position_embeddings=1024),
             seq_len=128, batch=8, parity_steps=20, warmup_steps=5, block_steps=10, eval_examples=128, save_steps=50,
             checkpoints=3)  # fmt: skip
QUICK = dataclasses.replace(FULL, parity_steps=8, block_steps=5, eval_examples=64, save_steps=20, checkpoints=2)
SMOKE = Sizes(gpt2=dict(vocab_size=96, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=95,
                        eos_token_id=95),
              llama=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=32),
              seq_len=16, batch=2, parity_steps=3, warmup_steps=1, block_steps=2, eval_examples=8, save_steps=3,
              checkpoints=2, eval_rounds=2,
              main_job=("trainer=cpu", "data.synthetic.num_train_articles=4",
                        "data.synthetic.num_validation_articles=2", "args.max_steps=2", "args.eval_strategy=no",
                        "args.save_strategy=no", "args.load_best_model_at_end=false",
                        "model.tokenizer_trainer.vocab_size=200", "cpu_threads=1", "logger=none"))  # fmt: skip


@dataclasses.dataclass
class Row:
    """One line of the table. ``decides``: a parity row (its failure fails the script)."""

    name: str
    hflight: str = "-"
    transformers: str = "-"
    diff: str = "-"
    target: str = "-"
    verdict: str = "-"
    decides: bool = False
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.decides and self.verdict == "FAIL"


class Check:
    """What every check needs: the sizes, the device, the clock, the folder, the libraries."""

    def __init__(self, opts: argparse.Namespace, sizes: Sizes, folder: Path) -> None:
        import torch

        self.opts, self.sizes, self.folder, self.torch = opts, sizes, folder, torch
        self.cuda = not opts.cpu_smoke
        self.start = time.perf_counter()
        self._templates: dict[str, Any] = {}

    # ---- the clock ----------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def release(self) -> None:
        """The previous run's objects collected, the GPU's cached blocks returned."""
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    # ---- models and data ----------------------------------------------------------------------------------------
    def model(self, kind: str = "gpt2") -> Any:
        """A fresh copy of the ``kind`` model (same initial weights every time, built once on the CPU)."""
        if kind not in self._templates:
            import transformers

            self.torch.manual_seed(0)
            if kind == "gpt2":
                self._templates[kind] = transformers.GPT2LMHeadModel(transformers.GPT2Config(**self.sizes.gpt2))
            else:
                self._templates[kind] = transformers.LlamaForCausalLM(transformers.LlamaConfig(**self.sizes.llama))
        return copy.deepcopy(self._templates[kind])

    def vocab(self) -> int:
        return min(self.sizes.gpt2.get("vocab_size", 50257), self.sizes.llama["vocab_size"])

    def data(self, rows: int, seed: int) -> list[dict]:
        """``rows`` random token sequences, their own labels."""
        generator = self.torch.Generator().manual_seed(seed)
        ids = self.torch.randint(0, self.vocab(), (rows, self.sizes.seq_len), generator=generator)
        return [{"input_ids": row, "labels": row} for row in ids]

    def fields(self, output_dir: Path, steps: int, **extra: Any) -> dict:
        """TrainingArguments shared by every run (transformers' names; hflight takes the same)."""
        values = dict(output_dir=str(output_dir), per_device_train_batch_size=self.sizes.batch,
                      per_device_eval_batch_size=2 * self.sizes.batch, max_steps=steps, logging_steps=1,
                      save_strategy="no", report_to="none", disable_tqdm=True, seed=42)  # fmt: skip
        if not self.cuda:
            values["use_cpu"] = True
        return {**values, **extra}

    def train(self, library: str, model: Any, fields: dict, data: list, callbacks: tuple = (), evaluation=None) -> Any:
        """A trainer of ``library`` ("hflight" or "transformers"), trained."""
        import transformers

        import hflight

        module = hflight if library == "hflight" else transformers
        trainer = module.Trainer(model=model, args=module.TrainingArguments(**fields), train_dataset=data,
                                 eval_dataset=evaluation, callbacks=list(callbacks))  # fmt: skip
        trainer.remove_callback(transformers.PrinterCallback)  # every step is logged: not printed
        trainer.train()
        return trainer


# ---- parity ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Parity:
    """A parity row: TrainingArguments beside the shared ones, the model, the tolerance."""

    label: str
    fields: dict
    model: str = "gpt2"
    tolerance: float = 1e-6
    hflight_first: bool = False


PARITY = {
    "fp32": Parity("parity fp32", {}),
    "bf16": Parity("parity bf16", {"bf16": True}),
    "fp16": Parity("parity fp16 (default optim)", {"fp16": True}),
    "fp16_sgd": Parity("parity fp16, optim=sgd", {"fp16": True, "optim": "sgd"}),
    "grad_ckpt": Parity("parity grad. checkpointing", {"gradient_checkpointing": True}),
    "liger": Parity("parity Liger (Llama)", {"use_liger_kernel": True}, model="llama", hflight_first=True),
    "compile": Parity("parity torch_compile", {"torch_compile": True}, tolerance=5e-6),
}


def relative(a: float, b: float) -> float:
    """|a - b| relative to the larger; 0 for equal values (NaN and infinities included), inf for one non-finite."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def compare_runs(ours: dict, theirs: dict, tolerance: float, keys: tuple[str, ...] | None = None) -> dict:
    """Two runs' step logs and trained weights compared: the largest relative difference of each logged value (every
    key but times when ``keys`` is None; one that a run lacks differs), the largest absolute weight difference, and
    the verdict."""
    mine, other = ours["logs"], theirs["logs"]
    worst: dict[str, float] = {}
    same_steps = [e.get("step") for e in mine] == [e.get("step") for e in other] and len(mine) == len(other) > 0
    for a, b in zip(mine, other):
        names = keys or tuple(k for k in a.keys() | b.keys() if not k.endswith(TIMES))
        for key in names:
            if key not in a or key not in b:
                worst[key] = math.inf
            elif isinstance(a[key], (int, float)) and isinstance(b[key], (int, float)):
                worst[key] = max(worst.get(key, 0.0), relative(float(a[key]), float(b[key])))
            elif a[key] != b[key]:
                worst[key] = math.inf
    weights = math.inf
    if ours["weights"].keys() == theirs["weights"].keys() and ours["weights"]:
        weights = max(float((ours["weights"][k] - theirs["weights"][k]).abs().max()) for k in ours["weights"])
    passed = same_steps and all(v <= tolerance for v in worst.values()) and weights <= tolerance
    return {"same_steps": same_steps, "worst": worst, "weights": weights, "passed": passed,
            "identical": same_steps and weights == 0 and not any(worst.values())}  # fmt: skip


def step_logs(trainer: Any) -> list[dict]:
    return [dict(entry) for entry in trainer.state.log_history if "loss" in entry]


def outcome(trainer: Any) -> dict:
    """What a parity run leaves: its step logs, its trained weights (CPU, float32), its model's device."""
    model = getattr(trainer.model, "_orig_mod", trainer.model)  # a compiled model's own
    return {
        "logs": step_logs(trainer),
        "weights": {
            k.replace("_orig_mod.", ""): v.detach().float().cpu().clone()
            for k, v in model.named_parameters()
            if v.requires_grad
        },  # fmt: skip
        "device": str(next(model.parameters()).device),
    }


def parity_row(check: Check, name: str, spec: Parity, runs: dict) -> Row:
    compared = compare_runs(runs["hflight"], runs["transformers"], spec.tolerance, keys=("loss", "grad_norm"))
    last = {lib: runs[lib]["logs"][-1]["loss"] if runs[lib]["logs"] else math.nan for lib in runs}
    worst = compared["worst"]
    diff = (f"loss {worst.get('loss', math.inf):.1e} gn {worst.get('grad_norm', math.inf):.1e} "
            f"w {compared['weights']:.1e}")  # fmt: skip
    if compared["identical"]:
        diff = "identical"
    note = "" if compared["same_steps"] else "the runs logged different steps"
    target = "equal" if spec.tolerance <= 1e-6 else f"<= {spec.tolerance:g}"
    return Row(spec.label, f"loss {last['hflight']:.5f}", f"loss {last['transformers']:.5f}", diff, target,
               "PASS" if compared["passed"] else "FAIL", decides=True, note=note)  # fmt: skip


def liger_applied(model: Any) -> bool:
    """Whether Liger's kernels run in ``model`` (a module or its forward comes from liger_kernel)."""
    for module in model.modules():
        forward = getattr(module, "forward", None)
        where = f"{type(module).__module__} {getattr(forward, '__module__', '')}"
        if "liger_kernel" in where:
            return True
    return False


def run_parity(check: Check, name: str) -> list[Row]:
    spec = PARITY[name]
    steps = check.sizes.parity_steps
    data = check.data(steps * check.sizes.batch, seed=1)
    runs: dict[str, dict] = {}
    extra: dict[str, Any] = {}
    order = ("hflight", "transformers") if spec.hflight_first else ("transformers", "hflight")
    for library in order:
        started = time.perf_counter()
        fields = check.fields(check.folder / f"{name}-{library}", steps, **spec.fields)
        trainer = check.train(library, check.model(spec.model), fields, data)
        runs[library] = outcome(trainer)
        if library == "hflight" and name == "liger":
            extra["liger"] = liger_applied(trainer.model)
        del trainer
        check.release()
        check.log(f"{name}: {library} trained {steps} steps in {time.perf_counter() - started:.1f} s")
    row = parity_row(check, name, spec, runs)
    rows = [row]
    if name == "liger" and not extra["liger"]:
        row.verdict, row.note = "FAIL", "hflight's model does not run Liger's kernels"
    if name == "fp32":
        device = runs["hflight"]["device"]
        expected = "cuda:0" if check.cuda else "cpu"
        rows.append(Row("model device after train()", device, runs["transformers"]["device"], "-", expected,
                        "PASS" if device == expected else "FAIL", decides=True))  # fmt: skip
    return rows


def run_sft_lora(check: Check, name: str) -> list[Row]:
    """TRL's SFT with a LoRA adapter: trl.SFTTrainer on transformers against hflight.trl's (tests/test_trl.py's
    tiny GPT-2, tokenizer and texts), every logged value but times and the adapter's trained weights."""
    import peft
    import transformers
    import trl

    import hflight.trl as hflight_trl

    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_lm  # the suite's offline tokenizer, GPT-2 and texts

    steps = max(check.sizes.parity_steps, 4)
    data = tiny_lm.columns(16 * steps, text=(5, 20))
    runs = {}
    for library, module in (("transformers", trl), ("hflight", hflight_trl)):
        fields = dict(per_device_train_batch_size=4, max_steps=steps, logging_steps=1, learning_rate=1e-3, seed=0,
                      report_to="none", disable_tqdm=True, save_strategy="no")  # fmt: skip
        if not check.cuda:
            fields |= {"bf16": False, "use_cpu": True}
        lora = peft.LoraConfig(r=8, target_modules=["c_attn"], task_type="CAUSAL_LM")
        trainer = module.SFTTrainer(model=tiny_lm.gpt2(), args=trl.SFTConfig(str(check.folder / f"sft-{library}"),
                                    **fields), train_dataset=data, processing_class=tiny_lm.tokenizer(),
                                    peft_config=lora)  # fmt: skip
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
        runs[library] = outcome(trainer)
        del trainer
        check.release()
        check.log(f"{name}: {library} trained {steps} steps")
    compared = compare_runs(runs["hflight"], runs["transformers"], 1e-6)
    last = {lib: runs[lib]["logs"][-1]["loss"] if runs[lib]["logs"] else math.nan for lib in runs}
    worst = max(compared["worst"].values(), default=math.inf)
    diff = "identical" if compared["identical"] else f"logs {worst:.1e} w {compared['weights']:.1e}"
    return [Row("parity TRL SFT + LoRA", f"loss {last['hflight']:.5f}", f"loss {last['transformers']:.5f}", diff,
                "equal", "PASS" if compared["passed"] else "FAIL", decides=True)]  # fmt: skip


# ---- timing ---------------------------------------------------------------------------------------------------------
def clock_callback(check: Check, wait_for: tuple[Path, int] | None = None) -> Any:
    """A callback stamping the start of every step (after the device finished the previous one), by global step, on a
    clock that leaves out its own waits. ``wait_for`` (output_dir, save_steps): before the step that ends with a
    checkpoint, wait until the previous checkpoint's folder is published (``save_async``'s write over), so that
    checkpoints are farther apart than a write; training goes on beside the write until then."""
    import transformers

    class Clock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.stamps: dict[int, float] = {}
            self.waited = 0.0
            self.waits: list[float] = []
            self.unpublished: list[str] = []

        def on_step_begin(self, args, state, control, **kwargs):
            check.sync()
            now = time.perf_counter()
            self.stamps[state.global_step] = now - self.waited
            previous = state.global_step + 1 - (wait_for[1] if wait_for else 0)
            if wait_for and previous > 0 and previous % wait_for[1] == 0:
                folder = wait_for[0] / f"checkpoint-{previous}"
                while not folder.is_dir() and time.perf_counter() - now < 60 and not self.unpublished:
                    time.sleep(0.002)
                if not folder.is_dir():
                    self.unpublished.append(folder.name)
                waited = time.perf_counter() - now
                self.waits.append(waited)
                self.waited += waited

    return Clock()


def run_perf(check: Check, name: str) -> list[Row]:
    """Peak GPU memory of training, time of a step (best block) and of evaluate() (best call), both libraries."""
    sizes = check.sizes
    steps = sizes.warmup_steps + sizes.blocks * sizes.block_steps + 1
    data, evaluation = check.data(steps * sizes.batch, seed=2), check.data(sizes.eval_examples, seed=3)
    found: dict[str, dict] = {}
    for library in ("transformers", "hflight"):
        check.release()
        held = check.torch.cuda.memory_allocated() if check.cuda else 0
        if check.cuda:
            check.torch.cuda.reset_peak_memory_stats()
        clock = clock_callback(check)
        fields = check.fields(check.folder / f"perf-{library}", steps, logging_steps=500)
        trainer = check.train(library, check.model(), fields, data, callbacks=(clock,), evaluation=evaluation)
        peak = check.torch.cuda.max_memory_allocated() if check.cuda else math.nan
        first = sizes.warmup_steps
        blocks = [(clock.stamps[first + (i + 1) * sizes.block_steps] - clock.stamps[first + i * sizes.block_steps])
                  / sizes.block_steps for i in range(sizes.blocks)]  # fmt: skip
        evals = []
        for _ in range(sizes.eval_rounds):
            check.sync()
            began = time.perf_counter()
            trainer.evaluate()
            check.sync()
            evals.append(time.perf_counter() - began)
        del trainer
        check.release()
        left = check.torch.cuda.memory_allocated() if check.cuda else 0  # what the collected run still holds
        found[library] = {"peak": peak, "held": held, "left": left, "step": min(blocks), "eval": min(evals)}
        check.log(f"{name}: {library}: peak {peak / 2**30:.3f} GiB, step {min(blocks) * 1e3:.1f} ms, evaluate "
                  f"{min(evals):.3f} s (allocated {held / 2**20:.0f} MiB before the run, {left / 2**20:.0f} MiB "
                  "once it was collected)")  # fmt: skip
    ours, theirs = found["hflight"], found["transformers"]
    rows = []
    if check.cuda:
        ratio = ours["peak"] / theirs["peak"]
        rows.append(Row("peak GPU memory, GPT-2 train", f"{ours['peak'] / 2**30:.3f} GiB",
                        f"{theirs['peak'] / 2**30:.3f} GiB", f"{ratio:.3f}x", "<= 1.02x",
                        "met" if ratio <= 1.02 else "NOT MET",
                        note=f"allocated before the run / once it was collected: hflight {ours['held'] / 2**20:.0f} / "
                             f"{ours['left'] / 2**20:.0f} MiB, transformers {theirs['held'] / 2**20:.0f} / "
                             f"{theirs['left'] / 2**20:.0f} MiB"))  # fmt: skip
    else:
        rows.append(Row("peak GPU memory, GPT-2 train", verdict="SKIP", note="no CUDA: not measured"))
    for key, label, unit, scale in (("step", "train step (best of 3)", "ms", 1e3), ("eval", "evaluate() (best of 3)",
                                                                                      "s", 1.0)):  # fmt: skip
        rows.append(Row(label, f"{ours[key] * scale:.3f} {unit}", f"{theirs[key] * scale:.3f} {unit}",
                        f"{ours[key] / theirs[key]:.3f}x", verdict="info"))  # fmt: skip
    return rows


def stall(clock: Any, save_steps: int, checkpoints: int, last_step: int) -> list[float]:
    """Per mid-run checkpoint, the time the training thread lost to it: from the step that saved to the next checkpoint,
    the excess of every step over the median step without a checkpoint."""
    stamps = clock.stamps
    steps = sorted(g for g in stamps if g >= 2 and g + 1 in stamps and g + 1 <= last_step)
    intervals = {g: stamps[g + 1] - stamps[g] for g in steps}  # holds step g+1 and the boundary after it
    saving = {g for g in intervals if (g + 1) % save_steps == 0}
    median = statistics.median(v for g, v in intervals.items() if g not in saving)
    out = []
    for c in range(1, checkpoints + 1):
        span = [g for g in intervals if c * save_steps - 1 <= g < (c + 1) * save_steps - 1]
        out.append(sum(intervals[g] - median for g in span))
    return out


def run_checkpoint(check: Check, name: str) -> list[Row]:
    """The stall of mid-run checkpoints: transformers, hflight synchronous, hflight save_async."""
    sizes = check.sizes
    save, count = sizes.save_steps, sizes.checkpoints
    steps = count * save + max(2, save // 2)  # the last checkpoint mid-run, the final one outside the clock
    data = check.data(steps * sizes.batch, seed=4)
    found: dict[str, dict] = {}
    for kind, library, extra in (("transformers", "transformers", {}), ("sync", "hflight", {}),
                                 ("save_async", "hflight", {"save_async": True})):  # fmt: skip
        out = check.folder / f"ckpt-{kind}"
        clock = clock_callback(check, wait_for=(out, save))
        fields = check.fields(out, steps, logging_steps=500, save_strategy="steps", save_steps=save, **extra)
        trainer = check.train(library, check.model(), fields, data, callbacks=(clock,))
        del trainer
        check.release()
        first = out / f"checkpoint-{save}"
        size = sum(f.stat().st_size for f in first.rglob("*") if f.is_file()) if first.is_dir() else 0
        stalls = stall(clock, save, count, steps - 1)
        found[kind] = {"stalls": stalls, "median": statistics.median(stalls), "size": size,
                       "waits": clock.waits, "unpublished": clock.unpublished}  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
        check.log(f"{name}: {kind}: stall per checkpoint {', '.join(f'{s:.3f}' for s in stalls)} s "
                  f"({size / 2**30:.2f} GiB each; waited for the write {sum(clock.waits):.2f} s)")  # fmt: skip
    theirs = found["transformers"]["median"]
    rows = []
    for kind, target in (("sync", 1.1), ("save_async", 0.15)):
        ours = found[kind]["median"]
        each = ", ".join(f"{s:.3f}" for s in found[kind]["stalls"])
        note = (
            f"per checkpoint: {each} s; transformers {', '.join(f'{s:.3f}' for s in found['transformers']['stalls'])}"
        )
        if theirs > 0:
            ratio, verdict = f"{ours / theirs:.3f}x", "met" if ours / theirs <= target else "NOT MET"
        else:  # no stall measured for transformers (noise of a busy CPU): no ratio
            ratio, verdict = "-", "-"
        if found[kind]["unpublished"]:
            verdict, note = "ERROR", f"not published within 60 s: {', '.join(found[kind]['unpublished'])}; {note}"
        rows.append(Row(f"checkpoint stall, {kind}", f"{ours:.3f} s", f"{theirs:.3f} s", ratio, f"<= {target}x",
                        verdict, note=note))  # fmt: skip
    sizes_gib = (found["sync"]["size"] / 2**30, found["transformers"]["size"] / 2**30)
    rows[0].note += "; checkpoint %.2f GiB (transformers' %.2f)" % sizes_gib
    return rows


# ---- the main job ---------------------------------------------------------------------------------------------------
def start_main_jobs(check: Check) -> dict[str, tuple[subprocess.Popen, Path, float, float]]:
    """Both main-job runs started, each into its own Hydra run folder, logging into it."""
    started = {}
    for kind, overrides in MAIN_RUNS.items():
        folder = check.folder / f"mrc-{kind}"
        folder.mkdir(parents=True)
        extra = list(check.sizes.main_job)
        if not check.cuda and kind == "bf16":
            overrides = ["args.bf16=true"]
        command = [*MAIN_JOB, f"hydra.run.dir={folder}", *overrides, *extra, *check.opts.main_job]
        log = (folder / "job.log").open("w")
        env = {**os.environ, "HYDRA_FULL_ERROR": "1"}  # a failure's last line is its exception
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        started[kind] = (process, folder, time.perf_counter(), time.time())
        check.log(f"mrc: started {' '.join(command[1:])}")
    return started


def main_job_f1(folder: Path) -> tuple[float, float]:
    """The final F1 a main-job run wrote into its run folder (eval_results.json, else all_results.json) and its
    train_runtime (nan where it wrote none)."""
    results: dict = {}
    for name in ("train_results.json", "all_results.json", "eval_results.json"):
        path = folder / name
        if path.is_file():
            results |= json.loads(path.read_text("utf-8"))
    if "eval_f1" not in results:
        raise RuntimeError(f"no eval_f1 in {folder}'s eval_results.json or all_results.json")
    return float(results["eval_f1"]), float(results.get("train_runtime", math.nan))


def finish_main_jobs(check: Check, started: dict, timeout: float) -> list[Row]:
    rows = []
    for kind, (process, folder, began, wall_began) in started.items():
        label = f"main job F1, {'trainer=default' if kind == 'fp32' else 'trainer=gpu_bf16'}"
        try:
            process.wait(timeout=max(1.0, timeout - (time.perf_counter() - began)))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            rows.append(Row(label, verdict="ERROR", note=f"killed after {timeout:.0f} s"))
            continue
        wall = (folder / "job.log").stat().st_mtime - wall_began  # its last output: about when it ended
        log = (folder / "job.log").read_text("utf-8", errors="replace")
        if process.returncode != 0:
            last = [line for line in log.splitlines() if line.strip()][-1:] or ["(no output)"]
            rows.append(Row(label, verdict="ERROR", note=f"exit status {process.returncode}: {last[0]}"))
            continue
        try:
            f1, train_runtime = main_job_f1(folder)
        except Exception as error:  # noqa: BLE001 - reported in its row
            rows.append(Row(label, verdict="ERROR", note=last_line(error)))
            continue
        rows.append(Row(label, f"{f1:.2f}", "-", "-", f"by hand {MAIN_REFERENCE[kind]:.2f}", "info",
                        note=f"about {wall:.0f} s in all, train_runtime {train_runtime:.1f} s (beside the parity "
                             "rows and the other run)"))  # fmt: skip
    return rows


# ---- the table ------------------------------------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[Check, str], list[Row]]] = {
    **{name: run_parity for name in PARITY},
    "sft_lora": run_sft_lora,
    "perf": run_perf,
    "checkpoint": run_checkpoint,
}
#: the rows a check makes (for the rows of a check that crashed or was skipped)
LABELS = {**{name: [spec.label] for name, spec in PARITY.items()}, "sft_lora": ["parity TRL SFT + LoRA"],
          "perf": ["peak GPU memory, GPT-2 train", "train step (best of 3)", "evaluate() (best of 3)"],
          "checkpoint": ["checkpoint stall, sync", "checkpoint stall, save_async"],
          "mrc": ["main job F1, trainer=default", "main job F1, trainer=gpu_bf16"]}  # fmt: skip
LABELS["fp32"] = [PARITY["fp32"].label, "model device after train()"]
DECIDES = {name for name in PARITY} | {"sft_lora"}


def last_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[-1] if text else type(error).__name__


def header(check: Check) -> str:
    import lightning
    import torch
    import transformers

    if check.cuda:
        device = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    else:
        device = "CPU (--cpu-smoke: tiny sizes, CUDA-only rows skipped)"
    return (f"GPU check on {device}: torch {torch.__version__}, transformers {transformers.__version__}, lightning "
            f"{lightning.__version__}")  # fmt: skip


def table(check: Check, rows: list[Row]) -> str:
    heads = ("row", "hflight", "transformers", "diff / ratio", "target", "verdict")
    cells = [heads, *[(r.name, r.hflight, r.transformers, r.diff, r.target, r.verdict) for r in rows]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(heads))]
    lines = [header(check)]
    for i, line in enumerate(cells):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * width for width in widths))
    notes = [f"  {r.name}: {r.note}" for r in rows if r.note]
    if notes:
        lines += ["notes:", *notes]
    return "\n".join(lines)


def selected(opts: argparse.Namespace) -> list[str]:
    def names(text: str | None) -> set[str]:
        chosen = {n.strip() for n in (text or "").split(",") if n.strip()}
        unknown = chosen - set(CHECKS)
        if unknown:
            raise SystemExit(f"unknown check(s) {', '.join(sorted(unknown))}: choose from {', '.join(CHECKS)}")
        return chosen

    only, skip = names(opts.only), names(opts.skip)
    return [name for name in CHECKS if (not only or name in only) and name not in skip]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma-separated checks to run, of: {', '.join(CHECKS)}")
    parser.add_argument("--skip", help="comma-separated checks to leave out")
    parser.add_argument("--quick", action="store_true", help="fewer steps and checkpoints")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (the suite's smoke test)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which the checks not yet started are skipped and the main job is "
                             "stopped (default 420)")  # fmt: skip
    parser.add_argument("--main-job", nargs="*", default=[], metavar="OVERRIDE",
                        help="extra overrides for both main-job runs (e.g. args.num_train_epochs=1)")  # fmt: skip
    parser.add_argument("--dir", type=Path, default=None, help="where the runs write (a temporary folder in it)")
    parser.add_argument("--report", type=Path, default=None,
                        help="also write the table into this file, and its rows as JSON beside it (.json)")  # fmt: skip
    return parser.parse_args(argv)


def write_report(check: Check, rows: list[Row], path: Path | None, final: bool) -> str:
    """The table and its verdict line; written to ``path`` (and its rows as JSON beside it) after every check, so that
    a run cut short leaves what it found."""
    failed = [row.name for row in rows if row.failed]
    verdict = f"parity failed: {', '.join(failed)}" if failed else "every parity row passed"
    text = (
        f"{table(check, rows)}\n\n{'total' if final else 'so far (the run goes on)'} {check.elapsed():.0f} s; {verdict}"
    )
    if path:
        path.write_text(text + "\n", "utf-8")
        rows_json = json.dumps([dataclasses.asdict(row) for row in rows], indent=1)
        path.with_suffix(".json").write_text(rows_json + "\n", "utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    checks = selected(opts)
    if not opts.cpu_smoke:  # one device (for the main job too): transformers would take several as DataParallel
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    import torch

    if not opts.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing run (python benchmarks/gpu_check.py --cpu-smoke runs its code on the CPU)")
        return 0
    sizes = SMOKE if opts.cpu_smoke else QUICK if opts.quick else FULL
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check-", dir=opts.dir) as folder:
        check = Check(opts, sizes, Path(folder))
        check.log(header(check))
        check.log(f"checks: {', '.join(checks)}; writing under {folder}")
        jobs = {}
        if "mrc" in checks:
            try:
                jobs = start_main_jobs(check)
            except Exception as error:  # noqa: BLE001 - reported in its rows
                rows += [Row(label, verdict="ERROR", note=last_line(error)) for label in LABELS["mrc"]]
        for name in [*(name for name in checks if name != "mrc"), "mrc"]:  # "mrc": its runs' end
            before = len(rows)
            if name == "mrc" or (jobs and name in ("perf", "checkpoint")):  # timed rows: the main job must be over
                rows += finish_main_jobs(check, jobs, opts.budget)
                jobs = {}
            if name == "mrc":
                pass
            elif opts.cpu_smoke and name in CUDA_ONLY:
                rows += [Row(label, verdict="SKIP", note="needs CUDA") for label in LABELS[name]]
            elif check.elapsed() > opts.budget:
                note = f"not started: over the {opts.budget:.0f} s budget"
                rows += [Row(label, verdict="SKIP", note=note) for label in LABELS[name]]
            else:
                began = check.elapsed()
                try:
                    rows += RUNNERS[name](check, name)
                except Exception as error:  # noqa: BLE001 - one row's crash is reported in it, the others still run
                    verdict = "FAIL" if name in DECIDES else "ERROR"
                    rows += [Row(label, verdict=verdict, decides=name in DECIDES, note=last_line(error))
                             for label in LABELS[name]]  # fmt: skip
                    check.log(f"{name}: crashed: {last_line(error)}")
                    check.release()
                check.log(f"{name}: done in {check.elapsed() - began:.1f} s")
            for row in rows[before:]:
                check.log(f"  {row.name}: {row.hflight} | {row.transformers} | {row.diff} | {row.verdict} {row.note}")
            if rows[before:]:
                write_report(check, rows, opts.report, final=False)
        print(f"\n{write_report(check, rows, opts.report, final=True)}", flush=True)
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
