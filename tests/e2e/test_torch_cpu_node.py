"""A user's real torch handler serves inferences through the whole NATS path on a CPU node:
loadgen client -> JetStream work queue -> instance launched by the node agent from the
scheduler's placement table -> handler -> reply to the caller's inbox."""
import asyncio
import time

import nats
import pytest

from dilu.cli.cluster import Cluster
from dilu.cli.deploy import cpu_function_spec, deploy_all
from dilu.contracts import encode, subjects
from dilu.contracts import events as ev
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.workqueue import ensure_consumer, ensure_stream

pytestmark = [pytest.mark.nats, pytest.mark.slow]


async def test_torch_handler_serves_real_inferences(tmp_path):
    # no initial instance: this test places the instance itself and sees its cold start
    cluster = Cluster(log_dir=tmp_path / "logs", gpus="cpu", extra_args={"horizontal_scaler": ["--initial-scale", "0"]})
    await asyncio.to_thread(cluster.start)
    try:
        nc = await nats.connect(cluster.url)
        js = nc.jetstream()
        await ensure_stream(js)
        await ensure_consumer(js, "cnn")
        # a CPU node has no GPU to profile on: the spec carries the operator's profile
        await deploy_all(nc, [cpu_function_spec("cnn", 2)])
        await asyncio.sleep(0.5)
        reply = await nc.request(subjects.SCHEDULER_PLACE, encode(ev.PlaceRequest(function="cnn")), timeout=10)
        assert b'"ok":true' in reply.data, reply.data

        client = InvokeClient(nc, js)
        await client.start()
        now = time.time_ns()
        results = await asyncio.gather(*(
            client.invoke("cnn", b"x" * i, request_id=f"r{i}", scheduled_ns=now, timeout_s=60) for i in range(1, 13)))
        await client.close()
        assert [r.status for r in results] == ["ok"] * 12, [r.error for r in results]
        assert all(0 <= int(r.payload) < 10 for r in results)  # a class index from the CNN
        # the first requests waited for the instance's launch: they are cold starts
        assert any(r.cold_start for r in results)
        await nc.drain()
    finally:
        await asyncio.to_thread(cluster.stop)
