"""The task: datasets, models, loss and evaluation, and partitioning data across clients.

A task is independent of the strategy: strategies receive its model and data, never build them.
"""

from fedweave.task.datasets import DATASETS, Dataset, load_dataset
from fedweave.task.models import CNN, LOSSES, MLP, MODELS, build_model, evaluate, make_loss
from fedweave.task.partition import SCHEMES, format_summary, partition, split_local, summarize

__all__ = [
    "CNN",
    "DATASETS",
    "Dataset",
    "LOSSES",
    "MLP",
    "MODELS",
    "SCHEMES",
    "build_model",
    "evaluate",
    "format_summary",
    "load_dataset",
    "make_loss",
    "partition",
    "split_local",
    "summarize",
]
