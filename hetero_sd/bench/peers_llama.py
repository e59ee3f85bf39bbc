"""llama.cpp peers from the build of benchmarks/build_llama_cpp.sh ($HETERO_SD_HOME/llama.cpp):

- `llama.cpp`: llama-completion, plain autoregressive decoding of the target's GGUF as stored;
- `llama.cpp-dflash`: llama-speculative-simple with `--spec-type draft-dflash` and our draft converted
  by llama.cpp's own convert_hf_to_gguf.py (f32, cached under $HETERO_SD_HOME/llama.cpp/drafts/).

Each prompt is our token ids rendered back to text with its special tokens; llama.cpp parses special
tokens, and the prompt length it reports is checked against ours (a mismatch is noted per prompt).
Speed is tokens over llama.cpp's own prompt + decode timings (model loading excluded, as ours is).
tau for DFlash: its tokens over its verify steps, steps = tokens - accepted drafts (each step emits its
accepted drafts and one target token)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import time
from pathlib import Path

import torch

from hetero_sd.errors import HeteroSDError
from hetero_sd.home import home
from .peer_row import PeerRow

BINARIES = {"llama.cpp": "llama-completion", "llama.cpp-dflash": "llama-speculative-simple"}
TIMEOUT_S = 1800  # one prompt; a hung binary must not hang the bench


def build_dir() -> Path:
    return home() / "llama.cpp"


def llama_cpp_peer(runtime, prompt_ids: list[list[int]], max_new_tokens: int, done, name: str) -> PeerRow:
    """The peer from the build, or (no build) the llama-cpp-python peer with a note saying why."""
    binary = build_dir() / "bin" / BINARIES[name]
    if not binary.is_file():
        why = f"no llama.cpp build at {binary.parent}: run benchmarks/build_llama_cpp.sh (15-40 min, once)"
        return llama_cpp(runtime, prompt_ids, max_new_tokens, done, name=name, why=why)
    gguf = runtime.info.get("gguf")
    if not gguf:
        return PeerRow(name, skipped=True, note="no GGUF for this target (the default target has one)")
    threads = torch.get_num_threads()
    context = max(len(ids) for ids in prompt_ids) + max_new_tokens + 64  # the prompt must fit one batch too
    args = [str(binary), "-m", gguf, "-t", str(threads), "-c", str(context), "-b", str(context), "--temp", "0",
            "--no-escape"]
    weights = f"the target's GGUF as stored ({Path(gguf).name})"
    if name == "llama.cpp-dflash":
        try:
            draft = converted_draft(runtime)
        except (OSError, HeteroSDError, ValueError) as e:
            return PeerRow(name, skipped=True, note=f"could not convert our draft with llama.cpp's converter: {e}")
        block = runtime.block_size
        args += ["-md", str(draft), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(block - 1),
                 "-td", str(threads)]
        weights += f"; our draft converted to GGUF f32 ({draft.name})"
        note = f"llama-speculative-simple --spec-type draft-dflash, block {block}, {threads} threads, greedy"
    else:
        args += ["-no-cnv", "--no-display-prompt", "--simple-io"]
        note = f"llama-completion, {threads} threads, greedy"
    row = PeerRow(name, weights=weights, note=f"{note} ({build_info()})")
    args = warm_up(args, runtime, prompt_ids[0], name, row)
    for ids in prompt_ids:
        out = run_prompt(args, runtime, ids, max_new_tokens, name)
        row.add(runtime.tokenizer.encode(out.pop("text"), add_special_tokens=False), out.pop("seconds"),
                tokens=out.pop("tokens"), **out)
        done()
    return row


def warm_up(args: list[str], runtime, ids: list[int], name: str, row: PeerRow) -> list[str]:
    """One short run (pages the weights in). Where ggml's AMX kernels crash (a VM that advertises AMX
    without supporting it: SIGSEGV in ggml_backend_amx_mul_mat), run again with --no-repack, which
    keeps weights out of the AMX buffer; announced in the row's note."""
    try:
        run_prompt(args, runtime, ids, 4, name)
        return args
    except LlamaCrash:
        args = args + ["--no-repack"]
        run_prompt(args, runtime, ids, 4, name)
        row.note += ("; died of a signal on its first run (this VM's AMX path), so run with --no-repack "
                     "(no AMX buffer and no repacked weights: this llama.cpp repacks neither Q4_1 nor f32)")
        return args


class LlamaCrash(RuntimeError):
    """The binary died of a signal."""


