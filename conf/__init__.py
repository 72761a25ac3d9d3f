"""hflight's Hydra config tree, installed as the package ``hflight.conf`` (Hydra's ``pkg://hflight.conf``).

In a checkout it is the top-level ``conf/`` folder; setup.py maps it into the package so that a regular install
(``pip install hflight``, a wheel) finds it from any folder. Only the YAML files matter; this file makes the folder
a package Hydra can read resources from.
"""
