"""Moved to :mod:`hflight.arguments.training_args`; this import path stays."""

from hflight.arguments.training_args import *  # noqa: F401,F403
from hflight.arguments.training_args import __all__ as __all__  # noqa: F401
