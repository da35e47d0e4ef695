"""A rank that raises ends the whole group with an error on every rank, never a hang.

The failing rank aborts the group: it writes its error to the rendezvous store and tears
its process group down, which fails its peers' pending collectives at once. Each peer then
raises :class:`GroupAborted` carrying the failing rank's own message. Both cases below have
a peer blocked in a collective when the failure happens: inside the model's all-reduce
(the failing rank raised in its last MLP, before that MLP's all-reduce), or inside the
executor's decision exchange (the failing rank raised before its step).
"""

import pytest
from tests.helpers.rank_jobs import JOB_TIMEOUT_S, RaiseBeforeStep, RaiseInForward, run_scenario
from tests.helpers.scenarios import forced_scenario

from tensorrt_llm._torch.distributed.communicator import Phase
from tensorrt_llm._torch.distributed.launcher import RankContext

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

FAILING_RANK = 1


@pytest.mark.parametrize("plant", [RaiseInForward(3), RaiseBeforeStep(3)], ids=["in the forward", "before the step"])
def test_a_failing_rank_ends_the_group_with_an_error_on_every_rank(rank_group, plant):
    group = rank_group(2)
    results = group.run(run_scenario, forced_scenario("recheck"), False, True, plant, FAILING_RANK,
                        timeout_s=JOB_TIMEOUT_S)
    failing, peer = results[FAILING_RANK], results[1 - FAILING_RANK]
    assert not failing.ok and "planted failure" in failing.error, failing
    assert "iteration 3" in failing.error, failing.error
    assert peer.error_type == "GroupAborted", (peer.error_type, peer.error)
    assert f"rank {FAILING_RANK} failed at iteration 3" in peer.error and "planted failure" in peer.error, peer.error
    # the group is usable again for the next job (a fresh process group)
    assert group.run_ok(_exchange_ranks) == [[0, 1], [0, 1]]


def _exchange_ranks(ctx: RankContext) -> list[int]:
    return [c.values[0] for c in ctx.comm.exchange(Phase.GATHER, 0, (ctx.rank,))]
