"""`hetero-sd export-draft DIR --to zlab|gguf|mlx|hetero-sd --out OUT` (hetero_sd/loading/export_draft.py)."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> None:
    from hetero_sd.loading.export_draft import FORMATS, GGUF_TYPES

    p = sub.add_parser("export-draft", help="write a DFlash draft in the layout llama.cpp, vLLM, SGLang, z-lab's "
                                            "package or an MLX port loads")
    p.add_argument("draft", help="the draft folder, or a shipped draft name (cpu-trained)")
    p.add_argument("--to", required=True, choices=FORMATS,
                   help="zlab: config.json + model.safetensors as z-lab's (vLLM, SGLang, z-lab); mlx: the same with "
                        "every key MLX ports read made explicit; gguf: llama.cpp's converter; hetero-sd: our layout")
    p.add_argument("--out", required=True, help="a new folder (a .gguf file for --to gguf)")
    p.add_argument("--target", default="default",
                   help="gguf only: the draft's target (folder, .gguf or 'default'): the converter takes its tokenizer")
    p.add_argument("--outtype", default="f32", choices=GGUF_TYPES, help="gguf only: the weights' type in the file")


def command(args: argparse.Namespace) -> dict:
    from pathlib import Path

    from hetero_sd.loading.export_draft import draft_folder, export_draft

    report = export_draft(draft_folder(args.draft), args.to, Path(args.out), target=args.target,
                          outtype=args.outtype, say=lambda line: print(line, file=sys.stderr))
    print(json.dumps(report, indent=2))
    return report
