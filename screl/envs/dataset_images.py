"""The images of a :class:`~screl.envs.DatasetTask` row (``image_column``): checked when the dataset is read, decoded
where they are used (the rollout worker), never carried in a prompt record.

A cell may hold one image or a list of them, each as a Hugging Face ``Image`` feature (read undecoded: ``{"bytes",
"path"}``), raw encoded bytes (PNG, JPEG, ...), a file path (absolute, or relative to the dataset file's folder), or a
PIL image.
"""

from __future__ import annotations

import io
import os
from typing import Any

ROW_REF = "dataset_row"
"""The metadata key of a prompt record that names its dataset row (``{"split", "index"}``): the images are read from
there on the worker, so the record that travels through the controller holds no image."""


def image_base_dir(path: str) -> str:
    """The folder relative image paths are read from: the dataset file's, the dataset folder, else the working
    directory."""
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    return path if os.path.isdir(path) else os.getcwd()


def _items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _path_of(item: Any, base: str) -> str | None:
    """The file an item names (and does not embed), resolved against ``base``; None when it embeds its bytes."""
    if isinstance(item, dict):
        if item.get("bytes"):
            return None
        item = item.get("path")
    if isinstance(item, str):
        return item if os.path.isabs(item) else os.path.join(base, item)
    return None


def check_images(value: Any, where: str, column: str, base: str) -> None:
    """A clear error naming the row and the column when a cell holds no image, an unsupported value, or a path to no
    file (checked at load, before any work starts; the bytes are decoded on the worker)."""
    items = _items(value)
    if value is None or not items:
        raise ValueError(f"{where} has no image in {column!r} (image_column): every row needs one; fix or remove it")
    for item in items:
        ok = isinstance(item, (bytes, bytearray, str, dict)) or hasattr(item, "convert")
        if isinstance(item, dict):
            ok = bool(item.get("bytes")) or isinstance(item.get("path"), str)
        if not ok:
            raise ValueError(f"{where}: {column!r} (image_column) holds {type(item).__name__}, not an image (a path, "
                             "encoded bytes, a Hugging Face Image feature or a PIL image)")
        path = _path_of(item, base)
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"{where}: the image {path!r} in {column!r} (image_column) does not exist "
                                    f"(relative paths are read from {base!r})")


def decode_images(value: Any, base: str) -> list[Any]:
    """The cell's images as PIL ``RGB`` images."""
    from PIL import Image

    out = []
    for item in _items(value):
        if hasattr(item, "convert"):
            image = item
        elif isinstance(item, (bytes, bytearray)):
            image = Image.open(io.BytesIO(item))
        elif isinstance(item, dict) and item.get("bytes"):
            image = Image.open(io.BytesIO(item["bytes"]))
        else:
            path = _path_of(item, base)
            assert path is not None, f"not an image: {item!r}"
            image = Image.open(path)
        out.append(image.convert("RGB"))
    return out


def undecoded(ds: Any, column: str) -> Any:
    """``ds`` with ``column`` read as ``{"bytes", "path"}`` when it is a Hugging Face ``Image`` feature (so reading the
    rows decodes no image)."""
    import datasets

    feature = ds.features.get(column)
    if isinstance(feature, datasets.Image) and feature.decode:
        return ds.cast_column(column, datasets.Image(decode=False))
    if isinstance(feature, list) and feature and isinstance(feature[0], datasets.Image) and feature[0].decode:
        return ds.cast_column(column, [datasets.Image(decode=False)])
    return ds
