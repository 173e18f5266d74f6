"""`make chaos`: brings up a stack with two workers per model, runs the fault scenarios and the bad inputs,
prints the tables, and exits non-zero if any request went unanswered, any log row was lost or doubled, or
any reply subscription leaked.

    .venv/bin/python -m chaos                 # every scenario (under 20 minutes)
    .venv/bin/python -m chaos --quick         # worker kill, Redis outage, API SIGTERM (about 3 minutes)
    .venv/bin/python -m chaos --only poison redis-outage
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from chaos.bad_inputs import bad_input_table, run_bad_inputs
from chaos.scenarios import QUICK, SCENARIOS, ChaosContext
from chaos.verdict import table
from contract.settings import api_key_digest
from emulators.stack import ROOT, StackConfig, down, up

log = logging.getLogger("chaos")
RESULTS = ROOT / "chaos" / "results"
# Below 32768: the ephemeral port range starts there, and a client's port could take one of the stack's.
PORT_OFFSET = 23000
CHAOS_KEY = "chaos-key"
# A second key with tight limits, for the burst scenario: 60 requests a minute, 4 at a time.
LIMITED_KEY = "chaos-limited-key"
LIMITED_KEY_LIMITS = (60, 4)


def chaos_config() -> StackConfig:
    # The stack's processes inherit this environment: the API enforces the limited key's limits.
    per_minute, concurrent = LIMITED_KEY_LIMITS
    os.environ["MAAS_KEY_LIMITS"] = f"{api_key_digest(LIMITED_KEY)}={per_minute}/{concurrent}"
    return StackConfig(
        stack_dir=Path(os.environ.get("MAAS_CHAOS_STACK_DIR", ROOT / ".stack-chaos")).resolve(),
        port_offset=int(os.environ.get("MAAS_CHAOS_PORT_OFFSET", PORT_OFFSET)),
        worker_replicas=2,
        api_keys=f"{CHAOS_KEY},{LIMITED_KEY}",
        api_keys_from_env=True,
    )


def context(config: StackConfig) -> ChaosContext:
    from contract.settings import Settings

    os.environ.update(config.client_env())
    settings = Settings.from_env({**os.environ, "MAAS_API_KEYS": f"{CHAOS_KEY},{LIMITED_KEY}"})
    return ChaosContext.for_stack(
        config, settings, {"Authorization": f"Bearer {CHAOS_KEY}"},
        limited_headers={"Authorization": f"Bearer {LIMITED_KEY}"},
    )  # fmt: skip


def schemathesis_run(api_url: str, examples: int) -> str:
    """The property-based run against /openapi.json (`examples` per operation), when schemathesis is installed."""
    binary = Path(sys.executable).with_name("schemathesis")
    if not binary.exists():
        return "schemathesis is not installed: skipped"
    argv = [
        str(binary), "run", f"{api_url}/openapi.json", f"--max-examples={examples}",
        "--checks=not_a_server_error,response_schema_conformance", f"--header=Authorization: Bearer {CHAOS_KEY}",
    ]  # fmt: skip
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    lines = completed.stdout.strip().splitlines()
    # A failure is kept whole (what failed, the response, how to reproduce), not only the summary's count.
    start = next((i for i, line in enumerate(lines) if "FAILURES" in line), None)
    end = next((i for i, line in enumerate(lines) if "WARNINGS" in line or "SUMMARY" in line), len(lines))
    failures = lines[start:end][:60] if start is not None and start < end else []
    return "\n".join([f"schemathesis exit {completed.returncode}", *failures, *lines[-12:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 3-minute subset")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="run only these scenarios")
    parser.add_argument("--no-bad-inputs", action="store_true")
    parser.add_argument("--keep", action="store_true", help="leave the stack up afterwards")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    names = args.only or (list(QUICK) if args.quick else list(SCENARIOS))
    config = chaos_config()
    began = time.monotonic()
    config = up(config)
    results, bad = [], []
    try:
        ctx = context(config)
        for name in names:
            log.info("scenario %s ...", name)
            result = SCENARIOS[name](ctx)
            log.info("scenario %s: %s in %.0fs %s", name, "PASS" if result.passed else "FAIL", result.seconds,
                     "; ".join(result.notes))  # fmt: skip
            results.append(result)
        if not args.no_bad_inputs:
            log.info("bad inputs ...")
            bad = run_bad_inputs(config.api_url, ctx.headers)
            # Per operation: ~10 operations, so the full run generates well over 1,000 cases.
            fuzz = schemathesis_run(config.api_url, 15 if args.quick else 120)
    finally:
        if not args.keep:
            down(config)
    report = [
        f"Chaos run {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {time.monotonic() - began:.0f} s",
        "",
    ]
    report += [table(results)]
    report += [f"- {result.name}: {note}" for result in results for note in result.notes]
    if bad:
        report += ["", bad_input_table(bad), "", "```", fuzz, "```"]
    text = "\n".join(report)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    # Only a full run replaces the table the README quotes; subsets are kept beside it.
    name = "partial.md" if args.only else "quick.md" if args.quick else "latest.md"
    (RESULTS / name).write_text(text + "\n")
    failed = [r.name for r in results if not r.passed] + [b.name for b in bad if not b.passed]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
