"""Schemathesis over the control plane's own ``/openapi.json``, against a real server process.

Every operation the document lists is fuzzed with bodies, path ids and query values generated from its
schemas (valid ones, and ones that break them, which must be refused), as admin (the bearer token) so the
admin routes are reached past their authentication; routes that need a ``Tether-Proof`` get none and must
answer 401. Checks: schemathesis's own, all but "schema-valid data is accepted" (a well-formed string that
is not a PEM key, or a capability the catalog lacks, is still a 400): no 5xx, every status documented,
every answer's body and headers (``Tether-Error`` on a refusal) as the document says, schema-invalid input
refused. Bounded: a fixed number of examples per operation and mode, derandomized, so the run is the same
each time and fits in the suite (``TETHER_FUZZ_EXAMPLES`` raises it for a longer run).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from .harness import ADMIN_TOKEN, ControlPlaneProcess, prepare_controlplane

EXAMPLES = int(os.environ.get("TETHER_FUZZ_EXAMPLES", "12"))
# Headers that frame the HTTP message itself. A malformed one is refused by aiohttp's parser before tether's code
# runs, with aiohttp's own text/plain 400 (a known limitation in the README), so generated values for them test
# aiohttp, not the API. Which values get generated depends on the literals in the loaded source (Hypothesis seeds
# generation with them), so without this a change anywhere in the code could surface that answer here.
FRAMING = {"transfer-encoding", "content-length", "connection", "host", "upgrade", "expect", "te"}


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProcess]:
    proc = prepare_controlplane(tmp_path_factory.mktemp("fuzz"), 1, 2, 3).start()
    try:
        # Something to find: an agent with a child, so ids in the store are not all unknown.
        root = proc.issue("fuzz-root", {"issues.read": "direct"})
        child = proc.delegate(root, "fuzz-child", {"issues.read": "direct"})
        proc.client().request("POST", "/v1/chains/register", {"chain": child.wire})
        yield proc
    finally:
        proc.stop()


def test_the_api_answers_every_generated_request_as_documented(cp: ControlPlaneProcess) -> None:
    """Each operation in turn, positive then negative data; every failure of every operation is reported."""
    schema = schemathesis.openapi.from_url(cp.url + "/openapi.json")
    # A schema-invalid body may also be too big: the API refuses any body past 8 MiB with 413 (documented on
    # every route with a body), which is a rejection as good as a 400.
    rejection = schema.config.checks.negative_data_rejection
    schema.config.checks.negative_data_rejection = type(rejection)(
        expected_statuses=[*rejection.expected_statuses, "413"])
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 30
    failures: list[str] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def fuzz(case: schemathesis.Case) -> None:
                for name in [n for n in case.headers or {} if n.lower() in FRAMING]:
                    del case.headers[name]
                case.call_and_validate(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30,
                                       excluded_checks=[positive_data_acceptance])

            try:
                fuzz()
            except Unsatisfiable:  # nothing of this operation can be made schema-invalid (no body, no query)
                assert mode is GenerationMode.NEGATIVE, operation.label
            except (Exception, BaseExceptionGroup) as exc:  # collected, then reported together
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)
