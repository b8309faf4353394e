"""`onenode convert SRC DST`: rewrite a NemotronH checkpoint folder in the other public layout.

    onenode convert runs/tiny/final exported/ --layout nvidia     # NVIDIA remote-code keys
    onenode convert exported/ back/                               # transformers-native (the default)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import hf_io
from .nemotron_h import build_model


def convert(src: str | Path, dst: str | Path, layout: str = "hf") -> Path:
    """Rewrite the checkpoint folder `src` at `dst` in the `hf` or `nvidia` layout."""
    config, state_dict = hf_io.read_checkpoint(src)
    target = hf_io.layout_of(build_model(config, device="meta"), layout)
    return hf_io.write_layout(config, state_dict, target, dst)


def register(subparsers) -> None:
    parser = subparsers.add_parser("convert", help="rewrite a NemotronH checkpoint in another layout",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="checkpoint folder (config.json + *.safetensors), either layout")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--layout", choices=("hf", "nvidia"), default="hf",
                        help="hf: transformers-native (model., stacked experts); nvidia: remote code "
                             "(backbone., one module per expert)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        out = convert(args.src, args.dst, args.layout)
    except (FileNotFoundError, ValueError) as e:
        print(f"onenode convert: {e}")
        return 1
    print(f"wrote {out} ({args.layout} layout)")
    return 0
