"""`python -m omnifleet_runtime master|stage ARGS` (what `omnifleet master|stage` runs)."""

import sys

from .commands import master, stage


def main(argv: list[str]) -> int:
    commands = {"master": master, "stage": stage}
    if not argv or argv[0] not in commands:
        print("usage: python -m omnifleet_runtime {master|stage} [ARGS]", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
