"""One check of what a caller passes in, shared by the CLI, the chat app and the Python API, run before
any model work: types, ranges, UTF-8, token ids, writable output paths. Every failure is an
InvalidArgumentError (or OutputPathError) whose message names the value and the fix; the CLI prints
it as its one `error:`/`fix:` pair. Nothing here coerces: a wrong value is refused, never rounded."""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

from hetero_sd.errors import InvalidArgumentError, OutputPathError

RULES = ("match", "rejection")  # sampling.RULES, repeated so that checking needs no torch
FIXES = {"top_k": "use 0 to keep every token, or a count such as 50",
         "seed": "pass a seed >= 0, or none for a random one",
         "threads": "pass 1 or more threads (or leave it unset)",
         "limit": "pass 1 or more prompts (or leave it unset: all of them)"}


def integer(name: str, value, minimum: int, fix: str | None = None) -> int:
    """An int (not a bool, not a float that happens to be whole) >= minimum."""
    fix = fix or FIXES.get(name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r} ({type(value).__name__})",
                                   fix or f"pass a whole number >= {minimum}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}", fix or f"pass a number >= {minimum}")
    return int(value)


def real(name: str, value) -> float:
    """A finite int or float (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r} ({type(value).__name__})",
                                   f"pass {name} as a number")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite, got {value}", f"pass a finite {name}")
    return float(value)


MIN_TEMPERATURE = 1e-4  # below it logits / T overflow float32 (and the samples are greedy's anyway)
MAX_TEMPERATURE = 2.0  # OpenAI's range (0 to 2); above it a sample is close to a uniform draw over the vocabulary
MAX_SEED = 2**64 - 1


def temperature_value(value) -> float:
    """0 (greedy) or a temperature >= MIN_TEMPERATURE."""
    t = real("temperature", value)
    if t < 0:
        raise InvalidArgumentError(f"temperature must be >= 0, got {t:g}", "use 0 for greedy decoding or a value > 0")
    if 0 < t < MIN_TEMPERATURE:
        raise InvalidArgumentError(f"temperature {t:g} is below {MIN_TEMPERATURE:g}",
                                   f"use 0 for greedy decoding (what so small a temperature means) or >= {MIN_TEMPERATURE:g}")
    if t > MAX_TEMPERATURE:
        raise InvalidArgumentError(f"temperature {t:g} is above {MAX_TEMPERATURE:g}",
                                   f"use a temperature from 0 to {MAX_TEMPERATURE:g} (OpenAI's range), e.g. 0.7")
    return t


def top_p_value(value) -> float:
    p = real("top_p", value)
    if not 0 < p <= 1:
        raise InvalidArgumentError(f"top_p must be in (0, 1], got {p:g}", "use 1 to keep every token, or e.g. 0.9")
    return p


def sampling(*, max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, seed=None, rule="match",
             speculative=True, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0) -> None:
    """Everything a generation takes besides the prompt."""
    penalties(min_p, repetition_penalty, presence_penalty, frequency_penalty)
    integer("max_new_tokens", max_new_tokens, 0)
    temperature_value(temperature)
    top_p_value(top_p)
    integer("top_k", top_k, 0)
    if seed is not None:
        seed_value(seed)
    if rule not in RULES:
        raise InvalidArgumentError(f"unknown acceptance rule {rule!r}", f"use one of {', '.join(RULES)}")
    if not isinstance(speculative, bool):
        raise InvalidArgumentError(f"speculative must be True or False, got {speculative!r}",
                                   "pass speculative=True (with the draft) or False (autoregressive)")


def penalties(min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0) -> None:
    """min_p in [0, 1]; repetition_penalty > 0 (1: off); presence and frequency penalties in [-2, 2]
    (OpenAI's range; 0: off)."""
    if not 0 <= real("min_p", min_p) <= 1:
        raise InvalidArgumentError(f"min_p must be in [0, 1], got {min_p:g}", "use 0 to keep every token, or e.g. 0.05")
    if not real("repetition_penalty", repetition_penalty) > 0:
        raise InvalidArgumentError(f"repetition_penalty must be > 0, got {repetition_penalty:g}",
                                   "use 1 for none, or e.g. 1.1 to discourage repeats")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -2 <= real(name, value) <= 2:
            raise InvalidArgumentError(f"{name} must be in [-2, 2], got {value:g}", "use 0 for none, or e.g. 0.5")


def seed_value(value) -> int:
    """A seed: an int from 0 to 2^64 - 1 (what torch and the OpenAI API take)."""
    if integer("seed", value, 0) > MAX_SEED:
        raise InvalidArgumentError(f"seed must be < 2^64, got {value}", "pass a seed from 0 to 2^64 - 1")
    return int(value)


def threads(value) -> int | None:
    """CPU threads: 1 up to the cores (more threads than cores slow each other down, several times over)."""
    if value is None:
        return None
    n, cores = integer("threads", value, 1), os.cpu_count() or 1
    if n > cores:
        raise InvalidArgumentError(f"threads {n} is more than this machine's {cores} cores (threads beyond the "
                                   "cores wait on each other: several times slower)",
                                   f"pass 1 to {cores} threads (or leave it unset)")
    return n


def name(what: str, value, optional: bool = False) -> str | None:
    """A non-empty str (a model or device name); None where optional."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"{what} must be a non-empty string, got {value!r}",
                                   f"pass {what} as a name, e.g. 'cpu' or 'default'" + (" (or None)" if optional else ""))
    return value


def load_args(*, target, draft, target_device, draft_device, schedule, max_context) -> None:
    """load()'s names and sizes, before anything is resolved (threads and block size are checked where used)."""
    name("target", target)
    name("draft", draft, optional=True)
    if draft is not None:
        random_draft(draft)
    name("target_device", target_device)
    name("draft_device", draft_device, optional=True)
    name("schedule", schedule)
    if max_context is not None:
        integer("max_context", max_context, 1, "pass a context length >= 1 (or leave it unset: the model's own)")


MAX_RANDOM_DRAFT_LAYERS = 64  # a DFlash draft has a few layers; more than a large target's own is no draft


def random_draft(draft: str) -> None:
    """draft="random:N": N from 1 to MAX_RANDOM_DRAFT_LAYERS, refused before a layer is built."""
    if not draft.startswith("random:"):
        return
    count = draft.partition(":")[2]
    if not count.isdigit() or not 1 <= int(count) <= MAX_RANDOM_DRAFT_LAYERS:
        raise InvalidArgumentError(f"draft {draft!r}: a random draft takes 1 to {MAX_RANDOM_DRAFT_LAYERS} layers",
                                   f"use 'random' or 'random:N' with N from 1 to {MAX_RANDOM_DRAFT_LAYERS}, e.g. random:2")


def flag(name: str, value, fix: str) -> bool:
    """A bool, nothing that merely looks true ('no' is a non-empty string)."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r} ({type(value).__name__})", fix)
    return value


def optional(name: str, value, kind: type, fix: str):
    """None or an instance of kind (e.g. generate's timeline=: a Timeline, not its name)."""
    if value is not None and not isinstance(value, kind):
        raise InvalidArgumentError(f"{name} must be a {kind.__name__} or None, got {value!r} ({type(value).__name__})", fix)
    return value


def chat_mode(value, prompt) -> bool:
    """chat=True or False; False (raw text, no template) with a list of messages is refused: only the
    chat template turns messages into text."""
    flag("chat", value, "pass chat=True (the chat template) or chat=False (the prompt as raw text)")
    if not value and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        raise InvalidArgumentError("chat=False sends the prompt as raw text, but it is a list of messages, which only "
                                   "the chat template renders", "pass chat=True with messages, or the text itself with chat=False")
    return value


def limit(value) -> int | None:
    return None if value is None else integer("limit", value, 1)


def text(value: str, what: str = "the prompt") -> str:
    """Text that can be tokenized: a str that is valid UTF-8 (no lone surrogates, which is what a
    command line of invalid UTF-8 bytes decodes to)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{what} is not valid UTF-8",
                                   "pass text in UTF-8 (check the terminal's or the file's encoding)") from None
    return value


def prompt(value) -> str | list[int] | list[dict]:
    """A prompt is text, a list of token ids, or a list of chat messages ({"role", "content"})."""
    if isinstance(value, str):
        if not value:
            raise InvalidArgumentError("the prompt is empty", "pass some text (or token ids)")
        return text(value)
    if isinstance(value, (bytes, bytearray)):
        raise InvalidArgumentError("the prompt is bytes, not text or token ids",
                                   "decode it first: prompt.decode('utf-8')")
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # numpy or torch ids
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise InvalidArgumentError(f"the prompt must be a str, a list of token ids or a list of messages, "
                                   f"got {type(value).__name__}", "pass the prompt as text")
    if not value:
        raise InvalidArgumentError("the prompt is an empty list", "pass text, or at least one token id")
    if all(isinstance(m, dict) for m in value):
        return [message(m, n) for n, m in enumerate(value)]
    if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value):
        return [int(t) for t in value]
    raise InvalidArgumentError("the prompt list mixes types: it must hold only token ids (int) or only "
                               "messages (dict)", "pass a list of ints or a list of {'role', 'content'} dicts")


def prompt_list(value) -> list:
    """generate_many's prompts: a list or tuple of prompts (a str is one prompt, not a list of characters)."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (list, tuple)):
        raise InvalidArgumentError(f"prompts must be a list of prompts, got {type(value).__name__}",
                                   "pass a list, e.g. generate_many(['Hi!']); for one prompt use generate")
    return list(value)


ROLES = ("system", "user", "assistant", "tool")  # what chat templates render (the server's schema: the first three)


def message(m: dict, n: int) -> dict:
    if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise InvalidArgumentError(f"message {n} needs a str 'role' and a str 'content', got {m!r}",
                                   "pass messages like {'role': 'user', 'content': 'Hi'}")
    if m["role"] not in ROLES:
        raise InvalidArgumentError(f"message {n} has the role {m['role']!r}, which no chat template knows",
                                   f"use one of {', '.join(ROLES)}")
    text(m["content"], f"message {n}")
    return m


def token_ids(ids: list[int], vocab_size: int) -> list[int]:
    """Ids the target can embed: non-empty, each in [0, vocab_size)."""
    if not ids:
        raise InvalidArgumentError("the prompt is empty: it encodes to no tokens",
                                   "pass a non-empty prompt (or use the chat template)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgumentError(f"token ids {bad[:5]} are outside the target's vocabulary [0, {vocab_size})",
                                   "pass ids produced by this target's tokenizer (runtime.tokenizer.encode)")
    return ids


def block(value, draft_size: int, name: str = "block"):
    """A block setting: 'auto' (the controller), 'fixed' (the draft's own size on every step), or a size
    from 2 to the draft's own. `name` is what the caller called it (generate's block, load's block size)."""
    if value in ("fixed", "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an integer, 'auto' or 'fixed', got {value!r}",
                                   f"pass a size from 2 to {draft_size}, 'auto' or 'fixed'")
    if not 2 <= value <= draft_size:
        raise InvalidArgumentError(f"{name} {value} is outside what this draft fills (2 to its own "
                                   f"block size, {draft_size})", f"pass a {name} from 2 to {draft_size}")
    return int(value)


def verify_gate(value):
    """None (every draft verified) or a draft probability in (0, 1): drafts from the first below it go unverified."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < 1:
        raise InvalidArgumentError(f"verify gate must be a probability between 0 and 1 (exclusive), got {value!r}",
                                   "pass e.g. 0.3, or leave it out to verify every draft")
    return float(value)


def lookup(value):
    """The context lookup's weight in the draft's proposals: a number in [0, 1) (0: off)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise InvalidArgumentError(f"lookup weight must be a number from 0 (off) up to 1 (exclusive), got {value!r}",
                                   "pass e.g. 0.4 (the default), or 0 to propose the draft's tokens alone")
    return float(value)


ACCEPTANCE = ("auto", "device", "host")


def acceptance(value) -> str:
    """Where a block's acceptance runs: 'device', 'host', or 'auto' (the device when the target is on an
    accelerator: decoding/loop.verify_on_device)."""
    if value not in ACCEPTANCE:
        raise InvalidArgumentError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, got {value!r}",
                                   "pass acceptance='auto' (the default), 'device' or 'host'")
    return value


def block_size(value, draft_size: int):
    """load(block_size=...): None (the default: 'auto') or a block setting as for `block`."""
    return None if value is None else block(value, draft_size, "block size")


def output_file(path, flag: str) -> Path:
    """A file we will write later: checked now, so that no work is lost to a bad path at the end."""
    if not str(path).strip():
        raise OutputPathError(f"{flag} is empty", f"give {flag} a file name, e.g. {flag} out.json (or leave it out)")
    p = Path(path).expanduser()
    if p.is_symlink() and not p.exists():
        raise OutputPathError(f"{flag} {p} is a symlink to {os.readlink(p)}, which does not exist",
                              f"give {flag} the path of a regular file (or remove the link)")
    if p.is_symlink():  # written through (the link stays): check where the file really is
        p = Path(os.path.realpath(p))
    parent = p.parent if str(p.parent) else Path(".")
    if p.exists() and not p.is_dir() and not p.is_file():  # a device, FIFO or socket: written into
        if not os.access(p, os.W_OK):
            raise OutputPathError(f"{flag} {p} cannot be written (permission denied)", "give a path you can write to")
        return p
    if p.is_dir():
        raise OutputPathError(f"{flag} {p} is a directory", f"give {flag} a file name, e.g. {p / 'out.json'}")
    if not parent.is_dir():
        raise OutputPathError(f"{flag} {p}: the folder {parent} does not exist",
                              f"create it first (mkdir -p {parent}) or write elsewhere")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise OutputPathError(f"{flag} {p} cannot be written (permission denied or read-only)",
                              "give a path in a folder you can write to")
    return p
