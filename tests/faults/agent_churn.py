"""Instance churn against a real node agent, for measuring its memory per launch (not a test).

    .venv/bin/python tests/faults/agent_churn.py --cycles 150 --every 10

Starts nats-server and ``python -m dilu.services.node_agent`` (emulated, 2 GPUs) as the soak
does, then per cycle puts two placements in ``dilu-placement`` (one per GPU), waits for both
InstanceReady, sends each ``--requests`` requests (their kernels run on the emulated GPUs and fill
the GPUs' timelines, as under the soak's load), deletes the placements and waits for both
InstanceRetired: the agent's own launch and retire path. Every ``--every`` cycles it prints one JSON line of the agent's memory, bytes:
``uss`` (psutil), ``own`` (:func:`dilu.loadgen.chaos.own_bytes`: private dirty outside shared
memory, what ``dilu chaos --soak`` reports), ``shm_private`` (pages of /dev/shm segments only the
agent still maps) and ``anon`` (private dirty of anonymous mappings: heap, arenas, stacks). At
the end: each series' slope in bytes per launch over the cycles after the first sample.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time

import click
import nats
import psutil

from dilu.contracts import encode, subjects
from dilu.contracts import events as ev
from dilu.loadgen import chaos
from dilu.services.common import models
from dilu.services.common.jsresources import PLACEMENT_KV_CONFIG, ensure_kv
from dilu.services.common.invoke import InvokeClient
from dilu.services.common.natsserver import EmbeddedNats
from dilu.services.common.workqueue import ensure_consumer, ensure_stream
from dilu.services.node_agent import segments

MODEL = "bert_base"
SHM = str(segments.SHM_DIR) + "/"


def memory(pid: int) -> dict[str, int]:
    maps = psutil.Process(pid).memory_maps(grouped=True)
    return {"uss": psutil.Process(pid).memory_full_info().uss,
            "own": chaos.own_bytes(maps, str(segments.SHM_DIR)),
            "shm_private": sum(m.private_dirty + m.private_clean for m in maps if m.path.startswith(SHM)),
            "anon": sum(m.private_dirty for m in maps if not m.path.startswith("/"))}


def placement(iid: str, gpu: int) -> ev.Placement:
    return ev.Placement(instance_id=iid, function=f"churn{gpu}", node="n1", gpu=gpu, request_quota=0.3,
                        limit_quota=1.0, width=1.0, memory_bytes=models.memory_bytes(MODEL), batch_size=4,
                        model=MODEL, slo_ms=models.default_slo_ms(MODEL))


async def churn(cycles: int, every: int, warmup: int, requests: int) -> list[dict]:
    with EmbeddedNats() as server:
        agent = subprocess.Popen([sys.executable, "-m", "dilu.services.node_agent", "--nats-url", server.url,
                                  "--node", "n1", "--device", "emulated", "--gpus", "2", "--metrics-port", "0",
                                  "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_stream(js)
        for g in range(2):
            await ensure_consumer(js, f"churn{g}")
        client = InvokeClient(nc, js)
        await client.start()
        seen = {"ready": 0, "retired": 0}

        def counter(state):
            async def cb(_msg):
                seen[state] += 1
            return cb

        for state in seen:
            await nc.subscribe(subjects.instance_state(state, "n1"), cb=counter(state))
        kv, _ = await ensure_kv(js, PLACEMENT_KV_CONFIG, replicas=1)

        async def until(state, n):
            while seen[state] < n:
                if agent.poll() is not None:
                    raise SystemExit(f"the node agent exited ({agent.returncode})")
                await asyncio.sleep(0.02)

        samples = []
        try:
            for c in range(-warmup, cycles + 1):
                if c >= 0 and c % every == 0:
                    samples.append({"cycle": c, "launches": 2 * c, **memory(agent.pid)})
                    print(json.dumps(samples[-1]), flush=True)
                if c == cycles:
                    break
                ids = [f"c{c + warmup}-{g}" for g in range(2)]
                ready, retired = seen["ready"] + 2, seen["retired"] + 2
                for g, iid in enumerate(ids):
                    await kv.put(iid, encode(placement(iid, g)))
                await until("ready", ready)
                replies = await asyncio.gather(*(client.invoke(f"churn{g}", b"x", request_id=f"{iid}-{r}",
                                                               scheduled_ns=time.time_ns(), timeout_s=60)
                                                 for g, iid in enumerate(ids) for r in range(requests)))
                if any(r.status != "ok" for r in replies):
                    raise SystemExit(f"a request failed: {[r for r in replies if r.status != 'ok'][0]}")
                for iid in ids:
                    await kv.delete(iid)
                await until("retired", retired)
        finally:
            agent.terminate()
            agent.wait(30)
            await client.close()
            await nc.close()
        return samples


@click.command()
@click.option("--cycles", type=click.IntRange(min=2), default=150, show_default=True)
@click.option("--every", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True,
              help="cycles before the first sample (first imports, first arenas)")
@click.option("--requests", type=click.IntRange(min=0), default=20, show_default=True,
              help="requests sent to each instance before it is retired")
def main(cycles: int, every: int, warmup: int, requests: int) -> None:
    t0 = time.monotonic()
    samples = asyncio.run(churn(cycles, every, warmup, requests))
    if len(samples) >= 3:
        xs = [s["launches"] for s in samples]
        out = {k: round(statistics.linear_regression(xs, [s[k] for s in samples]).slope, 1)
               for k in ("uss", "own", "shm_private", "anon")}
        print(json.dumps({"bytes_per_launch": out, "launches": xs[-1], "wall_s": round(time.monotonic() - t0)}))


if __name__ == "__main__":
    main()
