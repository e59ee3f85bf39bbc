"""z-lab's reference DFlash loop (`pip install --no-deps dflash`, MIT) on our target and draft.

It runs our HF target folder and our draft folder with transformers, on our target's device and in its dtype;
in float32 at T=0 its tokens must equal ours (in bf16 a verify block and a single step may round a near-tie
apart, in either loop): every prompt records whether they are identical (or where they first differ), both
taus, and the first token where the two loops' acceptance lengths differ. What makes the acceptance differ
by design is in the row's note: our context lookup, our block-size controller against its fixed block, our
draft's reduced head (draft_vocab) against its whole head. One
known difference: near the length limit z-lab shrinks the block to what is left (its non-causal draft
then sees fewer mask positions and may propose other tokens), where we draft the full block and cut;
so acceptance can differ within the last block of an answer that reaches --max-new-tokens. Its tau is
z-lab's: the mean of its acceptance lengths (the last step counted as cut). Its package assumes CUDA: the timer of `dflash_generate(return_stats=True)`
calls torch.cuda.synchronize(), which is replaced by a plain clock when CUDA is absent (announced in
the row's note). The speed is measured around the call, as ours is."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .repetition import step_lengths
from .peer_row import PeerRow, placement, synced

NAME = "zlab-reference"


def zlab_reference(runtime, prompt_ids: list[list[int]], max_new_tokens: int, done, ours: list[dict]) -> PeerRow:
    try:
        zm = reference_module()
    except ImportError:
        return PeerRow(NAME, skipped=True, note="not installed: pip install --no-deps dflash (z-lab's reference, 25 KB)")
    folder = Path(runtime.info.get("draft") or "")
    if not (folder / "config.json").is_file():
        return PeerRow(NAME, skipped=True, note=f"needs a draft folder in the z-lab format; this run's draft is "
                                                f"{runtime.info.get('draft')!r}")
    device, dtype = placement(runtime)
    target, draft = load_models(zm, runtime.info["target"], folder, runtime.info.get("mask_token_id"), device, dtype)
    block = runtime.block_size
    row = PeerRow(NAME, weights=f"{str(dtype).removeprefix('torch.')} on {device} via transformers: our HF target folder ({Path(runtime.info['target']).name}) "
                                f"and draft folder ({folder.name})",
                  note=f"dflash {package_version()} dflash_generate, greedy, block {block}" + differences(runtime, dtype))
    with cpu_clock(zm, row):
        synced(device, lambda: generate(zm, draft, target, prompt_ids[0], 4, runtime.stop_ids, block))  # warm-up
        for n, ids in enumerate(prompt_ids):
            began = time.perf_counter()
            out = synced(device, lambda: generate(zm, draft, target, ids, max_new_tokens, runtime.stop_ids, block))
            seconds = time.perf_counter() - began
            gen = out.output_ids[0, len(ids):].tolist()
            lengths = [int(a) for a in out.acceptance_lengths]
            row.add(gen, seconds, lengths=lengths, steps=len(lengths),
                    tau=sum(lengths) / len(lengths) if lengths else None,
                    **identity(gen, ours[n] if n < len(ours) else None, lengths))
            done()
    return row


def differences(runtime, dtype: torch.dtype) -> str:
    """What makes our acceptance differ from z-lab's loop by design, and when identical tokens are expected."""
    out = []
    if getattr(runtime, "lookup", 0):
        out.append("our run mixes the context lookup into its proposals (--lookup 0: the draft's tokens alone)")
    if getattr(runtime, "block", None) == "auto":
        out.append(f"our block size is the controller's, step by step (--block-size fixed: {runtime.block_size})")
    ids = getattr(getattr(getattr(runtime, "draft", None), "head", None), "ids", None)
    if ids is not None:
        out.append(f"our draft scores {len(ids)} ids of its head (its draft_vocab), theirs every id")
    if dtype != torch.float32:
        out.append(f"in {str(dtype).removeprefix('torch.')} the two loops' tokens may differ at a near-tie "
                   "(identical tokens are the float32 promise)")
    return "".join(f"; {d}" for d in out)


def load_models(zm, target_folder: str, draft_folder: Path, mask_token_id: int | None, device: str = "cpu",
                dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=dtype).to(device).eval()
    draft = zm.DFlashDraftModel.from_pretrained(str(draft_folder), dtype=dtype).to(device).eval()
    if draft.mask_token_id is None:  # older drafts: the tokenizer's <|MASK|>, which our runtime resolved
        draft.mask_token_id = mask_token_id
    return target, draft


def generate(zm, draft, target, ids: list[int], max_new_tokens: int, stop_ids: list[int], block: int):
    return zm.dflash_generate(draft, target, torch.tensor([ids], device=target.device), max_new_tokens, list(stop_ids),
                              temperature=0.0, block_size=block, return_stats=True)


def identity(gen: list[int], ours: dict | None, lengths: list[int] | None = None) -> dict:
    """Against our speculative answer for the same prompt at T=0: identical, or the first differing
    position; and our tau beside theirs."""
    if not ours or "output_ids" not in ours:
        return {}
    from .runner import first_divergence

    diverges = first_divergence(ours["output_ids"], gen)
    out = {"identical": diverges is None, "first_divergence": diverges, "tau_ours": ours.get("tau")}
    if "accepted_per_step" in ours and lengths is not None:
        mine = step_lengths(ours["accepted_per_step"], len(ours["output_ids"]))
        out["acceptance_differs_at_token"] = first_difference(mine, lengths)
    return out


def first_difference(mine: list[int], theirs: list[int]) -> int | None:
    """The answer position where the first step whose emitted count differs begins (None: same steps)."""
    position = 1  # token 0 is the prefill token
    for a, b in zip(mine, theirs):
        if a != b:
            return position
        position += a
    return None if len(mine) == len(theirs) else position


@contextmanager
def cpu_clock(zm, row: PeerRow):
    """dflash's timer synchronises CUDA; without CUDA, use the clock alone (nothing to wait for)."""
    if torch.cuda.is_available():
        yield
        return
    original = zm._cuda_time
    zm._cuda_time = time.perf_counter
    row.note += "; its CUDA timer replaced by time.perf_counter (no CUDA)"
    try:
        yield
    finally:
        zm._cuda_time = original


def reference_module():
    """z-lab's `dflash.model`: installed in the environment, or apart from it in <venv>/reference (the
    Makefile puts it there, with --no-deps --target, so that its pins never meet the venv's resolver)."""
    import sys

    try:
        from dflash import model
    except ImportError:
        apart = Path(sys.prefix) / "reference"
        if not apart.is_dir() or str(apart) in sys.path:
            raise
        sys.path.append(str(apart))
        from dflash import model
    return model


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflash")
    except PackageNotFoundError:
        return "(unknown version)"
