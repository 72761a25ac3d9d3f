"""A Seq2SeqTrainer for generative question answering, written the way transformers' examples/pytorch/
question-answering/trainer_seq2seq_qa.py is (the trainer of run_seq2seq_qa.py): generation-based evaluation whose
outputs go through ``post_process_function(examples, features, outputs, stage)`` before ``compute_metrics``.
tests/test_seq2seq_qa.py compares it with ``hflight.qa.QuestionAnsweringSeq2SeqTrainer``."""

import math
import time

from transformers.trainer_utils import PredictionOutput, speed_metrics

# isort: split
from transformers import Seq2SeqTrainer


class QuestionAnsweringSeq2SeqTrainer(Seq2SeqTrainer):
    def __init__(self, *args, eval_examples=None, post_process_function=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eval_examples = eval_examples
        self.post_process_function = post_process_function

    def _loop(self, dataloader, description, ignore_keys, metric_key_prefix):
        # Metrics are computed after post-processing, so the loop runs without them.
        compute_metrics = self.compute_metrics
        self.compute_metrics = None
        start_time = time.time()
        try:
            output = self.evaluation_loop(
                dataloader,
                description=description,
                prediction_loss_only=True if compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=metric_key_prefix,
            )
        finally:
            self.compute_metrics = compute_metrics
        total_batch_size = self.args.eval_batch_size * self.args.world_size
        steps = math.ceil(output.num_samples / total_batch_size)
        output.metrics.update(speed_metrics(metric_key_prefix, start_time, output.num_samples, num_steps=steps))
        return output

    def _prefixed(self, metrics, metric_key_prefix):
        for key in list(metrics.keys()):
            if not key.startswith(f"{metric_key_prefix}_"):
                metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
        return metrics

    def evaluate(self, eval_dataset=None, eval_examples=None, ignore_keys=None, metric_key_prefix="eval", **gen_kwargs):
        gen_kwargs = gen_kwargs.copy()
        if gen_kwargs.get("max_length") is None and self.args.generation_max_length is not None:
            gen_kwargs["max_length"] = self.args.generation_max_length
        if gen_kwargs.get("num_beams") is None and self.args.generation_num_beams is not None:
            gen_kwargs["num_beams"] = self.args.generation_num_beams
        self._gen_kwargs = gen_kwargs

        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        eval_examples = self.eval_examples if eval_examples is None else eval_examples
        output = self._loop(self.get_eval_dataloader(eval_dataset), "Evaluation", ignore_keys, metric_key_prefix)
        if self.post_process_function is not None and self.compute_metrics is not None and self.args.should_save:
            eval_preds = self.post_process_function(eval_examples, eval_dataset, output)
            metrics = self._prefixed(self.compute_metrics(eval_preds), metric_key_prefix)
            metrics.update(output.metrics)
        else:
            metrics = output.metrics
        if self.args.should_log:
            self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, predict_dataset, predict_examples, ignore_keys=None, metric_key_prefix="test", **gen_kwargs):
        self._gen_kwargs = gen_kwargs.copy()
        output = self._loop(self.get_test_dataloader(predict_dataset), "Prediction", ignore_keys, metric_key_prefix)
        if self.post_process_function is None or self.compute_metrics is None:
            return output
        predictions = self.post_process_function(predict_examples, predict_dataset, output, "predict")
        metrics = self._prefixed(self.compute_metrics(predictions), metric_key_prefix)
        metrics.update(output.metrics)
        return PredictionOutput(predictions=predictions.predictions, label_ids=predictions.label_ids, metrics=metrics)
