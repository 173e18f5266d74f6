"""`make chaos`: brings up a stack with two workers per model, runs the fault scenarios and the bad inputs,
prints the tables, and exits non-zero if any request went unanswered, any log row was lost or doubled, any
reply subscription leaked, or the fuzzer (`chaos/fuzz.py`) found a failure or an error.

    .venv/bin/python -m chaos                 # every scenario (under 20 minutes)
    .venv/bin/python -m chaos --quick         # worker kill, Redis outage, API SIGTERM (about 3 minutes)
    .venv/bin/python -m chaos --only poison redis-outage
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
from pathlib import Path

from chaos import fuzz
from chaos.bad_inputs import bad_input_table, run_bad_inputs
from chaos.scenarios import QUICK, SCENARIOS, ChaosContext
from chaos.traffic import GRACE_SECONDS
from chaos.verdict import table
from contract.settings import api_key_digest
from emulators.stack import ROOT, StackConfig, configuring_variables, down, up

log = logging.getLogger("chaos")
RESULTS = ROOT / "chaos" / "results"
# The models the chaos stack serves beside `make up`'s: the overload scenario's (chaos/overload.py).
CHAOS_CATALOG_OVERLAY = ROOT / "chaos" / "models.chaos.yaml"
# Below 32768: the ephemeral port range starts there, and a client's port could take one of the stack's.
PORT_OFFSET = 23000
CHAOS_KEY = "chaos-key"
# The admin key the fuzzer runs the admin operations with (traffic splits, adapter registration).
CHAOS_ADMIN_KEY = "chaos-admin-key"
# A second key with tight limits, for the burst scenario: 60 requests a minute, 4 at a time.
LIMITED_KEY = "chaos-limited-key"
LIMITED_KEY_LIMITS = (60, 4)


def chaos_place(env) -> tuple[int, Path]:
    """The chaos stack's port offset and folder: MAAS_CHAOS_PORT_OFFSET / MAAS_CHAOS_STACK_DIR when set; else a
    test slot's MAAS_TEST_PORT_OFFSET (its own `.stack-chaos-<offset>`, so it runs beside other stacks); else 23000
    and `.stack-chaos`."""
    slot = env.get("MAAS_TEST_PORT_OFFSET")
    offset = int(env.get("MAAS_CHAOS_PORT_OFFSET") or slot or PORT_OFFSET)
    default_dir = ROOT / (
        f".stack-chaos-{offset}" if slot and not env.get("MAAS_CHAOS_PORT_OFFSET") else ".stack-chaos"
    )
    return offset, Path(env.get("MAAS_CHAOS_STACK_DIR", default_dir)).resolve()


def chaos_config() -> StackConfig:
    # The stack's processes inherit this environment: the API enforces the limited key's limits.
    per_minute, concurrent = LIMITED_KEY_LIMITS
    os.environ["MAAS_KEY_LIMITS"] = f"{api_key_digest(LIMITED_KEY)}={per_minute}/{concurrent}"
    offset, stack_dir = chaos_place(os.environ)
    return StackConfig(
        stack_dir=stack_dir,
        port_offset=offset,
        worker_replicas=2,
        # The overload scenario's model, sleep-admitted, and nothing else of the tests' fixtures: those include
        # versions that fail every request on purpose, which the fuzzing would report as server errors.
        extra_overlay=str(CHAOS_CATALOG_OVERLAY),
        api_keys=f"{CHAOS_KEY},{LIMITED_KEY}",
        api_keys_from_env=True,
        environment={**configuring_variables(os.environ), "MAAS_ADMIN_KEYS": CHAOS_ADMIN_KEY},
    )


def context(config: StackConfig) -> ChaosContext:
    from contract.settings import Settings

    os.environ.update(config.client_env())
    settings = Settings.from_env({**os.environ, "MAAS_API_KEYS": f"{CHAOS_KEY},{LIMITED_KEY}"})
    return ChaosContext.for_stack(
        config, settings, {"Authorization": f"Bearer {CHAOS_KEY}"},
        limited_headers={"Authorization": f"Bearer {LIMITED_KEY}"},
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 3-minute subset")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="run only these scenarios")
    parser.add_argument("--no-bad-inputs", action="store_true")
    parser.add_argument("--keep", action="store_true", help="leave the stack up afterwards")
    parser.add_argument("--repeat", type=int, default=1, help="run the scenarios this many times on one stack")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    names = args.only or (list(QUICK) if args.quick else list(SCENARIOS))
    config = chaos_config()
    began = time.monotonic()
    run_name = f"{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}-{os.getpid()}"
    config = up(config)
    results, bad, fuzzed = [], [], []
    try:
        ctx = context(config)
        for repeat in range(1, args.repeat + 1):
            ctx.evidence_dir = RESULTS / "runs" / (run_name if args.repeat == 1 else f"{run_name}-{repeat}")
            for name in names:
                log.info("scenario %s ...", name)
                result = SCENARIOS[name](ctx)
                log.info("scenario %s (run %d): %s in %.0fs, sent %d, ok %d, unanswered %d, missing rows %d; %s",
                         name, repeat, "PASS" if result.passed else "FAIL", result.seconds, result.sent, result.ok,
                         result.unanswered, result.missing_rows, "; ".join(result.notes))  # fmt: skip
                results.append(result)
        if not args.no_bad_inputs:
            log.info("bad inputs ...")
            bad = run_bad_inputs(config.api_url, ctx.headers)
            # Per operation: ~20 operations, so the full run generates well over 1,000 cases. No answer may take
            # longer than the slowest model's sync wait (then it is a job) plus the harness's grace.
            request_timeout = max(ctx.timeouts.values()) + GRACE_SECONDS
            fuzz_runs = fuzz.runs(CHAOS_KEY, CHAOS_ADMIN_KEY)
            fuzzed = fuzz.fuzz(config.api_url, fuzz_runs, 15 if args.quick else 120, request_timeout)
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
        report += ["", bad_input_table(bad)]
    for result in fuzzed:
        report += ["", "```", result.report(), "```"]
    if bad and not fuzzed:
        report += ["", "schemathesis is not installed: the fuzz was skipped"]
    text = "\n".join(report)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    # Only a full run replaces the table the docs quote (docs/results/faults.md); subsets are kept beside it.
    name = "partial.md" if args.only else "quick.md" if args.quick else "latest.md"
    (RESULTS / name).write_text(text + "\n")
    failed = [r.name for r in results if not r.passed] + [b.name for b in bad if not b.passed]
    failed += [f"schemathesis ({result.run.label})" for result in fuzzed if not result.passed]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
