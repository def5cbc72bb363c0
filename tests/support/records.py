"""A captured JSON record with some fields changed: the real bytes, one field at a time made wrong (or another
real value), for the codec tests' "a record that is not one" cases."""

from __future__ import annotations

import json
from typing import Any

DROP = object()
"""A change's value that removes the field."""


def rewritten(record: bytes | str, **changes: Any) -> bytes:
    """`record` with each change applied: `a__b=v` sets field b of map a to v (DROP removes it)."""
    obj = json.loads(record)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = obj
        for part in path:
            node = node[part]
        if value is DROP:
            del node[last]
        else:
            node[last] = value
    return json.dumps(obj).encode()
