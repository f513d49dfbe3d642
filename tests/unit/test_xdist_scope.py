"""How ``make test`` splits the suite between its xdist sessions (tests/conftest.py)."""

from __future__ import annotations

from tests.conftest import xdist_scope


def test_a_file_is_one_unit_and_every_stack_test_shares_the_serial_one() -> None:
    assert xdist_scope("tests/unit/test_a.py::test_x[1]") == "tests/unit/test_a.py"
    assert xdist_scope("tests/unit/test_a.py::test_y") == "tests/unit/test_a.py"
    assert xdist_scope("tests/chaos/test_chaos_load.py::test_z") == "serial"
    assert xdist_scope("tests/e2e/test_up_stack.py::test_w[clover]") == "serial"


def test_the_schemathesis_file_splits_into_its_valid_and_invalid_halves() -> None:
    path = "tests/integration/test_schemathesis_api.py"
    valid = {xdist_scope(f"{path}::test_api_conforms_to_its_schema[{op}-valid]")
             for op in ("GET /livez", "POST /v1/jobs", "GET /v1/jobs/{job_id}")}
    invalid = {xdist_scope(f"{path}::test_api_conforms_to_its_schema[{op}-invalid]")
               for op in ("GET /livez", "POST /v1/jobs")}
    assert valid == {f"{path}[valid]"} and invalid == {f"{path}[invalid]"}
