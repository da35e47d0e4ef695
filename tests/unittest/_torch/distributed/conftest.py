"""Rank groups for the multi-rank tests: spawned once per session, on first use, shared by modules.

Spawning a rank means a new interpreter that imports torch (seconds on a busy 2-core
machine); a job on a live group costs milliseconds. So every multi-rank test sends its
cases to these groups as jobs. Ranks run with different string-hash salts
(``PYTHONHASHSEED``), so a decision that depended on one would show up as a divergence.
"""

import logging

import pytest
from tests.helpers.rank_jobs import COLLECTIVE_TIMEOUT_S

from tensorrt_llm._torch.distributed.launcher import LaunchOptions, RankGroup


@pytest.fixture(scope="session")
def rank_group():
    """``rank_group(n)``: the session's live group of ``n`` ranks (spawned on first use)."""
    groups: dict[int, RankGroup] = {}

    def get(world_size: int) -> RankGroup:
        group = groups.get(world_size)
        if group is None or group.closed:
            options = LaunchOptions(
                collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                hash_seeds=tuple(101 + rank for rank in range(world_size)),
                log_level=logging.CRITICAL,  # planted failures log tracebacks; results carry them
            )
            group = groups[world_size] = RankGroup(world_size, options)
        return group

    yield get
    for group in groups.values():
        group.close(kill=True)  # nothing to flush; a graceful exit of torch processes takes seconds
