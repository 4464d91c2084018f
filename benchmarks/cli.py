"""The benchmarks' command lines: help built from the module docstring, its whole first paragraph as the description."""

import argparse


def parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser described by the docstring's first paragraph (joined, never cut mid-sentence), with the rest
    of the docstring (usage examples) as its epilog, laid out as written."""
    first, _, rest = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(prog=prog, description=" ".join(first.split()), epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