def run_prompt(args: list[str], runtime, ids: list[int], max_new_tokens: int, name: str) -> dict:
    prompt = runtime.tokenizer.decode(ids, skip_special_tokens=False)
    # speculative-simple stops once it has more than -n tokens; completion stops at exactly -n
    n = max_new_tokens - 1 if name == "llama.cpp-dflash" else max_new_tokens
    proc = subprocess.run(args + ["-p", prompt, "-n", str(n)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, errors="replace")
    if proc.returncode < 0:
        raise LlamaCrash(f"{Path(args[0]).name} died of signal {-proc.returncode}: {proc.stderr[-1000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(args[0]).name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    parse = parse_speculative if name == "llama.cpp-dflash" else parse_completion
    out = parse(proc.stdout, proc.stderr, prompt)
    if out.get("prompt_tokens") not in (None, len(ids)):
        out["note"] = f"llama.cpp tokenized the prompt to {out['prompt_tokens']} tokens, ours has {len(ids)}"
    return out


def number(pattern: str, text: str, kind=float):
    m = re.search(pattern, text)
    if m is None:
        raise ValueError(f"llama.cpp output has no match for {pattern!r}: {text[-1500:]}")
    return kind(m.group(1))


def parse_completion(stdout: str, stderr: str, prompt: str) -> dict:
    """llama-completion prints the answer alone (--no-display-prompt) and llama_perf timings."""
    prompt_ms = number(r"prompt eval time =\s*([\d.]+) ms", stderr)
    eval_ms = number(r"\beval time =\s*([\d.]+) ms / +\d+ runs", stderr)
    runs = number(r"\beval time =\s*[\d.]+ ms / +(\d+) runs", stderr, int)
    return {"text": stdout.strip("\n"), "seconds": (prompt_ms + eval_ms) / 1e3,
            "tokens": runs + 1,  # every sampled token is evaluated next, except the last one
            "prompt_tokens": number(r"prompt eval time =\s*[\d.]+ ms / +(\d+) tokens", stderr, int)}


def parse_speculative(stdout: str, stderr: str, prompt: str) -> dict:
    """llama-speculative-simple echoes the prompt, then the answer; its summary is on stderr."""
    log = stdout + stderr
    enc_s = number(r"encoded +\d+ tokens in +([\d.]+) seconds", log)
    dec_s = number(r"decoded +\d+ tokens in +([\d.]+) seconds", log)
    tokens = number(r"n_predict = (\d+)", log, int)
    accepted = number(r"n_accept  = (\d+)", log, int)
    steps = tokens - accepted
    text = stdout.lstrip("\n")
    note = None
    if text.startswith(prompt):
        text = text[len(prompt):]
    else:
        note = "could not strip the echoed prompt from llama.cpp's output: loop share measured on all of it"
    out = {"text": text.rstrip("\n"), "seconds": enc_s + dec_s, "tokens": tokens, "steps": steps,
           "tau": tokens / steps if steps else None, "accepted": accepted,
           "prompt_tokens": number(r"encoded +(\d+) tokens", log, int)}
    if m := re.search(r"#mean acc len = ([\d.]+)", log):
        out["tau_reported"] = float(m.group(1))
    return out | ({"note": note} if note else {})


def converted_draft(runtime) -> Path:
    """Our draft folder in GGUF, converted once by llama.cpp's own converter through `export-draft --to gguf`
    (z-lab's two files only: the reduced head and short blocks stay ours), cached by content."""
    folder = Path(runtime.info.get("draft") or "")
    if not (folder / "config.json").is_file():
        raise ValueError(f"needs a draft folder in the z-lab format, this run's draft is {runtime.info.get('draft')!r}")
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
        digest.update(f.name.encode() + f.read_bytes())
    out = build_dir() / "drafts" / f"{folder.name}-{digest.hexdigest()[:12]}-f32.gguf"
    if out.is_file():
        return out
    from hetero_sd.loading.export_draft import export_draft

    export_draft(folder, "gguf", out, target=runtime.info["target"], outtype="f32", say=None)
    return out


def build_info() -> str:
    info = build_dir() / "BUILD_INFO"
    lines = info.read_text().splitlines() if info.is_file() else []
    commit = next((ln.split(":", 1)[1].strip()[:8] for ln in lines if ln.startswith("commit:")), "?")
    return f"{lines[0] if lines else 'llama.cpp'}, commit {commit}"


def llama_cpp(runtime, prompt_ids, max_new_tokens: int, done, name: str = "llama.cpp",
              why: str = "") -> PeerRow:
    """llama.cpp through llama-cpp-python (used when the binaries of benchmarks/build_llama_cpp.sh are
    absent; `why` says so in the note). It has no DFlash: llama.cpp-dflash needs the binaries."""
    if name == "llama.cpp-dflash":
        return PeerRow(name, skipped=True, note=why)
    try:
        from llama_cpp import Llama
    except ImportError:
        return PeerRow(name, skipped=True, note=f"{why}; llama-cpp-python not installed either")
    gguf = runtime.info.get("gguf")
    if not gguf:
        return PeerRow(name, skipped=True, note="no GGUF for this target (the default target has one)")
    threads = torch.get_num_threads()
    llm = Llama(model_path=gguf, n_threads=threads, n_ctx=4096, verbose=False)
    row = PeerRow(name, note=f"llama-cpp-python ({why}), {threads} threads, greedy",
                  weights=f"the target's GGUF as stored ({Path(gguf).name})")
    llm.create_completion(prompt_ids[0], max_tokens=4, temperature=0.0)  # warm-up
    for ids in prompt_ids:
        began = time.perf_counter()
        out = llm.create_completion(ids, max_tokens=max_new_tokens, temperature=0.0)
        text = out["choices"][0]["text"]
        row.add(runtime.tokenizer.encode(text, add_special_tokens=False), time.perf_counter() - began,
                tokens=out["usage"]["completion_tokens"])
        done()
    return row
