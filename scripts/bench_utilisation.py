"""stub"""
import argparse
def add_arguments(p: argparse.ArgumentParser) -> None: ...
def run(args: argparse.Namespace) -> int: return 1
