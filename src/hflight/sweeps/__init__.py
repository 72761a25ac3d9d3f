"""Sweeps that outgrow one process: hflight's Optuna search (``hydra/sweeper=optuna``, registered by
``hydra_plugins.hflight_optuna_sweeper``) with its study in a database, pruning, heartbeats and continued searches,
and what a job needs to know about the launcher running it.

- :mod:`hflight.sweeps.search_space`: Hydra's sweep grammar as Optuna distributions.
- :mod:`hflight.sweeps.study`: the storage, the study's checks, the results and pictures of a search.
- :mod:`hflight.sweeps.sweeper`: the search loop (:class:`~hflight.sweeps.sweeper.OptunaSearch`).
- :mod:`hflight.sweeps.trial`: the job's side: its trial, reported to at every evaluation, and pruning.
- :mod:`hflight.sweeps.launchers`: CPU threads per job under a parallel launcher.
- :mod:`hflight.sweeps.summary`: ``summary.csv``/``summary.md`` of any multirun (a Hydra callback, whatever the
  sweeper), also written by the search when it stops early.

Needs ``pip install "hflight[sweeps]"`` (Optuna, Hydra's joblib and submitit launchers, psutil); only
:mod:`~hflight.sweeps.trial`, :mod:`~hflight.sweeps.launchers` and :mod:`~hflight.sweeps.summary` are imported
without it.

May import: ``hflight.checkpoints.manifest`` (a retried trial continues from the interrupted job's last checkpoint).
The CLI imports the job's side (``trial``, ``launchers``), never the search; Hydra instantiates the summary's
callback from ``conf/hydra/default.yaml``.
"""
