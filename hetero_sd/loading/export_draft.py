"""`hetero-sd export-draft`: a DFlash draft of ours in the layouts other runtimes load.

- `zlab`: config.json + model.safetensors exactly as z-lab's checkpoints (what vLLM, SGLang, z-lab's
  `DFlashDraftModel.from_pretrained` and the MLX ports read). Nothing of ours comes along: those runtimes
  run the draft with the target's full head and full blocks, as they run z-lab's drafts.
- `mlx`: the same two files with every key the MLX ports' readers index directly made explicit
  (dflash_config.target_layer_ids and mask_token_id: z-lab's `model_mlx.load_draft` and dflash-mlx read them
  without a default).
- `gguf`: one .gguf file made by llama.cpp's own converter (convert_hf_to_gguf.py, whose DFlashModel
  takes the tokenizer from the target's folder), as `llama-speculative-simple --spec-type draft-dflash`
  and `llama-server` load it. The converter is the one beside a build of benchmarks/build_llama_cpp.sh,
  else the same file taken from llama-cpp-python's sdist (downloaded once with pip, nothing compiled).
- `hetero-sd`: our own layout (z-lab's files + draft_format.EXTENSION), e.g. to rewrite an older draft
  that kept the reduced head's ids inside model.safetensors; the card and lookup files come along.

Every export is read back by the reader it is made for before the command reports success where that
reader is here (ours; z-lab's package and gguf-py in tests/test_export_draft.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from hetero_sd.errors import ConfigError, ModelNotFoundError, OutputPathError
from hetero_sd.home import home
from hetero_sd.models.config import DraftConfig, fallback_layer_ids
from hetero_sd.models.draft_format import read_config, read_tensors, split_layout, write_folder

FORMATS = ("zlab", "gguf", "mlx", "hetero-sd")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
# llama-cpp-python's sdist vendors llama.cpp; this one's converter knows DFlash (conversion/qwen.py: DFlashModel),
# the same version benchmarks/build_llama_cpp.sh builds
LLAMA_CPP_PYTHON = "0.3.36"
SIDE_FILES = ("training.json", "held_out.json", "draft_vocab.json", "lookup_corpus.json", "lookup_corpus.npz")


def draft_folder(name: str) -> Path:
    """A draft folder, or a shipped draft's name (cpu-trained)."""
    from .loader import SHIPPED_DRAFTS, shipped

    folder = Path(str(shipped(name))) if name in SHIPPED_DRAFTS and shipped(name) else Path(name).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"draft {name!r}: no draft folder (config.json) there",
                                 f"give a DFlash draft folder or a shipped draft name ({', '.join(SHIPPED_DRAFTS)})")
    return folder


