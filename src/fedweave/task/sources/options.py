"""``task.dataset_options`` of ``task.dataset: files``: where a site's data is and how to read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedweave.errors import ConfigError
from fedweave.schema import opt

FORMATS = ("csv", "parquet", "npz", "jsonl", "imagefolder", "leaf", "hf", "text")
"""The file formats ``task.dataset: files`` reads."""

CLIENT = "{client}"
"""The placeholder of ``path`` replaced by each client's id in a simulation."""

LABEL_DEFAULTS = {"imagefolder": "label", "leaf": "y"}
"""The label column of formats that name it themselves; the others need ``label``."""

FEATURE_DEFAULTS = {"imagefolder": ["image"], "leaf": ["x"]}
"""The feature columns of formats that name them themselves; the others default to every other column."""

Format = Literal["csv", "parquet", "npz", "jsonl", "imagefolder", "leaf", "hf", "text"]


@dataclass
class FileOptions:
    path: str | None = opt(
        None,
        help="a file or folder of training data; in a simulation '{client}' in it is replaced by each client's id "
        "(none: a deployed node, whose client gives its own --data)",
    )
    format: Format | None = opt(
        None,
        help="csv | parquet | npz | jsonl | imagefolder | leaf | hf | text (plain text: a file, or a folder's files "
        "matching pattern; task.kind language_model) (none: from the path's suffix or contents)",
    )
    text: str | None = opt(
        None, help="jsonl of a task.kind language_model: the field holding each record's text (then no label)"
    )
    pattern: str = opt("*", help="text: the names of a folder's files to read (a glob, e.g. '*.py'), in every sub-folder")
    label: str | list[str] | None = opt(
        None,
        help="the label column, field or array (imagefolder: label, leaf: y); task.kind regression or "
        "multilabel: a list of columns gives one target or 0/1 label per column",
    )
    features: list[str] | None = opt(None, help="the feature columns (none: every column but label and the partition's)")
    test_path: str | None = opt(None, help="the central test set, read by the server only (none: no central evaluation)")
    num_classes: int | None = opt(
        None, ge=2, help="classes the model has (none: len(classes), else the data's largest label + 1); not used by "
        "regression and multilabel tasks, whose outputs are their label columns",
    )
    input_shape: list[int] | None = opt(None, help="the shape of one sample the model expects (none: the first file's)")
    classes: list[str] | None = opt(None, help="names of string labels in class-id order (none: the names read, sorted)")
    share_label_counts: bool = opt(False, help="write the clients' label histograms into partition.json")
    split: str = opt("train", help="hf: the split of a DatasetDict folder")

    @property
    def template(self) -> bool:
        """Whether each client of a simulation reads its own file (``{client}`` in ``path``)."""
        return self.path is not None and CLIENT in self.path

    @property
    def per_site(self) -> bool:
        """Whether each client reads only its own file: from the template, or, without a path, the
        one its deployed client names (``--data``)."""
        return self.path is None or self.template

    def path_of(self, client: int) -> str:
        """Client ``client``'s file: ``path`` with its id in place of ``{client}``."""
        assert self.path is not None  # a simulation's (fedweave.task.files.simulation_paths)
        return self.path.replace(CLIENT, str(client))

    def validate(self, prefix: str) -> None:
        for key in ("path", "test_path"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                raise ConfigError(f"config key '{prefix}.{key}': expected a file or folder, got an empty string")
        if self.test_path is not None and CLIENT in self.test_path:
            raise ConfigError(f"config key '{prefix}.test_path': the central test set is one file; drop {CLIENT}")
        if self.text is not None and self.format not in (None, "jsonl"):
            raise ConfigError(f"config key '{prefix}.text': only format jsonl has fields of text")
        reads_text = self.format == "text" or self.text is not None
        if self.format is not None and self.format not in LABEL_DEFAULTS and self.label is None and not reads_text:
            text = " (a language model's jsonl names its text field instead: text)" if self.format == "jsonl" else ""
            raise ConfigError(f"config key '{prefix}.label': format {self.format} needs the label column's name{text}")
        if self.input_shape is not None and (not self.input_shape or min(self.input_shape) < 1):
            raise ConfigError(f"config key '{prefix}.input_shape': expected positive sizes, got {self.input_shape}")
        if self.classes is not None:
            if len(set(self.classes)) != len(self.classes) or len(self.classes) < 2:
                raise ConfigError(f"config key '{prefix}.classes': expected two or more distinct names, got {self.classes}")
            if self.num_classes is not None and self.num_classes != len(self.classes):
                raise ConfigError(
                    f"config key '{prefix}.num_classes': {self.num_classes}, but classes names {len(self.classes)}"
                )
        labels = [self.label] if isinstance(self.label, str) else self.label or []
        if isinstance(self.label, list) and (not self.label or len(set(self.label)) != len(self.label)):
            raise ConfigError(f"config key '{prefix}.label': expected distinct columns, got {self.label}")
        if self.features is not None and (not self.features or set(labels) & set(self.features)):
            raise ConfigError(
                f"config key '{prefix}.features': expected feature columns other than the label, got {self.features}"
            )
