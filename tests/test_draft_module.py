"""The draft as an nn.Module (backends/torch_backend/module.py): parameters under the checkpoint's names, a
state_dict that is the checkpoint, and a forward that is the inference draft's (one definition)."""

from __future__ import annotations

import torch

from hetero_sd.backends.torch_backend import DraftModule, load_draft, load_target
from hetero_sd.models.config import ArchConfig, DraftConfig, read_json
from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft


def test_module_is_the_checkpoint_and_its_forward_the_inference_draft(tmp_path, tiny_llama):
    tcfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    raw = draft_config(tcfg, num_layers=2, block_size=5, mask_token_id=3, layer_ids=[0, 1])
    tensors = random_draft_tensors(raw, std=0.2)
    target = load_target(tiny_llama, tcfg, "cpu", torch.float32, [0, 1])
    module = DraftModule(DraftConfig.from_dict(raw), tensors, target.embed, target.lm_head.t())
    state = module.state_dict()
    assert list(state) == list(tensors)  # the checkpoint's names and order; the target's tensors not saved
    assert all(torch.equal(state[n], tensors[n].float()) for n in tensors)
    folder = write_draft(tmp_path / "d", raw, dict(state), dtype=torch.float32)
    draft = load_draft(folder, DraftConfig.from_folder(folder), target, "cpu", torch.float32, 3)
    features, anchor, block = torch.randn(20, 2 * 64), 12, 5
    ids = torch.full((block,), 3)
    ids[0] = 7
    mask = torch.cat([torch.arange(20)[None, :].expand(block, -1) < anchor, torch.ones(block, block, dtype=torch.bool)], 1)
    hidden = module(features, ids, anchor + torch.arange(block), mask)
    draft.add_context(features[:anchor])
    logits = hidden[1:] @ target.lm_head
    torch.testing.assert_close(logits, draft.propose(7), rtol=1e-4, atol=1e-4)
    hidden.square().sum().backward()  # differentiable: every layer's weights get a gradient
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in module.named_parameters() if "layers." in n)
    other = DraftModule(DraftConfig.from_dict(raw), random_draft_tensors(raw, std=0.2), target.embed, target.lm_head.t())
    other.load_state_dict(state)
    assert torch.equal(other(features, ids, anchor + torch.arange(block), mask), hidden.detach())


def test_the_trainer_is_the_draft_module_and_keeps_the_checkpoint_order(tiny_llama):
    """train/model.py's TrainingDraft is a DraftModule (torch's parameters/state_dict/optimiser), its tensors
    in the order checkpoints were written before it was one (fc, hidden_norm, layers..., norm): an older
    checkpoint's AdamW state, matched to parameters by index, resumes onto the same tensors."""
    from hetero_sd.train.model import TrainingDraft

    tcfg = ArchConfig.from_dict(read_json(tiny_llama / "config.json"))
    raw = draft_config(tcfg, num_layers=2, block_size=5, mask_token_id=3, layer_ids=[0, 1])
    target = load_target(tiny_llama, tcfg, "cpu", torch.float32, [0, 1])
    model = TrainingDraft(raw, target.embed, target.lm_head.t())
    assert isinstance(model, DraftModule)
    names = [n for n in random_draft_tensors(raw) if n != "norm.weight"] + ["norm.weight"]
    assert [n for n, _ in model.named_parameters()] == names == list(model.state_dict())
    optim = torch.optim.AdamW(model.parameters())
    model.logits(model(torch.randn(20, 128), torch.randint(0, 64, (20,)), torch.tensor([4, 11]))).sum().backward()
    optim.step()
    state = optim.state_dict()["state"]
    assert [state[i]["exp_avg"].shape for i in range(len(names))] == [p.shape for p in model.parameters()]
