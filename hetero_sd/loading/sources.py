"""Turning what the user typed as --target/--draft into a local HF-format folder."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hetero_sd.errors import ModelNotFoundError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def resolve_target(spec: str) -> Path:
    if spec == "default":
        from .default_model import default_target_folder
        return default_target_folder()
    return resolve_folder(spec, "target")


def source_gguf(spec: str) -> str | None:
    """The GGUF file a target came from, if any (for peers that run GGUF, like llama.cpp)."""
    if spec == "default":
        from .default_model import embedded_gguf
        return str(embedded_gguf())
    path = Path(spec).expanduser()
    return str(path) if path.suffix == ".gguf" and path.is_file() else None


def resolve_folder(spec: str, role: str) -> Path:
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"{role} GGUF file {path} does not exist", "check the path")
        from .default_model import gguf_folder
        return gguf_folder(path)
    if path.is_dir():
        return path
    if HUB_ID.match(spec):
        return hub_snapshot(spec, role)
    raise ModelNotFoundError(f"{role} {spec!r} is not a folder, a .gguf file or a hub id",
                             "give a folder with config.json, a .gguf file, org/name, or 'default'")


def hub_snapshot(repo_id: str, role: str = "model", download: bool = True, fetching: bool = False) -> Path:
    """A hub repo through huggingface-hub's cache: downloaded when missing, read from the cache only
    when HF_HUB_OFFLINE=1 (huggingface-hub honours it) or download=False. fetching: called by
    `hetero-sd fetch`, whose failure must not advise running `hetero-sd fetch` again."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS,
                                      local_files_only=not download))
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        raise ModelNotFoundError(
            f"{role} {repo_id!r} is not in the local hub cache"
            + (" and HF_HUB_OFFLINE is set" if offline else " and the hub could not be reached" if download else ""),
            offline_fix(repo_id, fetching, offline)) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not download {role} {repo_id!r} ({type(e).__name__}: {e})",
                                 "check the repo id and the network, or copy the folder and pass its path"
                                 ) from None


def offline_fix(repo_id: str, fetching: bool, offline: bool) -> str:
    if not fetching:
        return f"run `hetero-sd fetch {repo_id}` where the hub is reachable (or set HF_HUB_CACHE)"
    if offline:
        return "unset HF_HUB_OFFLINE so that it can be downloaded, or copy the model folder here and pass its path"
    return "check the network connection to huggingface.co, or copy the model folder here and pass its path"
