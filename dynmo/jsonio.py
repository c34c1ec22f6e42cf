"""JSON input for the pure CLIs (`dynmo balance`, `dynmo simulate`): a file path or `-` for stdin."""

from __future__ import annotations

import json
import sys
from typing import Any


def read_json(path: str) -> Any:
    """Parsed JSON from `path` (or stdin for "-"); ValueError with a one-line reason otherwise."""
    try:
        if path == "-":
            return json.load(sys.stdin)
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
