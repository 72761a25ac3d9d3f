"""``MRCTrainer`` (alias ``QuestionAnsweringTrainer``): evaluation that ends in answers and SQuAD scores.

Evaluation windows are run sorted by length and padded per batch, so no compute is spent on padding: windows
already padded to ``max_seq_length`` are sorted by their real tokens and each batch is cut after its longest
window's last real token; with a left-padding tokenizer the collator's padding is shifted back out of the logits.
Logits move to the CPU per batch, the feature order is restored, then
``post_process_function`` turns logits into answers and ``compute_metrics`` scores them. Because the facade's
mid-training evaluation calls ``evaluate()``, QA metrics are available during training, so
``metric_for_best_model="f1"`` with ``load_best_model_at_end`` works.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from transformers.trainer_utils import EvalPrediction, PredictionOutput

from hflight.qa.metrics import squad_metrics
from hflight.qa.postprocess import postprocess_qa_predictions_with_scores
from hflight.run.evaluation import evaluation_speed, prefixed
from hflight.trainer.facade import Trainer

# Columns post-processing needs that the model must never see.
POSTPROCESS_COLUMNS = ("example_id", "offset_mapping")


class LengthSortedSampler(Sampler[int]):
    """Indices from the longest window to the shortest (stable), so each batch pads to its own longest window.

    ``order`` is the permutation used: row ``k`` of the collected outputs belongs to feature ``order[k]``.
    """

    def __init__(self, lengths: Any) -> None:
        self.order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")

    def __iter__(self) -> Iterator[int]:
        yield from self.order.tolist()

    def __len__(self) -> int:
        return len(self.order)


def _list_column(dataset: Any, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(flat values, row offsets) of a list column of a ``datasets.Dataset``, read from Arrow; None otherwise."""
    import pyarrow as pa

    try:
        column = dataset.with_format("arrow")[name]
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) or column.null_count:
        return None
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy(zero_copy_only=False)
    return values[offsets[0] : offsets[-1]], offsets - offsets[0]


def window_lengths(dataset: Any, input_name: str = "input_ids") -> np.ndarray | None:
    """Tokens per window that are not padding: the attention mask's ones (windows padded to ``max_seq_length``
    count their real tokens), else the windows' lengths; None when the dataset has neither as a list column."""
    mask = _list_column(dataset, "attention_mask")
    if mask is not None:
        values, offsets = mask
        summed = np.add.reduceat(values.astype(np.int64), offsets[:-1]) if values.size else np.zeros(0, np.int64)
        return np.where(np.diff(offsets) > 0, summed, 0)  # reduceat gives a neighbour's value for an empty row
    ids = _list_column(dataset, input_name)
    return None if ids is None else np.diff(ids[1])


def trim_right_padding(inputs: dict[str, Any]) -> dict[str, Any]:
    """Cut a right-padded batch after its longest window's last real token (``attention_mask``): windows padded to
    ``max_seq_length`` then cost what dynamically padded ones do. Padding sits after every real token and is
    masked, so the real tokens' logits do not depend on it; dropped columns are masked before post-processing."""
    mask = inputs.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or mask.shape[1] == 0:
        return inputs
    width = mask.shape[1]
    keep = max(1, int(mask.sum(dim=1).max()))
    if keep == width or bool(mask[:, keep:].any()):  # nothing to cut, or not right padding (real tokens after it)
        return inputs
    return {
        k: v[:, :keep] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == width else v for k, v in inputs.items()
    }


def _restore_order(value: Any, order: np.ndarray) -> Any:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return type(value)(_restore_order(v, order) for v in value)
    restored = np.empty_like(value)
    restored[order] = value[: len(order)]
    return restored


# Logit given to positions outside a window (padding): far below any real score, finite so sums stay finite.
PAD_LOGIT = -1.0e4


def _valid_positions(features: Any, width: int) -> np.ndarray:
    """[windows, width]: the attention mask of each window (False past its end)."""
    flat = _list_column(features, "attention_mask")
    if flat is None:  # not Arrow-backed: row by row
        masks = features["attention_mask"]
        valid = np.zeros((len(masks), width), dtype=bool)
        for row, mask in enumerate(masks):
            valid[row, : len(mask)] = np.asarray(mask[:width], dtype=bool)
        return valid
    values, offsets = flat
    lengths = np.diff(offsets)
    rows = np.repeat(np.arange(lengths.size), lengths)
    position = np.arange(values.size) - np.repeat(offsets[:-1], lengths)
    inside = position < width
    valid = np.zeros((lengths.size, width), dtype=bool)
    valid[rows[inside], position[inside]] = values[inside].astype(bool)
    return valid


def mask_padding_logits(predictions: Any, features: Any) -> Any:
    """Set the start/end logits of padding positions (``attention_mask == 0``, or beyond the window) to
    ``PAD_LOGIT``. Padding is never an answer; without this, padding positions can take n-best slots, and the
    answers would depend on how far windows were padded (to 384, or to their batch's longest window)."""
    columns = getattr(features, "column_names", None) or []
    if "attention_mask" not in columns or not isinstance(predictions, (tuple, list)):
        return predictions
    valid = _valid_positions(features, max(np.shape(p)[1] for p in predictions))
    masked = []
    for logits in predictions:
        logits = np.array(logits, copy=True)
        logits[~valid[:, : logits.shape[1]]] = PAD_LOGIT
        masked.append(logits)
    return type(predictions)(masked)


