"""Train with ``push_to_hub=True`` against the local Hub stand-in, with transformers.Trainer and with hflight.Trainer,
and print (as JSON) what each pushed: the repository's files and its commits.

The stand-in starts first and ``HF_ENDPOINT`` points at it before huggingface_hub is imported (the Hub client reads it
at import), as for a user whose ``HF_ENDPOINT`` names a private Hub. Usage:
``python hub_job.py OUT_DIR STRATEGY [STRATEGY ...]``: each ``hub_strategy`` in turn, in the same process (one start
of torch and transformers for all), each against an emptied stand-in (the same repositories pushed anew); the result
is one entry per strategy.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the stand-in
from hub_standin import HubStandIn  # noqa: E402


def push(hub: HubStandIn, out: Path, strategy: str) -> dict:
    """Both trainers trained and pushed with ``hub_strategy=strategy``: what each pushed."""
    import transformers
    from tiny_qa import qa_windows, tiny_bert_qa

    import hflight

    hub.clear(out / "hub")
    result = {}
    for name, trainer_cls, args_cls in (
        ("transformers", transformers.Trainer, transformers.TrainingArguments),
        ("hflight", hflight.Trainer, hflight.TrainingArguments),
    ):
        # every save pushes (hub_always_push): otherwise a save is skipped while the previous upload still runs,
        # which depends on timing (the same rule in both trainers, but not the same timing)
        args = args_cls(output_dir=str(out / name / "run"), push_to_hub=True, hub_model_id=f"team/{name}-run",
                        hub_token="hf_standin", hub_strategy=strategy, hub_always_push=True, max_steps=4,
                        save_steps=2, per_device_train_batch_size=4, logging_steps=1, report_to="none",
                        disable_tqdm=True, train_sampling_strategy="sequential")  # fmt: skip
        trainer = trainer_cls(tiny_bert_qa(0, 16, 1, 0.0, 32), args, train_dataset=qa_windows(16, 0, 24, 10))
        trainer.train()
        commit = trainer.push_to_hub(commit_message="End of training", language="en", tags=["qa"])
        repo = f"team/{name}-run"
        result[name] = {
            "hub_model_id": trainer.hub_model_id,
            "commit_oid": getattr(commit, "oid", None),
            "files": sorted(hub.files(repo)),
            "readme": hub.files(repo).get("README.md", b"").decode(),
            "commits": [(c["summary"], c["files"]) for c in hub.commits if c["repo"] == repo],
        }
    result["unknown"] = sorted(set(hub.unknown))
    return result


def main() -> None:
    out, strategies = Path(sys.argv[1]), sys.argv[2:]
    with HubStandIn(out / "hub") as hub:
        os.environ.update(HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE="0")
        result = {strategy: push(hub, out / strategy, strategy) for strategy in strategies}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
