"""Generation through ONNX Runtime vs eager PyTorch: the same encoder-decoder, the same inputs, transformers' generate.

    python benchmarks/ort_seq2seq_generate.py                  # a small BART (d_model 256, 3+3 layers), greedy
    python benchmarks/ort_seq2seq_generate.py --beams 4        # beam search

A BART is built from a config (no download), untrained (``--init-std``: the spread of its random weights; with 0.3
its logits are so large that rounding differences of 1e-4 flip near-tied arg-maxes, which the check then reports).
The inputs are random token ids: ``--batches`` batches of ``--batch-size`` rows whose source lengths cycle through
``--lengths`` (one padded row each). The ONNX export of the encoder and the decoder
(``hflight.ort.generation.ORTSeq2SeqGenerator``) happens before timing (its time printed once). Then one run of
each on the same batches, interleaved (every batch through each runner in turn, the order rotating, so that a shared
machine's drift in speed falls on all alike):

- eager: ``model.generate`` in PyTorch (transformers' default, with past key values);
- ORT: the generator with the check off (``check_outputs=False``): encoder and decoder sessions, the decoder with
  past key values (transformers' cache, filled by the sessions);
- ORT checked: the default check (``check_outputs=True``: the first batch of each source length is generated eagerly
  too and compared token for token), and ``check_outputs="all"`` (every batch).

Prints seconds and the ratio to eager, and fails unless every ORT run generated eager's tokens.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/ort_eval.py: torch's idle threads spin otherwise

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from transformers import BartConfig, BartForConditionalGeneration  # noqa: E402

from hflight.ort.generation import ORTSeq2SeqGenerator  # noqa: E402

#: the ORT runs: label -> check_outputs
CHECKS: dict[str, Any] = {"ORT": False, "ORT, check_outputs=True": True, 'ORT, check_outputs="all"': "all"}


def build_model(opts: argparse.Namespace) -> BartForConditionalGeneration:
    config = BartConfig(
        vocab_size=opts.vocab, d_model=opts.d_model, encoder_layers=opts.layers, decoder_layers=opts.layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4 * opts.d_model,
        decoder_ffn_dim=4 * opts.d_model, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, decoder_start_token_id=3, forced_eos_token_id=3,
        init_std=opts.init_std,
    )  # fmt: skip
    torch.manual_seed(0)
    return BartForConditionalGeneration(config).eval()


def build_batches(opts: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for i in range(opts.batches):
        length = opts.lengths[i % len(opts.lengths)]
        ids = torch.randint(4, opts.vocab, (opts.batch_size, length), generator=generator)
        mask = torch.ones_like(ids)
        mask[0, length // 2 :] = 0  # one padded row per batch
        ids[0, length // 2 :] = 0
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def interleaved(runners: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> dict[str, tuple[float, list]]:
    """Each batch through every runner in turn (the order rotating from batch to batch), so that a shared machine's
    drift in speed falls on all of them alike; -> name: (seconds, outputs)."""
    names = list(runners)
    seconds = dict.fromkeys(names, 0.0)
    outputs: dict[str, list] = {name: [] for name in names}
    with torch.no_grad():
        for i, batch in enumerate(batches):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                outputs[name].append(runners[name](batch))
                seconds[name] += time.perf_counter() - start
    return {name: (seconds[name], outputs[name]) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[24, 32, 48])
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--beams", type=int, default=1)
    parser.add_argument("--init-std", type=float, default=0.05, help="BART's init_std (wider: more varied tokens)")
    parser.add_argument("--threads", type=int, default=None, help="torch's and ORT's threads (default: torch's)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)

    model = build_model(opts)
    batches = build_batches(opts)
    gen_kwargs = {"max_length": opts.max_length, "num_beams": opts.beams}
    ort = ORTSeq2SeqGenerator(model, check_outputs=False)
    start = time.perf_counter()
    ort.export(batches[0]["input_ids"], batches[0]["attention_mask"])
    print(f"ONNX export of the encoder and the decoder: {time.perf_counter() - start:.2f} s")
    ort.generate(**batches[0], **gen_kwargs)  # warm-up of both: sessions, and torch's first generate
    model.generate(**batches[0], **gen_kwargs)

    rows = sum(len(b["input_ids"]) for b in batches)
    print(
        f"{type(model).__name__} d_model {opts.d_model}, {opts.layers}+{opts.layers} layers, vocab {opts.vocab}; "
        f"{opts.batches} batches x {opts.batch_size} rows ({rows}), source lengths {opts.lengths}, max_length "
        f"{opts.max_length}, beams {opts.beams}, {torch.get_num_threads()} thread(s)"
    )
    generators = {label: ORTSeq2SeqGenerator(model, check_outputs=check) for label, check in CHECKS.items()}
    for generator in generators.values():
        generator.export(batches[0]["input_ids"], batches[0]["attention_mask"])  # its own export, untimed
    runners = {"eager PyTorch": lambda b: model.generate(**b, **gen_kwargs)}
    runners.update({label: lambda b, g=g: g.generate(**b, **gen_kwargs) for label, g in generators.items()})
    results = interleaved(runners, batches)
    eager_seconds, eager = results.pop("eager PyTorch")
    print(f"  {'eager PyTorch':26} {eager_seconds:8.2f} s   1.00x")
    for label, (seconds, outputs) in results.items():
        runner = generators[label]
        same = all(torch.equal(a, b) for a, b in zip(outputs, eager))
        print(
            f"  {label:26} {seconds:8.2f} s   {seconds / eager_seconds:.2f}x eager   "
            f"({runner.check_count} batches compared, {runner.check_seconds:.2f} s; tokens equal to eager: {same})"
        )
        if not same:
            sys.exit(f"{label} generated other tokens than eager PyTorch")


if __name__ == "__main__":
    main()
