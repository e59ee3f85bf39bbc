"""Cross-implementation check: z-lab's reference DFlash loop (the `dflash` package, installed with
--no-deps by `make setup`) and our runtime on the same tiny random target and z-lab-format draft, at
T=0: identical tokens, identical acceptance lengths, and draft logits within float32 noise."""

from __future__ import annotations

import pytest
import torch

from hetero_sd.models.config import ArchConfig, read_json
from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft
from hetero_sd.bench.repetition import step_lengths
from hetero_sd.bench.peer_row import PeerRow
from hetero_sd.bench.peers_zlab import cpu_clock, first_difference
from hetero_sd.runtime import load

zm = pytest.importorskip("dflash.model", reason="z-lab's reference: pip install --no-deps dflash (make setup does)")

PROMPT = [5, 9, 12, 7]


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    """The tiny target and a random draft whose greedy run accepts a few drafts (std 0.2, block 6)."""
    from transformers import AutoModelForCausalLM

    cfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    raw = draft_config(cfg, num_layers=2, block_size=6, mask_token_id=3, layer_ids=[0, 2, 3])
    torch.manual_seed(0)
    folder = write_draft(tmp_path_factory.mktemp("zlab-draft"), raw, random_draft_tensors(raw, std=0.2),
                         dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    draft = zm.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    # the reference drafts full blocks of the draft's own tokens (lookup=0: no context lookup in the proposals)
    return load(str(tiny_llama), str(folder), block_size="fixed", draft_dtype="float32", lookup=0), target, draft


def test_same_tokens_and_acceptance_lengths(pair):
    rt, target, draft = pair
    ours = rt.generate(PROMPT, max_new_tokens=40, stop_at_eos=False)
    with cpu_clock(zm, PeerRow("zlab")):
        theirs = zm.dflash_generate(draft, target, torch.tensor([PROMPT]), 40, None, temperature=0.0,
                                    return_stats=True)
    assert theirs.output_ids[0, len(PROMPT):].tolist() == ours.token_ids
    assert list(theirs.acceptance_lengths) == step_lengths(ours.stats.accepted_per_step, len(ours.token_ids))
    assert max(ours.stats.accepted_per_step) >= 2  # drafts were accepted: the comparison is not all-rejections


def test_first_block_draft_logits_match(pair):
    rt, target, draft = pair
    mine = rt.draft_step(PROMPT)
    with torch.inference_mode():
        out = target(torch.tensor([PROMPT]), output_hidden_states=True)
        anchor = int(out.logits[0, -1].argmax())
        context = zm.extract_context_feature(out.hidden_states, draft.target_layer_ids)
        block = torch.tensor([[anchor] + [draft.mask_token_id] * (draft.block_size - 1)])
        hidden = draft(target_hidden=context, noise_embedding=target.get_input_embeddings()(block),
                       position_ids=torch.arange(len(PROMPT) + draft.block_size)[None])[:, 1:, :]
        logits = draft.compute_logits(hidden, target.lm_head)[0]
    assert mine.anchor == anchor
    theirs = logits.numpy()
    assert mine.logits.shape == theirs.shape
    torch.testing.assert_close(torch.from_numpy(mine.logits), logits, atol=2e-5, rtol=1e-4)
    assert mine.tokens == logits.argmax(-1).tolist()


def test_first_acceptance_difference_is_an_answer_position():
    assert first_difference([4, 1, 2], [4, 1, 2]) is None
    assert first_difference([4, 1, 2], [4, 2, 1]) == 5  # token 0 from prefill, then 4 + 1 tokens
    assert first_difference([4, 1], [4, 1, 1]) == 6
