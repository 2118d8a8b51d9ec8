"""The ``case`` fixture over every loss; the helpers the tests share are in
``helpers.py``, the Triton interpreter switch in the checkout's ``conftest.py``."""

from __future__ import annotations

from typing import Any

import pytest

from helpers import CASES, Case


@pytest.fixture(params=sorted(CASES))
def case(request: Any) -> Case:
    return CASES[request.param]
