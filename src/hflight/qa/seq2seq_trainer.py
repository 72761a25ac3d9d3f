"""``QuestionAnsweringSeq2SeqTrainer``: generative question answering, as transformers' run_seq2seq_qa.py trains and
scores it (its ``trainer_seq2seq_qa.py``), on hflight's ``Seq2SeqTrainer``.

Evaluation generates the answers of the feature windows, then ``post_process_function(examples, features,
outputs[, stage])`` (``outputs``: the loop's ``EvalLoopOutput``) turns them into an ``EvalPrediction`` that
``compute_metrics`` scores; the metrics get the ``{prefix}_`` prefix, then the loop's loss and speed metrics.
As in transformers' example: ``evaluate`` fills ``max_length``/``num_beams`` from ``generation_max_length``/
``generation_num_beams`` when not given (``max_new_tokens`` does not stop that), ``predict`` takes ``gen_kwargs``
as given; the scores are computed only where ``args.should_save`` and logged only where ``args.should_log``; without
a ``post_process_function`` or ``compute_metrics``, ``predict`` returns the loop's output as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transformers.trainer_utils import EvalLoopOutput, PredictionOutput

from hflight.run.evaluation import evaluation_speed, prefixed
from hflight.trainer.seq2seq import Seq2SeqTrainer

__all__ = ["QuestionAnsweringSeq2SeqTrainer"]


class QuestionAnsweringSeq2SeqTrainer(Seq2SeqTrainer):
    """transformers' example ``QuestionAnsweringSeq2SeqTrainer`` (run_seq2seq_qa.py) on Lightning.

    Args:
        eval_examples: the questions behind ``eval_dataset``'s feature windows.
        post_process_function: ``(examples, features, outputs, stage="eval") -> EvalPrediction``.
        All other arguments are ``hflight.Seq2SeqTrainer``'s.
    """

    def __init__(
        self, *args: Any, eval_examples: Any = None, post_process_function: Callable | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.eval_examples = eval_examples
        self.post_process_function = post_process_function

    def _generated(self, dataloader: Any, description: str, ignore_keys: Any, prefix: str) -> EvalLoopOutput:
        """The evaluation loop with ``compute_metrics`` held back (scoring needs post-processing), plus the speed
        metrics."""
        compute_metrics, self.compute_metrics = self.compute_metrics, None
        start = time.time()
        try:
            output = self.evaluation_loop(
                dataloader,
                description=description,
                prediction_loss_only=True if compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=prefix,
            )
        finally:
            self.compute_metrics = compute_metrics
        output.metrics.update(evaluation_speed(self.args, prefix, start, output.num_samples))
        return output

    def _scores(self, prediction: Any, prefix: str) -> dict[str, float]:
        return prefixed(dict(self.compute_metrics(prediction)), prefix)

    def evaluate(
        self,
        eval_dataset: Any = None,
        eval_examples: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        gen_kwargs = dict(gen_kwargs)
        if gen_kwargs.get("max_length") is None and self.args.generation_max_length is not None:
            gen_kwargs["max_length"] = self.args.generation_max_length
        if gen_kwargs.get("num_beams") is None and self.args.generation_num_beams is not None:
            gen_kwargs["num_beams"] = self.args.generation_num_beams
        self._gen_kwargs = gen_kwargs
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        eval_examples = self.eval_examples if eval_examples is None else eval_examples
        dataloader = self.get_eval_dataloader(eval_dataset)
        output = self._generated(dataloader, "Evaluation", ignore_keys, metric_key_prefix)
        if self.post_process_function is not None and self.compute_metrics is not None and self.args.should_save:
            metrics = self._scores(self.post_process_function(eval_examples, eval_dataset, output), metric_key_prefix)
            metrics.update(output.metrics)
        else:
            metrics = output.metrics
        if self.args.should_log:
            self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(
        self,
        predict_dataset: Any,
        predict_examples: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> PredictionOutput | EvalLoopOutput:
        self._gen_kwargs = dict(gen_kwargs)
        dataloader = self.get_test_dataloader(predict_dataset)
        output = self._generated(dataloader, "Prediction", ignore_keys, metric_key_prefix)
        if self.post_process_function is None or self.compute_metrics is None:
            return output
        predictions = self.post_process_function(predict_examples, predict_dataset, output, "predict")
        metrics = self._scores(predictions, metric_key_prefix)
        metrics.update(output.metrics)
        return PredictionOutput(predictions=predictions.predictions, label_ids=predictions.label_ids, metrics=metrics)
