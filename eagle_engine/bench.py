"""Placeholder: filled in by its issue."""
import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    return None
