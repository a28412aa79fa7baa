"""Where a model spec's files come from: a local folder, or a Hugging Face hub id resolved into the standard HF cache.

A hub id is resolved once, on the driver, when the spec is built (``huggingface_hub.snapshot_download``: the cache
honours ``HF_HOME`` / ``HF_HUB_CACHE``, a pinned ``revision`` and ``HF_HUB_OFFLINE``). The spec carries the resolved
folder when it is pickled to the workers, and a process that receives a spec without one reads the cache only:
workers never download. ``screl check`` asks :func:`model_source_problem` and downloads nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name``: a hub model id (a path that exists on disk is always read as a path)."""

_DOWNLOADS = [True]


@contextlib.contextmanager
def no_downloads() -> Iterator[None]:
    """Within it, specs built here read the cache only and a miss is left for :func:`model_source_problem` to
    report (``screl check`` downloads nothing)."""
    _DOWNLOADS.append(False)
    try:
        yield
    finally:
        _DOWNLOADS.pop()


IGNORED = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.tflite", "*.pth", "original/*", "onnx/*",
           "coreml/*", "openvino/*", "*.gguf"]
"""Files of a model repository no transformers load here reads (TF/Flax/ONNX exports, raw checkpoints, GGUF unless
asked for)."""


def hub_cache() -> str:
    """The folder the hub's files are cached in (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_hub_id(path: str) -> bool:
    """Whether ``path`` names a hub repository rather than a folder on disk."""
    return not os.path.exists(path) and HUB_ID.match(path) is not None


def _where(repo_id: str, revision: str | None) -> str:
    return f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")


def resolve_model_dir(path: str, *, owner: str, key: str = "path", revision: str | None = None,
                      download: bool = True, gguf_file: str | None = None) -> str:
    """The local folder of ``path``: ``path`` itself when it is a folder; a hub id's snapshot in the HF cache,
    downloaded when ``download`` and the hub is reachable (``HF_HUB_OFFLINE`` unset). Errors name the key, the id,
    the cache folder and the fix."""
    if os.path.isdir(path):
        return path
    if not is_hub_id(path):
        raise FileNotFoundError(f"{owner}: {key}={path!r} is neither a local directory nor a hub id ('org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    ignore = [p for p in IGNORED if not (gguf_file and p == "*.gguf")]
    try:
        return str(snapshot_download(path, revision=revision, ignore_patterns=ignore,
                                     local_files_only=not download))
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(f"{owner}: {key}={_where(path, revision)} is no local directory, and as a hub id it "
                                f"is not in the Hugging Face cache {hub_cache()}{_offline_hint(download)}") from err
    except RevisionNotFoundError as err:
        raise FileNotFoundError(f"{owner}: {key}={path!r} has no revision {revision!r} on the hub; pin a "
                                "branch, tag or commit that exists") from err
    except RepositoryNotFoundError as err:
        raise FileNotFoundError(f"{owner}: {key}={path!r} is not a model on the hub (or a private or gated one: "
                                "log in with `hf auth login` or set HF_TOKEN)") from err


def _offline_hint(download: bool) -> str:
    if hub_offline():
        return (" and HF_HUB_OFFLINE=1 forbids a download: fetch it once with `hf download <id>` on a machine "
                "online (same HF_HOME), or unset HF_HUB_OFFLINE")
    if not download:
        return (" (a worker never downloads: the driver resolves hub ids when it builds the spec; on several "
                "nodes, give HF_HOME a shared filesystem or pre-fetch the model on each node)")
    return " and the hub could not be reached to download it"


def model_source_problem(path: str, *, revision: str | None = None) -> str | None:
    """Why ``path`` cannot be loaded (None when it can), without downloading anything: a folder is fine; a hub id
    must be in the cache, or (online) exist on the hub at ``revision``."""
    if os.path.isdir(path):
        return None
    if not is_hub_id(path):
        return "is neither a local directory nor a hub id ('org/name')"
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        snapshot_download(path, revision=revision, local_files_only=True, ignore_patterns=IGNORED)
        return None
    except LocalEntryNotFoundError:
        if hub_offline():
            return (f"{_where(path, revision)} is not in the Hugging Face cache {hub_cache()} and HF_HUB_OFFLINE=1 "
                    "forbids a download")
    try:
        HfApi().model_info(path, revision=revision, timeout=10)
        return None  # online and it exists: `screl fit` downloads it on the driver
    except RevisionNotFoundError:
        return f"has no revision {revision!r} on the hub"
    except RepositoryNotFoundError:
        return "is not a model on the hub (or a private or gated one: set HF_TOKEN)"
    except Exception as err:  # noqa: BLE001 - any network failure: the id cannot be checked, so it cannot be loaded
        return (f"{_where(path, revision)} is not in the Hugging Face cache {hub_cache()} and the hub could not be "
                f"reached ({type(err).__name__})")


class HubFiles:
    """For a spec whose files are a local folder or a hub id (``path``, ``revision``): the folder, resolved once."""

    path: str
    revision: str | None

    def _resolve_sources(self, *keys: str, gguf_file: str | None = None) -> None:
        """Resolve each of ``keys`` (attributes holding a folder or a hub id) that is a hub id, downloading if needed:
        called where the spec is built, i.e. on the driver."""
        download = _DOWNLOADS[-1]
        for key in keys:
            value = getattr(self, key)
            if not (isinstance(value, str) and is_hub_id(value)):
                continue
            try:
                self.__dict__[f"_local_{key}"] = resolve_model_dir(value, owner=type(self).__name__, key=key,
                                                                   revision=self.revision, gguf_file=gguf_file,
                                                                   download=download)
            except FileNotFoundError:
                if download:
                    raise  # under no_downloads() a miss is the config rules' to report, with every other problem

    def local_dir(self, key: str = "path") -> str:
        """The local folder of ``key``: resolved on the driver, or found in this process's cache (never downloaded
        here)."""
        local = self.__dict__.get(f"_local_{key}")
        if local is not None:
            return str(local)
        return resolve_model_dir(getattr(self, key), owner=type(self).__name__, key=key, revision=self.revision,
                                 download=False)