def export_draft(src: Path, to: str, out: Path, *, target: str = "default", outtype: str = "f32",
                 say=print) -> dict:
    """Write the draft in `src` as `to` at `out` (a new folder; for gguf a .gguf file); returns a report."""
    if to not in FORMATS:
        raise ConfigError(f"--to {to!r} is not an export format", f"use one of {', '.join(FORMATS)}")
    out = Path(out).expanduser()
    if out.exists() and (out.is_file() or any(out.iterdir())):
        raise OutputPathError(f"--out {out} exists and is not empty", "give a new path")
    raw = read_config(src)  # either layout
    cfg = DraftConfig.from_dict(raw, str(src / "config.json"))
    tensors = read_tensors(src, cfg)
    config, weights, ours = split_layout(raw, tensors)
    report = {"source": str(src), "format": to, "out": str(out), "tensors": len(weights)}
    if to == "hetero-sd":
        write_folder(out, raw, tensors)
        for name in SIDE_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, out / name)
        read_tensors(out, DraftConfig.from_folder(out))  # reads back as the same draft
        return report | {"extension": ours is not None}
    if ours is not None:
        report["left_behind"] = left_behind(ours)
    if to == "mlx":
        config = explicit(config, cfg, src, weights["fc.weight"].shape[1] // cfg.arch.hidden_size)
    if to in ("zlab", "mlx"):
        write_folder(out, config, weights)
        return report
    if outtype not in GGUF_TYPES:
        raise ConfigError(f"--outtype {outtype!r} is not one the converter writes", f"use one of {', '.join(GGUF_TYPES)}")
    if out.suffix != ".gguf":
        raise OutputPathError(f"--out {out} for a GGUF export does not end in .gguf", "name the file DRAFT.gguf")
    from .sources import resolve_target

    with tempfile.TemporaryDirectory(prefix="hetero-sd-export-") as tmp:
        folder = Path(tmp) / src.name  # the converter names the model after its folder
        write_folder(folder, config, weights)
        convert(folder, resolve_target(target), out, outtype, say)
    return report | {"target": target, "outtype": outtype, "converter": str(converter(say=None))}


def left_behind(ours: dict) -> list[str]:
    """What of ours another runtime does not apply, in words (they run the draft without it)."""
    out = []
    if ours.get("draft_vocab") is not None:
        out.append(f"the reduced head ({len(ours['draft_vocab'])} ids): the draft scores the target's full head there")
    if ours.get("short_blocks"):
        out.append("short blocks: a shorter block runs all block_size rows there, as z-lab's drafts do")
    return out


def explicit(config: dict, cfg: DraftConfig, src: Path, features: int) -> dict:
    """config with target_layer_ids and mask_token_id in dflash_config (MLX readers take no defaults);
    features: how many target layers fc reads."""
    inside = dict(config.get("dflash_config") or {})
    if "mask_token_id" not in inside and config.get("mask_token_id") is None:
        raise ConfigError(f"{src}: the draft names no mask_token_id (this runtime takes the tokenizer's <|MASK|>)",
                          "add dflash_config.mask_token_id (the id of <|MASK|>) to its config.json")
    inside.setdefault("mask_token_id", config.get("mask_token_id"))
    if "target_layer_ids" not in inside:
        layers = config.get("target_layer_ids")
        if layers is None and cfg.num_target_layers:  # the reference's rule, as this runtime applies it
            layers = fallback_layer_ids(cfg.num_target_layers, features)
        if layers is None:
            raise ConfigError(f"{src}: the draft names neither target_layer_ids nor num_target_layers",
                              "add dflash_config.target_layer_ids to its config.json")
        inside["target_layer_ids"] = list(layers)
    return {k: v for k, v in config.items() if k not in ("mask_token_id", "target_layer_ids")} | {
        "dflash_config": inside}


def converter(say=print, fetch: bool = True) -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py: the build's (benchmarks/build_llama_cpp.sh), else the copy taken
    from llama-cpp-python's sdist (fetched with pip when `fetch`; None when absent and not fetched)."""
    built = home() / "llama.cpp" / "src" / "convert_hf_to_gguf.py"
    if built.is_file():
        return built
    kept = home() / "llama.cpp-converter" / LLAMA_CPP_PYTHON
    script = kept / "convert_hf_to_gguf.py"
    if script.is_file() or not fetch:
        return script if script.is_file() else None
    if say:
        say(f"fetching llama.cpp's converter: llama-cpp-python=={LLAMA_CPP_PYTHON}'s sdist (77 MB, nothing built) "
            f"into {kept}")
    with tempfile.TemporaryDirectory(prefix="hetero-sd-sdist-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                               f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise ModelNotFoundError(f"could not download llama-cpp-python=={LLAMA_CPP_PYTHON}'s sdist ({last})",
                                     "check the network, or run benchmarks/build_llama_cpp.sh (it keeps the converter)")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "gguf-py/", "conversion/", "LICENSE")
        staging = kept.with_name(kept.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(wanted) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(staging, members=members, filter="data")
    if not (staging / "convert_hf_to_gguf.py").is_file():
        raise ModelNotFoundError(f"llama-cpp-python=={LLAMA_CPP_PYTHON}'s sdist has no vendor/llama.cpp/convert_hf_to_gguf.py",
                                 "run benchmarks/build_llama_cpp.sh (it keeps the converter of its build)")
    staging.rename(kept)
    return script


def convert(folder: Path, target: Path, out: Path, outtype: str, say=print) -> None:
    """llama.cpp's converter on a z-lab-layout folder; its last error line on failure."""
    script = converter(say)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    proc = subprocess.run([sys.executable, str(script), str(folder), "--target-model-dir", str(target),
                           "--outtype", outtype, "--outfile", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:  # e.g. a tensor it cannot map, sentencepiece missing: its last line says so
        tmp.unlink(missing_ok=True)
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise ConfigError(f"llama.cpp's converter ({script}) failed: {last}",
                          "check that --target is the draft's target folder (the converter takes its tokenizer)")
    tmp.rename(out)
