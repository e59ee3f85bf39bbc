"""Training prompts from offline sources only, disjoint from every evaluation set:
instructions written here and expanded over topics, and code contexts (signature + docstring) cut
from the Python standard library's own source."""

from __future__ import annotations

import ast
import importlib
import inspect
import random

from hetero_sd.prompts import CODE_PROMPT

INSTRUCTIONS = [
    "Explain {t} in simple terms.", "Write a short paragraph about {t}.", "Give three facts about {t}.",
    "What are the pros and cons of {t}?", "Summarise what you know about {t} in four sentences.",
    "Write a haiku about {t}.", "List five questions a student might ask about {t}.",
    "How would you teach {t} to a ten-year-old?", "Write a short story that involves {t}.",
    "What is a common misconception about {t}?", "Compare {t} with something similar.",
    "Write a short poem about {t}.", "Give me a step-by-step guide related to {t}.",
    "Why is {t} important?", "Describe the history of {t} briefly.", "Write a tweet about {t}.",
]
TOPICS = [
    "the water cycle", "black holes", "machine learning", "healthy eating", "the Roman Empire",
    "photosynthesis", "electric cars", "the stock market", "volcanoes", "meditation", "recycling",
    "the internet", "honey bees", "climate change", "chess", "coffee", "the human heart", "rainbows",
    "public speaking", "time management", "the moon landing", "vaccines", "jazz music", "gardening",
    "earthquakes", "solar panels", "friendship", "the printing press", "sleep", "dinosaurs", "budgeting",
    "democracy", "the ocean", "bicycles", "learning a language", "bread baking", "cloud computing",
    "the Olympic Games", "renewable energy", "the immune system", "mountains", "libraries", "robots",
    "sorting algorithms", "databases", "version control", "prime numbers", "fractions", "gravity",
]
CODE_TASKS = [
    "checks whether a string is a palindrome", "merges two sorted lists", "counts word frequencies in a text",
    "returns the n-th prime number", "flattens a nested list", "removes duplicates from a list keeping order",
    "computes the factorial of n", "checks if two strings are anagrams", "converts Celsius to Fahrenheit",
    "finds the longest common prefix of a list of strings", "returns the GCD of two numbers",
    "parses a CSV line into fields", "rotates a matrix by 90 degrees", "implements binary search",
    "validates an email address with a regular expression", "computes the moving average of a list",
    "reverses the words in a sentence", "groups a list of dicts by a key", "finds the mode of a list",
    "converts a Roman numeral to an integer", "chunks a list into pieces of size n",
    "computes the edit distance between two strings", "checks balanced parentheses",
    "returns the running sum of a list", "counts vowels in a string", "transposes a list of lists",
]
CODE_TEMPLATES = ["Write a Python function that {t}.", "Write a Python function that {t}, with a docstring.",
                  "Show how to write a function that {t} in Python, and explain it briefly."]
STDLIB = ["json", "textwrap", "collections", "statistics", "heapq", "bisect", "string", "fractions",
          "difflib", "shlex", "csv", "calendar", "fnmatch", "colorsys", "random", "ipaddress", "html",
          "base64", "posixpath", "functools", "urllib.parse", "email.utils", "glob", "gettext", "argparse",
          "configparser", "inspect", "tokenize", "pprint", "dataclasses", "enum", "copy", "locale",
          "quopri", "uu", "wave", "zipfile", "tarfile", "shutil", "tempfile", "operator", "decimal",
          "datetime", "pathlib", "typing", "graphlib", "contextlib", "abc", "numbers", "ast", "dis",
          "pickletools", "codecs", "mimetypes", "http.cookies", "smtplib", "imaplib", "ftplib", "poplib",
          "netrc", "plistlib", "sched", "queue", "threading", "subprocess", "logging", "unittest.util",
          "optparse", "cmd", "code", "codeop", "trace", "timeit", "cProfile", "pstats", "tracemalloc"]


def instruction_prompts() -> list[str]:
    return ([t.format(t=topic) for t in INSTRUCTIONS for topic in TOPICS]
            + [t.format(t=task) for t in CODE_TEMPLATES for task in CODE_TASKS])


def stdlib_function_heads() -> list[str]:
    """`def f(...):` + docstring of documented standard-library functions (HumanEval-like contexts)."""
    heads = []
    for name in STDLIB:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 20 < len(doc) < 600 and node.body and isinstance(node.body[0], ast.Expr):
                    lines = source.splitlines()
                    head = lines[node.lineno - 1:node.body[0].end_lineno]
                    indent = len(head[0]) - len(head[0].lstrip())
                    heads.append("\n".join(line[indent:] for line in head))
    return heads


def training_prompts(n: int, code_fraction: float = 0.5, seed: int = 0) -> list[dict]:
    """n prompts, deterministic for a seed: {"prompt", "source"}."""
    rng = random.Random(seed)
    code = [CODE_PROMPT.format(code=h) for h in stdlib_function_heads()]
    chat = instruction_prompts()
    rng.shuffle(code)
    rng.shuffle(chat)
    n_code = min(int(n * code_fraction), len(code))
    rows = [{"prompt": p, "source": "stdlib-code"} for p in code[:n_code]]
    rows += [{"prompt": p, "source": "instruction"} for p in chat[:n - n_code]]
    rng.shuffle(rows)
    return rows
