"""Splits TRAIN_ARGS into train.py's arguments as a POSIX shell splits words, and evaluates nothing:
quotes group and are removed, a backslash escapes, a newline separates like a space; $(...),
backticks, $VARIABLES, globs and # stay literal text.

    python3 train_args.py    reads TRAIN_ARGS; writes each word NUL-terminated to stdout

Exit 64 with one line (on stdout, for script.sh to say) when the text cannot be split: an
unbalanced quote or a lone backslash at the end. Nothing is ever dropped silently.
"""

from __future__ import annotations

import os
import shlex
import sys


def split(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=False)  # '#' is part of a value (--set run.name=a#1)
    except ValueError as err:
        shown = text if len(text) <= 200 else text[:200] + "..."
        problem = "ends in a lone backslash" if "escaped" in str(err) else "has an unbalanced quote"
        raise ValueError(f"TRAIN_ARGS {problem} ({shown!r}); fix TRAIN_ARGS in job.yaml: quote a value "
                         "with spaces whole, e.g. --set 'run.name=a b'") from None


def main() -> int:
    try:
        words = split(os.environ.get("TRAIN_ARGS", ""))
    except ValueError as err:
        print(err)
        return 64
    sys.stdout.write("".join(word + "\0" for word in words))
    return 0


if __name__ == "__main__":
    sys.exit(main())
