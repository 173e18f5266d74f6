"""A process for tests/unit/test_launcher.py to launch: says what it is (pid, session, directory, environment,
argv, a draw from numpy's global random state) in the file `PROBE_OUT` names, prints a line, then exits with `PROBE_EXIT` or waits to be
stopped."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy

if __name__ == "__main__":
    facts = {"pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "marker": os.environ.get("PROBE_MARKER"),
             "argv": sys.argv, "draw": float(numpy.random.random()), "name": __name__}  # fmt: skip
    with open(os.environ["PROBE_OUT"] + ".tmp", "w") as out:
        json.dump(facts, out)
    os.replace(os.environ["PROBE_OUT"] + ".tmp", os.environ["PROBE_OUT"])
    print("probe says hello", flush=True)
    if "PROBE_EXIT" in os.environ:
        sys.exit(int(os.environ["PROBE_EXIT"]))
    time.sleep(120)
