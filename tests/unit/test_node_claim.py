"""The node-name rule: one live agent per node name, an agent restarted on its host at once."""
from dilu.contracts.events import NodeInventory
from dilu.services.node_agent.claim import claim_refusal, host_identity, pid_alive

NOW = 1_000_000 * 10**9


def held(**kw) -> NodeInventory:
    base = dict(node="n1", agent_id="old", host="h/boot", pid=4321, ts_ns=NOW - 2 * 10**9)
    return NodeInventory(**{**base, **kw})


def refusal(inv, *, host="h/boot", alive=True):
    return claim_refusal(inv, agent_id="new", host=host, now_ns=NOW, ttl_s=15, alive=lambda pid: alive)


def test_free_stale_or_own_names_are_taken():
    assert refusal(None) is None
    assert refusal(held(ts_ns=NOW - 16 * 10**9)) is None  # heartbeat older than the TTL: gone
    assert claim_refusal(held(agent_id="new"), agent_id="new", host="x", now_ns=NOW, ttl_s=15) is None


def test_a_restart_on_the_same_host_takes_over_at_once():
    assert refusal(held(), alive=False) is None  # same host, its process is dead (stop or kill -9)


def test_a_live_twin_is_refused_with_where_it_runs():
    here = refusal(held(), alive=True)
    assert "this host" in here and "pid 4321" in here and "--node" in here
    there = refusal(held(host="other/boot2"), alive=False)  # another machine: its pid means nothing here
    assert there and "host other" in there


def test_identity_and_liveness_of_this_process():
    import os
    assert host_identity().count("/") == 1
    assert pid_alive(os.getpid()) and not pid_alive(0)
