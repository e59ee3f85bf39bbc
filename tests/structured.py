"""A tiny random target that can spell JSON and tool calls: a byte-level BPE tokenizer (every byte a token, a few
merges, Qwen's `<tool_call>` tags as added text tokens) and Qwen2.5's chat template, which renders `tools`.
Used by the constrained-decoding and server-for-agents tests."""

from __future__ import annotations

from pathlib import Path

import torch

from .conftest import make_tiny_target

VOCAB = 288  # the model's rows; the tokenizer has 270 tokens (rows past it are never allowed by a grammar)
SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|mask|>"]  # ids 0..3: eos 1 (the config's), mask 3
TAGS = ["<tool_call>", "</tool_call>"]  # Qwen's: added tokens that are text (special=False), ids 4, 5
MERGES = [("{", "\""), ("\"", ":"), ("\"", ","), ("Ġ", "\""), ("Ġ", "t"), ("t", "r")]

# Qwen2.5's template (tools in the system turn, <tool_call> JSON calls, tool results as <tool_response> turns)
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def json_tokenizer(folder: Path, template: str | None = QWEN_TEMPLATE) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIAL + TAGS)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.add_tokens(TAGS)  # text, as in Qwen's tokenizer: decoded into the answer, where the parser finds them
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(folder))


def make_json_target(folder: Path, seed: int = 0, template: str | None = QWEN_TEMPLATE, **overrides) -> Path:
    overrides.setdefault("max_position_embeddings", 4096)  # Qwen's tools preamble is ~800 byte-level tokens
    make_tiny_target(folder, "qwen2", vocab_size=VOCAB, seed=seed, tie_word_embeddings=True, **overrides)
    json_tokenizer(folder, template)
    return folder


def make_json_draft(folder: Path, target: Path, seed: int = 0, block_size: int = 6) -> Path:
    from hetero_sd.models.config import ArchConfig, read_json
    from hetero_sd.models.draft_init import draft_config, random_draft_tensors, write_draft

    cfg = ArchConfig.from_dict(read_json(target / "config.json"))
    raw = draft_config(cfg, num_layers=1, block_size=block_size, mask_token_id=3, layer_ids=[1, 3])
    return write_draft(folder, raw, random_draft_tensors(raw, seed=seed, std=0.2), dtype=torch.float32)
