"""Supervised fine-tuning of a causal language model with TRL's ``SFTTrainer`` on hflight (``hflight.trl``): the
Hydra recipe of ``python train.py +experiment=sft_lora`` (:mod:`hflight.sft.recipe`) and the word-level tokenizer it
trains when no pretrained one is named (:mod:`hflight.sft.tokenizer`).

May import: ``hflight.trl`` (the trainer), ``hflight.qa`` (SQuAD-format data, its checks, the run folder's records of
what made its files), ``hflight.arguments`` and ``hflight.config`` (the run's arguments and the data schema).
"""