def left_padding_alignment(features: Any, processing_class: Any) -> str | int | None:
    """How to undo the collator's left padding, so that logit column ``j`` is token ``j`` of its window (the
    position ``offset_mapping`` describes). ``None``: nothing to undo (right padding, or no tokenizer).
    ``"mask"``: the windows hold no padding of their own, so a row's padding is its attention mask's zeros.
    An ``int``: every window is that long (padded to ``max_seq_length`` on the left already), so the collator
    added ``batch width - length``. Windows of different lengths *and* their own padding cannot be realigned."""
    if getattr(processing_class, "padding_side", "right") != "left":
        return None
    columns = getattr(features, "column_names", None) or []
    if "input_ids" not in columns or "attention_mask" not in columns:
        return None
    masks = features["attention_mask"]
    if all(all(m) for m in masks):
        return "mask"
    lengths = {len(m) for m in masks}
    if len(lengths) == 1:
        return lengths.pop()
    raise ValueError(
        "MRCTrainer: the tokenizer pads on the left and the evaluation windows differ in length while some "
        "already contain padding, so the collator's padding cannot be told apart from the windows' own. Build "
        "them with prepare_validation_features(..., pad_to_max_length=True) (all windows padded) or False (none)."
    )


def shift_out_left_padding(logits: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Move row ``i`` of ``logits`` (batch, width, ...) left by ``shifts[i]`` columns; vacated columns get
    ``PAD_LOGIT``."""
    width = logits.shape[1]
    positions = torch.arange(width, device=logits.device)
    index = (positions[None, :] + shifts[:, None]).clamp(max=width - 1)
    vacated = positions[None, :] >= (width - shifts)[:, None]
    extra = (1,) * (logits.dim() - 2)
    moved = logits.gather(1, index.view(*index.shape, *extra).expand_as(logits))
    return moved.masked_fill(vacated.view(*vacated.shape, *extra), PAD_LOGIT)


def squad_post_process_function(
    version_2_with_negative: bool = False,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    null_score_diff_threshold: float = 0.0,
    output_dir: str | None = None,
    answer_column: str = "answers",
) -> Callable[..., EvalPrediction]:
    """The default ``post_process_function(examples, features, predictions, stage)``: answers (with a real
    no-answer probability for SQuAD 2.0) and references in ``squad_metrics``' format, as an ``EvalPrediction``;
    with ``output_dir``, also ``{stage}_predictions.json``, ``{stage}_nbest_predictions.json`` (and
    ``{stage}_null_odds.json``) as HF's run_qa writes them."""

    def post_process(examples: Any, features: Any, predictions: Any, stage: str = "eval") -> EvalPrediction:
        result = postprocess_qa_predictions_with_scores(
            examples,
            features,
            predictions,
            version_2_with_negative=version_2_with_negative,
            n_best_size=n_best_size,
            max_answer_length=max_answer_length,
            null_score_diff_threshold=null_score_diff_threshold,
            output_dir=output_dir,
            prefix=stage,
        )
        references = None
        columns = getattr(examples, "column_names", None) or []
        if answer_column in columns:
            references = [{"id": i, "answers": a} for i, a in zip(examples["id"], examples[answer_column])]
        return EvalPrediction(predictions=result.to_squad_predictions(), label_ids=references)

    return post_process


def squad_compute_metrics(version_2_with_negative: bool = False) -> Callable[[EvalPrediction], dict]:
    """``compute_metrics`` for the default post-processing: SQuAD v1.1 or v2.0 scores."""

    def compute(prediction: EvalPrediction) -> dict:
        return squad_metrics(prediction.predictions, prediction.label_ids, version_2_with_negative)

    return compute


class MRCTrainer(Trainer):
    """The facade with HF's QuestionAnsweringTrainer / PrimeQA MRCTrainer evaluation.

    Args:
        eval_examples: the questions (``id``, ``context``, ``answers``) behind ``eval_dataset``'s windows.
        eval_dataset: the windows from ``prepare_validation_features`` (with ``example_id``, ``offset_mapping``).
        post_process_function: ``(examples, features, predictions, stage) -> EvalPrediction``; default:
            ``squad_post_process_function(version_2_with_negative, ...)`` writing into ``args.output_dir``.
        version_2_with_negative, n_best_size, max_answer_length, null_score_diff_threshold: settings of the
            default post-processing (and of the default SQuAD ``compute_metrics``).
        All other arguments are ``hflight.Trainer``'s.
    """

    def __init__(
        self,
        *args: Any,
        eval_examples: Any = None,
        eval_dataset: Any = None,
        post_process_function: Callable[..., EvalPrediction] | None = None,
        version_2_with_negative: bool = False,
        n_best_size: int = 20,
        max_answer_length: int = 30,
        null_score_diff_threshold: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, eval_dataset=eval_dataset, **kwargs)
        self.eval_examples = eval_examples
        if post_process_function is None:
            post_process_function = squad_post_process_function(
                version_2_with_negative,
                n_best_size,
                max_answer_length,
                null_score_diff_threshold,
                output_dir=self.args.output_dir if self.is_world_process_zero() else None,
            )
            if self.compute_metrics is None:
                self.compute_metrics = squad_compute_metrics(version_2_with_negative)
        self.post_process_function = post_process_function
        self._left_padding: str | int | None = None  # set per evaluate()/predict() call

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = trim_right_padding(inputs)
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        mask = inputs.get("attention_mask")
        if self._left_padding is None or logits is None or mask is None:
            return loss, logits, labels
        width = mask.shape[1]
        lengths = mask.sum(dim=1) if self._left_padding == "mask" else torch.full_like(mask[:, 0], self._left_padding)
        shifts = (width - lengths).to(torch.long)

        def realign(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return type(value)(realign(v) for v in value)
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == width:
                return shift_out_left_padding(value, shifts)
            return value

        return loss, realign(logits), labels

    # ---- loaders: windows sorted by length, post-processing columns never reach the model ----------------------
    def _model_inputs(self, dataset: Any) -> Any:
        present = [c for c in POSTPROCESS_COLUMNS if c in getattr(dataset, "column_names", [])]
        return dataset.remove_columns(present) if present else dataset

    def _get_eval_sampler(self, eval_dataset: Any) -> Sampler[int]:
        input_name = getattr(self.model, "main_input_name", "input_ids")
        lengths = window_lengths(eval_dataset, input_name)
        if lengths is None:
            try:
                lengths = [len(ids) for ids in eval_dataset[input_name]]
            except (KeyError, TypeError):
                return super()._get_eval_sampler(eval_dataset)
        return LengthSortedSampler(lengths)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("MRCTrainer: evaluation requires an eval_dataset (the validation windows).")
        return super().get_eval_dataloader(self._model_inputs(dataset))

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        return super().get_test_dataloader(self._model_inputs(test_dataset))

    # ---- evaluation ------------------------------------------------------------------------------------------------
    def _logits_for(self, features: Any, dataloader: DataLoader, description: str, ignore_keys: Any, prefix: str):
        self._left_padding = left_padding_alignment(features, self.processing_class)
        try:
            output = self.evaluation_loop(
                dataloader,
                description,
                prediction_loss_only=False,
                ignore_keys=ignore_keys,
                metric_key_prefix=prefix,
                compute_metrics=None,
            )
        finally:
            self._left_padding = None
        sampler = getattr(dataloader, "sampler", None)
        sampler = getattr(getattr(dataloader, "batch_sampler", None), "sampler", sampler)
        if isinstance(sampler, LengthSortedSampler):
            output = output._replace(
                predictions=_restore_order(output.predictions, sampler.order),
                label_ids=_restore_order(output.label_ids, sampler.order),
            )
        return output

    def _scored(self, output: Any, examples: Any, features: Any, stage: str, prefix: str, start: float):
        if examples is None:
            raise ValueError(
                f"MRCTrainer: {stage} needs the examples behind the windows (eval_examples / "
                "predict_examples) to turn logits into answers."
            )
        logits = mask_padding_logits(output.predictions, features)
        predictions = self.post_process_function(examples, features, logits, stage)
        metrics: dict[str, float] = {}
        if self.compute_metrics is not None and predictions.label_ids is not None:
            metrics = dict(self.compute_metrics(predictions))
        prefixed(metrics, prefix)
        metrics.update(output.metrics)  # eval_loss when the windows carry labels
        metrics.update(evaluation_speed(self.args, prefix, start, output.num_samples))
        return predictions, metrics

    def evaluate(
        self,
        eval_dataset: Any = None,
        eval_examples: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        features = eval_dataset if eval_dataset is not None else self.eval_dataset
        examples = eval_examples if eval_examples is not None else self.eval_examples
        start = time.time()
        loader = self.get_eval_dataloader(features)
        output = self._logits_for(features, loader, "Evaluation", ignore_keys, metric_key_prefix)
        _, metrics = self._scored(output, examples, features, "eval", metric_key_prefix, start)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(
        self,
        predict_dataset: Any,
        predict_examples: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> PredictionOutput:
        start = time.time()
        loader = self.get_test_dataloader(predict_dataset)
        output = self._logits_for(predict_dataset, loader, "Prediction", ignore_keys, metric_key_prefix)
        predictions, metrics = self._scored(
            output, predict_examples, predict_dataset, "predict", metric_key_prefix, start
        )
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics)
        return PredictionOutput(predictions=predictions.predictions, label_ids=predictions.label_ids, metrics=metrics)


QuestionAnsweringTrainer = MRCTrainer

__all__ = [
    "LengthSortedSampler",
    "trim_right_padding",
    "window_lengths",
    "MRCTrainer",
    "QuestionAnsweringTrainer",
    "left_padding_alignment",
    "mask_padding_logits",
    "shift_out_left_padding",
    "squad_compute_metrics",
    "squad_post_process_function",
]
