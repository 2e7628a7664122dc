"""pytest plugin (entry point `pytest11`): the fixture `mrv2_check_against_eager`
is `compile_backend.testing.check_against_eager`, for checking a user's own
model against eager in every graph mode. Imports nothing until used."""

import pytest


@pytest.fixture
def mrv2_check_against_eager():
    from compile_backend.testing import check_against_eager

    return check_against_eager
