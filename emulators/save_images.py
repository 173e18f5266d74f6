"""Saves the images of a predict response read on stdin: `curl ... | python3 emulators/save_images.py NAME`.

Writes NAME.png (NAME-1.png, NAME-2.png, ... for several images) and prints one line per file; an error
response is printed and the exit status is 1. Standard library only, so any Python 3 runs it.
"""

from __future__ import annotations

import base64
import json
import sys


def main(argv: list[str]) -> int:
    name = argv[1] if len(argv) > 1 else "image"
    raw = sys.stdin.read()
    try:
        response = json.loads(raw)
    except ValueError:
        print(f"not a JSON response: {raw[:300]!r}", file=sys.stderr)
        return 1
    if "predictions" not in response:
        print(json.dumps(response.get("error", response)), file=sys.stderr)
        return 1
    predictions = response["predictions"]
    for index, prediction in enumerate(predictions):
        path = f"{name}.png" if len(predictions) == 1 else f"{name}-{index + 1}.png"
        data = base64.b64decode(prediction["image_b64"])
        with open(path, "wb") as out:
            out.write(data)
        size = f"{prediction.get('width')}x{prediction.get('height')}"
        print(f"saved {path} ({size}, {len(data)} bytes, seed {prediction.get('seed')})")
    print(f"request {response.get('request_id')}: {response.get('timings_ms', {}).get('total')} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
