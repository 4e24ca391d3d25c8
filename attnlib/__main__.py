"""Command line: `python -m attnlib check-qwen3 ...` and `python -m attnlib bench ...`.

Each subcommand lives in its own module, imported only when it runs, so that heavy
libraries (transformers, matplotlib, tqdm) stay out of `import attnlib`.
"""

import argparse
import importlib
import sys

COMMANDS = {
    "check-qwen3": ("attnlib.qwen3", "Check hand-written attention against a real Qwen3 layer."),
    "bench": ("attnlib.bench", "Time and measure naive, tiled and fused attention."),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnlib")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, add_help=False)
        sub.set_defaults(module=module)
    args, rest = parser.parse_known_args(argv)
    # Each module defines add_arguments(parser) and run(args) -> exit code.
    module = importlib.import_module(args.module)
    sub = argparse.ArgumentParser(
        prog=f"python -m attnlib {args.command}", description=COMMANDS[args.command][1]
    )
    module.add_arguments(sub)
    return module.run(sub.parse_args(rest))


if __name__ == "__main__":
    sys.exit(main())
