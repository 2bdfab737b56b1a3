"""``python -m tokenmill.server [MODEL] [options]``: the same as ``tokenmill serve``."""

from __future__ import annotations

import argparse

from tokenmill.server.cli_args import add_serve_args, run_server


def main() -> None:
    parser = argparse.ArgumentParser(prog="tokenmill serve", description="OpenAI-compatible tokenmill server")
    add_serve_args(parser)
    run_server(parser.parse_args())


if __name__ == "__main__":
    main()
