"""The facade: ``hflight.Trainer``, transformers' public ``Trainer`` surface, assembled from one part per topic.

``facade.Trainer`` wires the parts and is the only owner of its private state; ``seq2seq.Seq2SeqTrainer`` is
transformers' ``Seq2SeqTrainer`` on it (generation in ``evaluate``/``predict``). Each other module is one topic of
transformers' surface, as a mixin or as functions the facade calls: ``data`` (data loaders, samplers, unused
columns), ``steps`` (``compute_loss``, ``training_step``, ``prediction_step``, items in a batch), ``optim``
(``create_optimizer``/``create_scheduler``), ``hpsearch``, ``hub``, ``construction`` (checks and attributes of
``__init__``), ``accelerator`` (the ``trainer.accelerator`` stand-in), ``memory`` (``auto_find_batch_size``),
``model_hooks`` (debug and NEFTune hooks while training).

May import: ``hflight.run``, ``hflight.arguments``, ``hflight.checkpoints``, ``hflight.callbacks``,
``hflight.surface``, ``hflight._util``. Nothing below imports this package, except the backends' compat trainers
(``hflight.ipu.trainer``, ``hflight.ort.trainer``) and the QA trainers, which subclass the facade.
"""

from hflight.trainer.facade import Trainer
from hflight.trainer.seq2seq import Seq2SeqTrainer

__all__ = ["Seq2SeqTrainer", "Trainer"]
