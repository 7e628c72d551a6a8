"""posttrain: post-training for language models, from a laptop CPU to a GPU cluster."""

__version__ = "0.1.0"
