"""`python -m gradsync.launch ARGS` == `gradsync run ARGS`, without importing the other subcommands."""
import argparse
import sys

from gradsync.fastexit import exit_now
from gradsync.launch.cli import add_parser, main

parser = argparse.ArgumentParser(prog="gradsync")
add_parser(parser.add_subparsers(dest="command_name", required=True))
exit_now(main(parser.parse_args(["run", *sys.argv[1:]])))
