"""Every planner test starts and ends with this process's plan caches and metadata cache empty, so
that no test sees plans or metadata another test left behind."""

import pytest

from fastdcp.load import metadata_cache as MC
from fastdcp.planners import plan_cache as PC


@pytest.fixture(autouse=True)
def _fresh_caches():
    PC.clear_plan_caches()
    MC.clear_metadata_cache()
    yield
    PC.clear_plan_caches()
    MC.clear_metadata_cache()
