"""The command line: `python -m attnlib check-qwen3 | bench | train-lm ...`.

Each command imports its heavy libraries (transformers; matplotlib and tqdm) only when it runs.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch


def _write_json(path: str, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU")
    return device


def qwen3_arguments(parser) -> None:
    """The options of `check-qwen3`."""
    parser.add_argument(
        "--model",
        default=None,
        help="Hub id or local folder of a Qwen3 checkpoint (safetensors); default: random weights "
        "with Qwen/Qwen3-0.6B's attention geometry, nothing downloaded",
    )
    parser.add_argument("--layer", type=int, default=0, help="which layer's attention (default 0)")
    parser.add_argument("--seq-len", type=int, default=12, help="tokens per sequence (default 12)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float64"], default="float32")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda if any)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="artifacts/attention_check.json", help="JSON report path")


def _qwen3_report(args) -> dict:
    from huggingface_hub.utils import logging as hub_logging
    from transformers import logging as hf_logging

    from . import qwen3
    from .checkpoint import load_layer

    if args.seq_len < 3:
        raise ValueError(f"--seq-len must be at least 3, got {args.seq_len}")
    device, dtype = _device(args.device), qwen3.DTYPES[args.dtype]
    if args.model is None:
        layer = qwen3.random_layer(args.seed, dtype)
        return qwen3.report(layer.to(device), seq_len=args.seq_len, seed=args.seed)
    verbosity = hf_logging.get_verbosity(), hub_logging.get_verbosity()
    try:  # on failure stderr gets our one line, not the libraries' warnings and retries
        hf_logging.set_verbosity_error()
        hub_logging.set_verbosity_error()
        layer = load_layer(args.model, args.layer, dtype).to(device)
    finally:
        hf_logging.set_verbosity(verbosity[0])
        hub_logging.set_verbosity(verbosity[1])
    return qwen3.report(layer, args.model, args.model, args.layer, args.seq_len, seed=args.seed)


def check_qwen3(args) -> int:
    """Check the manual pass against a Qwen3 layer; print and save the report.

    Returns 0 on a match, 1 on a mismatch, 2 (with one "error: ..." line on stderr) on bad input.
    """
    from .checkpoint import first_line
    from .qwen3 import format_report

    try:
        result = _qwen3_report(args)
    except (ValueError, RuntimeError) as err:
        print(f"error: {first_line(err)}", file=sys.stderr)
        return 2
    print(format_report(result))
    _write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0 if result["match"] else 1


def bench_arguments(parser) -> None:
    """The options of `bench`."""
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths T (= S)")
    parser.add_argument("--naive-max", type=int, help="largest T for the naive method")
    parser.add_argument("--heads", type=int, help="heads H (default 8)")
    parser.add_argument("--dim", type=int, help="head dimension D (default 64)")
    parser.add_argument("--repeats", type=int, help="timed rounds per size (default 5)")
    parser.add_argument("--block-size", type=int, default=256, help="tiled_attention's block")
    parser.add_argument("--out", default="artifacts/bench.json", help="JSON report path")
    parser.add_argument("--plot", default="artifacts/bench.png", help="PNG plot path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")


def bench_settings(args) -> dict:
    """The bench's settings: --quick or full defaults, overridden by the options given."""
    from .bench import FULL, QUICK

    defaults = QUICK if args.quick else {**FULL, "repeats": 5}
    chosen = {key: getattr(args, key) for key in defaults if getattr(args, key) is not None}
    settings = {**defaults, **chosen, "block_size": args.block_size, "seed": args.seed}
    for key in ("naive_max", "heads", "dim", "repeats", "block_size"):
        if settings[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {settings[key]}")
    if min(settings["sizes"]) < 1:
        raise ValueError(f"--sizes must be positive, got {settings['sizes']}")
    settings["sizes"] = sorted(set(settings["sizes"]))
    return settings


def bench(args) -> int:
    """Measure, print the table, write the JSON report and the PNG plot."""
    from tqdm import tqdm

    from . import bench
    from .timing import matmul_rate

    try:
        settings = bench_settings(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    rate = matmul_rate((128, 256) if args.quick else (512, 1024, 2048))
    rows = []
    for length in tqdm(settings["sizes"], desc="bench", unit="size"):
        rows += bench.measure_size(length, settings)
    exponents = bench.summarise(rows, settings, rate)
    machine = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    machine.update(cpus=os.cpu_count(), processor=platform.processor() or platform.machine())
    report = {"settings": settings, "machine": machine, "matmul_rate": rate, "results": rows}
    report.update(exponents=exponents, wall_s=time.perf_counter() - started)
    print(f"measured matmul rate: {rate['gflops']:.1f} GFLOP/s ({rate['shape']})")
    print(bench.table(rows, exponents))
    _write_json(args.out, report)
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    bench.plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot} in {report['wall_s']:.1f} s")
    return 0


def lm_arguments(parser) -> None:
    """The options of `train-lm`."""
    parser.add_argument("--out", default="artifacts/stdlib_lm", help="checkpoint folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a tiny model in seconds, for tests")
    parser.add_argument("--steps", type=int, help="training steps (default 1000; tiny 40)")
    parser.add_argument(
        "--repeat-fraction", type=float, help="share of windows given a repeated segment (0)"
    )


def train_lm(args) -> int:
    """Train the small Qwen3 on the standard library through attnlib's attention; save it."""
    from . import lm

    settings = lm.TINY if args.tiny else lm.Settings()
    if args.steps is not None:
        if args.steps < 1:
            print(f"error: --steps must be at least 1, got {args.steps}", file=sys.stderr)
            return 2
        settings = settings._replace(steps=args.steps)
    if args.repeat_fraction is not None:
        if not 0.0 <= args.repeat_fraction <= 1.0:
            print("error: --repeat-fraction must be in [0, 1]", file=sys.stderr)
            return 2
        settings = settings._replace(repeat_fraction=args.repeat_fraction)
    report = lm.train(args.out, args.seed, settings)
    print(
        f"trained {report['parameters']:,} parameters in {report['train_seconds']:.0f} s: "
        f"train loss {report['final_train_loss']:.3f}, held-out {report['heldout_loss']:.3f} "
        f"nats/token, {report['heldout_bits_per_byte']:.3f} bits/byte; wrote {args.out}"
    )
    return 0


def fusion_arguments(parser) -> None:
    """The options of `bench-fusion` (attnlib.lab.fusion)."""
    from . import fusion

    fusion.arguments(parser)


def bench_fusion(args) -> int:
    """Time tiled_attention's torch and cpp inners against SDPA; write the JSON report."""
    from . import fusion

    return fusion.run(args)


def mqar_arguments(parser) -> None:
    """The options of `train-mqar`."""
    from .recall import add_arguments

    add_arguments(parser)


def train_mqar(args) -> int:
    """Train softmax, linear and delta-rule recall models on MQAR; write the JSON report."""
    from . import recall

    return recall.run(args)


def length_arguments(parser) -> None:
    """The options of `train-length` (attnlib.lab.long_context)."""
    parser.add_argument("--out", default=None, help="folder (default: the shipped length_run)")
    parser.add_argument("--steps", type=int, default=1500, help="AdamW steps per model")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed")


def train_length(args) -> int:
    """Train copy-task models with RoPE, ALiBi and no positions; evaluate them longer."""
    from . import long_context

    out = long_context.LENGTH_RUN if args.out is None else args.out
    long_context.train_length(out, args.steps, args.seed)
    return 0


COMMANDS = {
    "check-qwen3": (qwen3_arguments, check_qwen3, "Check the book's attention against Qwen3."),
    "bench": (bench_arguments, bench, "Time and measure naive, tiled and fused attention."),
    "train-lm": (lm_arguments, train_lm, "Train the small Qwen3 on the standard library."),
    "bench-fusion": (fusion_arguments, bench_fusion, "Time tiled attention's two inners."),
    "train-mqar": (mqar_arguments, train_mqar, "Train small models on associative recall."),
    "train-length": (length_arguments, train_length, "Train RoPE, ALiBi, NoPE models long."),
}


def main(argv=None) -> int:
    """Parse `python -m attnlib COMMAND ...` and run the command; returns its exit code."""
    parser = argparse.ArgumentParser(prog="python -m attnlib")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (arguments, command, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        arguments(sub)
        sub.set_defaults(command_function=command)
    args = parser.parse_args(argv)
    return args.command_function(args)


if __name__ == "__main__":
    sys.exit(main())
