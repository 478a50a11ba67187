"""Placeholder: filled in by its issue."""
import argparse


def add_selfcheck_parser(sub: argparse._SubParsersAction) -> None:
    return None
