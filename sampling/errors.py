"""The one error type draftsmith raises for what it refuses or cannot do.

Each message is one line that says what was wrong and how to fix it; the commands print it after `error: ` and
exit 2. A library user catches `DraftsmithError` alone. It is a ValueError (most refusals are of bad input), and two
kinds are also what they are to Python: `DiskFull` an OSError, `MissingExtra` (train/__init__.py) an ImportError.
"""


class DraftsmithError(ValueError):
    """What draftsmith refuses or could not do, in one line with the fix."""
