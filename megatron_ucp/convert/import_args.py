"""The flags every import command takes (Hugging Face, DeepSpeed): a source folder, the output,
parallel writers and the progress bar."""

import argparse

from megatron_ucp.errors import ConfigError


def import_parser(prog: str, description: str, source: str, source_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument(source, help=source_help)
    p.add_argument("output", help="where the universal checkpoint goes")
    p.add_argument("--workers", type=int, default=1, help="write this many atomic tensors in parallel processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--staging-dir", default=None,
                   help="an object-store source (s3://, msc://) is downloaded here first, an object-store "
                        "output written here, then uploaded (default: TMPDIR); it needs room for them")
    return p


def parse_import_args(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    return args
