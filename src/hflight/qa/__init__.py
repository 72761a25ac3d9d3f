"""Extractive question answering (MRC) on top of the hflight facade.

The names below are imported from their modules on first use (PEP 562), so ``from hflight.qa import
squad_metrics`` loads the metrics module only, and ``from hflight.qa import MRCTrainer`` the trainer:

* ``MRCTrainer`` / ``QuestionAnsweringTrainer`` (``hflight.qa.trainer``): evaluation that ends in answers and
  SQuAD scores;
* ``QuestionAnsweringSeq2SeqTrainer`` (``hflight.qa.seq2seq_trainer``): generative QA, as run_seq2seq_qa.py;
* ``load_squad_json``, ``SquadFormatError`` (``hflight.qa.data``): validated SQuAD v1.1/v2.0 loading;
* ``prepare_train_features``, ``prepare_validation_features`` (``hflight.qa.preprocess``): run_qa.py's windows;
* ``postprocess_qa_predictions`` and friends (``hflight.qa.postprocess``): logits to answers, as HF's utils_qa;
* ``squad_metrics``, ``SquadMetric`` (``hflight.qa.metrics``): the official SQuAD scores;
* ``MRCRecipe`` (``hflight.qa.recipe``): what ``python train.py +experiment=mrc`` builds; ``hflight.qa.made``: the
  data and tokenizer it makes in a run folder, reused when a restarted run asks for them again.

May import: data, features, post-processing and metrics nothing of hflight but ``hflight.surface``/``hflight._util``
(no Lightning); the QA trainers the facade (``hflight.trainer``) and the run; the recipe the facade, the arguments,
the callbacks and the config.

Example:
    >>> from hflight.qa import squad_metrics
    >>> squad_metrics([{"id": "q", "prediction_text": "Denver Broncos"}],
    ...               [{"id": "q", "answers": {"text": ["Denver Broncos"], "answer_start": [0]}}])
    {'exact_match': 100.0, 'f1': 100.0}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hflight._util import lazy_exports

_EXPORTS = {
    "MRCTrainer": "hflight.qa.trainer",
    "QuestionAnsweringTrainer": "hflight.qa.trainer",
    "QuestionAnsweringSeq2SeqTrainer": "hflight.qa.seq2seq_trainer",
    "load_squad_json": "hflight.qa.data",
    "SquadFormatError": "hflight.qa.data",
    "LoadReport": "hflight.qa.data",
    "prepare_train_features": "hflight.qa.preprocess",
    "prepare_validation_features": "hflight.qa.preprocess",
    "postprocess_qa_predictions": "hflight.qa.postprocess",
    "postprocess_qa_predictions_with_scores": "hflight.qa.postprocess",
    "compute_qa_predictions": "hflight.qa.postprocess",
    "write_qa_predictions": "hflight.qa.postprocess",
    "QAPostprocessResult": "hflight.qa.postprocess",
    "squad_metrics": "hflight.qa.metrics",
    "SquadMetric": "hflight.qa.metrics",
    "MRCRecipe": "hflight.qa.recipe",
}

__all__ = [
    "LoadReport",
    "MRCRecipe",
    "MRCTrainer",
    "QAPostprocessResult",
    "QuestionAnsweringSeq2SeqTrainer",
    "QuestionAnsweringTrainer",
    "SquadFormatError",
    "SquadMetric",
    "compute_qa_predictions",
    "load_squad_json",
    "postprocess_qa_predictions",
    "postprocess_qa_predictions_with_scores",
    "prepare_train_features",
    "prepare_validation_features",
    "squad_metrics",
    "write_qa_predictions",
]

if TYPE_CHECKING:
    from hflight.qa.data import LoadReport, SquadFormatError, load_squad_json
    from hflight.qa.metrics import SquadMetric, squad_metrics
    from hflight.qa.postprocess import (
        QAPostprocessResult,
        compute_qa_predictions,
        postprocess_qa_predictions,
        postprocess_qa_predictions_with_scores,
        write_qa_predictions,
    )
    from hflight.qa.preprocess import prepare_train_features, prepare_validation_features
    from hflight.qa.recipe import MRCRecipe
    from hflight.qa.seq2seq_trainer import QuestionAnsweringSeq2SeqTrainer
    from hflight.qa.trainer import MRCTrainer, QuestionAnsweringTrainer


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
