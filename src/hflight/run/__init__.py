"""The Lightning side of one ``train()``, or of one ``evaluate()``/``predict()`` outside training.

``run.Run`` builds the ``lightning.Trainer``, the ``module.HFModule`` and the ``datamodule.HFDataModule`` for a call,
and owns the ``loop.TrainingLoop`` (HF's training loop: plan, resume position, loss bookkeeping, log/save/evaluate
decisions, stops, finishing). ``events`` has the one dispatcher of HF events (:func:`events.dispatch`) and the thin
Lightning ``Callback`` that maps Lightning's hooks onto the loop. Beside them: ``evaluation`` (HF's evaluation loop
on Lightning's validate loop), ``samplers`` and ``loaders`` (loaders dealt to the processes as accelerate deals them),
``plan`` (steps and epochs), ``distributed`` (rank, world, collectives),
``interrupt`` (SIGTERM/SIGINT, SLURM's requeue signal), ``cluster`` (the requeue itself, torchrun's restarts,
Lightning's SLURM checkpoints kept out), ``backend`` (the hooks through which a strategy changes a step), ``console``.

May import: ``hflight.arguments``, ``hflight.checkpoints``, ``hflight.callbacks``, ``hflight.surface``,
``hflight._util``; never the facade (``hflight.trainer``), the CLI or a backend package: a backend joins through
``backend.HFBackend`` and Lightning's registries.
"""
