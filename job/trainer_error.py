"""What a failed trainer said: torchrun's TORCHELASTIC_ERROR_FILE, as script.sh needs it.

    python3 trainer_error.py FILE    # prints two lines: the worker's exit code (or nothing), its message

torchrun itself exits 1 whatever its workers' codes; the first failed worker's error file carries
the real one (train.py and finetune.py record 64 there for bad input, 138 for a lost peer). When
torchrun itself failed to gather the group (its rendezvous timed out or was closed: the file holds
its own exception, no worker code), the code is 75: the Job's next try may find every pod there.
A file that is missing, not JSON or not shaped like torchrun's prints an empty code and "see its
traceback above".
"""

from __future__ import annotations

import json
import sys

import contract  # standard library only, like this file

NO_MESSAGE = "see its traceback above"
RENDEZVOUS_FAILED = contract.EXIT_UNAVAILABLE
# torchrun's own exception class names start so:
RENDEZVOUS_ERRORS = "Rendezvous"  # RendezvousTimeoutError, RendezvousClosedError, RendezvousConnectionError
MAX_MESSAGE = 300
MAX_BYTES = 1 << 20


def read(path: str) -> tuple[int | None, str]:
    """(the worker's exit code or None, the first line of its message)."""
    try:
        with open(path, "rb") as file:
            record = json.loads(file.read(MAX_BYTES))
        message = record["message"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None, NO_MESSAGE
    if not isinstance(message, dict):
        return None, NO_MESSAGE
    code = message.get("errorCode")
    code = code if isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 255 else None
    text = message.get("message")
    first = text.splitlines()[0][:MAX_MESSAGE] if isinstance(text, str) and text.strip() else NO_MESSAGE
    if code is None and first.startswith(RENDEZVOUS_ERRORS):
        code = RENDEZVOUS_FAILED
        first = f"torchrun's rendezvous failed ({first.rstrip(': ')}): not every node of the group was there in time"
    return code, first


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: trainer_error.py FILE", file=sys.stderr)
        return 64
    code, message = read(argv[0])
    print("" if code is None else code)
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
