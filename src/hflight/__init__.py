"""hflight: the Hugging Face Trainer API on PyTorch Lightning."""

__version__ = "0.1.0"
