"""Shared fixtures: tiny HF models made with transformers, and the real default model (SmolLM2)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# One converted copy of the embedded default model per checkout (the conversion takes ~30 s).
os.environ.setdefault("HETERO_SD_HOME", str(ROOT / ".cache" / "hetero-sd"))
torch.manual_seed(0)
# z-lab's `dflash` (the parity tests' reference) is installed apart from the venv's packages (Makefile):
# its pins (datasets, tqdm, ...) would otherwise conflict with ours in pip's resolver.
REFERENCE = Path(sys.prefix) / "reference"
if REFERENCE.is_dir() and str(REFERENCE) not in sys.path:
    sys.path.append(str(REFERENCE))

TINY_VOCAB = 64


SESSION_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """Runtimes loaded for concurrent schedules (and module fixtures of tiny models) set torch's process-wide
    thread count; every test starts from the session's. Read at import, not per test: a module-scoped
    fixture is set up before this function-scoped one, so a per-test reading would keep its leak."""
    torch.set_num_threads(SESSION_THREADS)
    yield
    torch.set_num_threads(SESSION_THREADS)


def tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")
    fast.add_special_tokens({"additional_special_tokens": ["t3"]})
    fast.save_pretrained(str(folder))


def make_tiny_target(folder: Path, model_type: str = "llama", vocab_size: int = TINY_VOCAB, seed: int = 0,
                     **overrides) -> Path:
    """A small random model saved by transformers itself (so its layout is the real HF one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  initializer_range=0.2, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
                  rope_theta=10000.0)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(str(folder))
    tiny_tokenizer(folder, vocab_size)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tiny_llama) -> Path:
    """A random 2-layer DFlash draft for tiny_llama, written in the z-lab format."""
    from hetero_sd.models.config import ArchConfig, read_json
    from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft

    cfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    raw = draft_config(cfg, num_layers=2, block_size=6, mask_token_id=3, layer_ids=[0, 2, 3])
    return write_draft(tmp_path_factory.mktemp("tiny-draft"), raw, random_draft_tensors(raw, std=0.2),
                       dtype=torch.float32)


@pytest.fixture(scope="session")
def default_folder() -> Path:
    from hetero_sd.loading.default_model import default_target_folder

    return default_target_folder()


@pytest.fixture(scope="session")
def smollm_random(default_folder):
    """The real default target with an untrained draft of the right shape, at a fixed block of 16 (the
    controller's tests load their own)."""
    import hetero_sd

    return hetero_sd.load("default", "random", block_size=16)


def pytest_runtest_logreport(report):
    """HETERO_SD_FAILLOG=FILE: each failure's traceback is appended there as it happens, so that a run cut
    off by a time limit still says why its failed tests failed."""
    path = os.environ.get("HETERO_SD_FAILLOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
