"""A folder of class folders of images (``root/<class>/<image>``), read with PIL (extra ``files``).

Columns: ``image`` float32 (N, C, H, W) in [0, 1] (grey images have C = 1), ``label`` the class
folder's name. Every image must have the size and channels of the first.
"""

from __future__ import annotations

import os

import numpy as np

from fedweave.errors import TaskError
from fedweave.task.sources.table import Columns

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def read(path: str) -> Columns:
    try:
        from PIL import Image
    except ImportError as exc:
        raise TaskError("format imagefolder needs Pillow: pip install 'fedweave[files]'") from exc
    images: list[np.ndarray] = []
    labels: list[str] = []
    for name in sorted(e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e))):
        folder = os.path.join(path, name)
        for file in sorted(f for f in os.listdir(folder) if f.lower().endswith(SUFFIXES)):
            with Image.open(os.path.join(folder, file)) as image:
                pixels = np.asarray(image)
            pixels = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
            if images and pixels.shape != images[0].shape:
                raise TaskError(
                    f"{os.path.join(folder, file)}: an image of shape {pixels.shape}, the first is {images[0].shape}"
                )
            images.append(pixels)
            labels.append(name)
    if not images:
        raise TaskError(f"{path}: no images in class folders (<class>/<image>{SUFFIXES[0]})")
    return {"image": np.stack(images).astype(np.float32) / np.float32(255), "label": np.asarray(labels)}
