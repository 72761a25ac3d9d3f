"""Result types, transformers' own so code that inspects them keeps working."""

from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, PredictionOutput, TrainOutput

__all__ = ["EvalLoopOutput", "EvalPrediction", "PredictionOutput", "TrainOutput"]
