"""Whether the vLLM engine suite's run passed: every test passed, or skipped for a missing CPU feature.

Why a verdict of its own: a broken vLLM install makes the engine's tests skip (`importorskip`), and a skip must
not pass as success; but a test that needs AMX skips on every CPU without it (every AMD CPU, Intel before
Sapphire Rapids), and that must not fail the run. So a skip passes only with a reason from
`kvcluster.cpu_features.HARDWARE_SKIP_REASONS`, and pytest must report it as such (`-rs`, the "short test
summary info" lines `SKIPPED [N] path:line: reason`): a skip whose reason is not listed fails the run.
"""

from __future__ import annotations

import re

from kvcluster.cpu_features import HARDWARE_SKIP_REASONS

SKIP_LINE = re.compile(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$")
OUTCOMES_OK = {"passed", "skipped", "warning", "warnings"}


def outcome_counts(output: str) -> dict[str, int]:
    """pytest's closing summary ("7 passed, 1 skipped in 35.21s") as {outcome: count}."""
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary.split(" in ")[0])}


def skip_reasons(output: str) -> list[tuple[int, str]]:
    """(count, reason) of every skip line in the short test summary."""
    return [(int(m.group(1)), m.group(2).strip()) for line in output.splitlines()
            if (m := SKIP_LINE.match(line.strip()))]


def problems(returncode: int, output: str) -> list[str]:
    """Why the engine suite's run did not pass; empty when it did."""
    found = []
    counts = outcome_counts(output)
    if returncode != 0:
        found.append(f"the run exited {returncode}")
    if counts.get("passed", 0) == 0:
        found.append("no test passed")
    if set(counts) - OUTCOMES_OK:
        found.append(f"outcomes other than passed or a hardware skip: {counts}")
    reasons = skip_reasons(output)
    for n, reason in reasons:
        if reason not in HARDWARE_SKIP_REASONS:
            found.append(f"{n} skipped for a reason that is not a missing CPU feature: {reason!r}")
    if counts.get("skipped", 0) != sum(n for n, _ in reasons):
        found.append(f"{counts.get('skipped', 0)} skipped, but {sum(n for n, _ in reasons)} skip reasons listed "
                     f"(run pytest with -rs)")
    return found
