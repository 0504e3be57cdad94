"""Where the files an LLM config names are: relative paths, the Hugging Face cache, and what Serval cannot read.

Serval reads checkpoints, tokenizers and adapters from local files on each node and never downloads them;
a cloud location (``s3://``, ``gs://``, a mirror config) is refused with a message saying so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

# A relative path (model_source, tokenizer_source, adapters, a draft) resolves against the first of these
# holding it: the LLM config's runtime_env.working_dir, the directory the app was built in, the Serval
# checkout (the directory holding deployments/), the files an installed Serval ships (serval/_data: its
# configs/ and assets/; symlinks to the checkout's in a checkout); none holding it, against the first.
SERVAL_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DATA = SERVAL_ROOT / "serval" / "_data"
CLOUD_SCHEMES = ("s3://", "gs://", "abfss://", "azure://", "http://", "https://")


def refuse_cloud_uri(value: Any, key: str) -> Any:
    """``value`` unless it is a cloud location (a URI or a mirror config): Serval reads local files only."""
    if isinstance(value, dict) or (isinstance(value, str) and value.startswith(CLOUD_SCHEMES)):
        raise ValueError(
            f"{key} {value!r}: Serval loads from a local directory on each node (it never downloads); "
            "copy the files there (or into the Hugging Face cache) and give their path."
        )
    return value


def search_bases(working_dir: Any = None) -> tuple[str, ...]:
    """Where relative paths resolve, in order (``SERVAL_ROOT``'s comment); ``working_dir`` counts if local."""
    bases = [os.getcwd(), str(SERVAL_ROOT), str(SHIPPED_DATA)]
    if isinstance(working_dir, str) and "://" not in working_dir:
        bases.insert(0, os.path.abspath(os.path.expanduser(working_dir)))
    return tuple(dict.fromkeys(bases))


def resolve_path(path: str, bases: tuple[str, ...] | None = None) -> str:
    """``path`` with ``~`` expanded; a relative one against the first of ``bases`` holding it, else a Hugging
    Face id's snapshot in the local cache, else against the first base."""
    source = Path(os.path.expanduser(path))
    if source.is_absolute():
        return str(source)
    bases = bases or search_bases()
    for base in bases:
        if (Path(base) / source).exists():
            return str(Path(base) / source)
    return _cached_hf_snapshot(path) or str(Path(bases[0]) / source)


def _cached_hf_snapshot(repo_id: str) -> str | None:
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=repo_id, local_files_only=True)
    except Exception:  # not cached (or not a valid id): the engine then names the path it could not read
        return None


class ResolvesPaths(BaseModel):
    """A part of an LLM config naming files: its relative paths resolve against the LLM config's bases
    (``search_bases``, fixed where the config is validated: the app's builder), which ``LLMConfig`` sets."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())
    _bases: tuple[str, ...] | None = PrivateAttr(None)

    def resolve(self, path: str) -> str:
        return resolve_path(path, self._bases)
