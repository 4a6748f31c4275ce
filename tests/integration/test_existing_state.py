"""Starting against streams and buckets created beforehand with other settings (issue 13 item 2):
the services start, bind to them as they are, warn once per differing setting, and reset nothing.
One server here, so a replica count of 3 cannot be created, but an existing one-replica resource
met by a process configured for 3 is a mismatch like any other."""
from __future__ import annotations

import asyncio

import pytest
from nats.js.api import KeyValueConfig, ObjectStoreConfig, StorageType
from structlog.testing import capture_logs

from dilu.client import admin
from dilu.contracts import subjects
from dilu.services.common import bundle, workqueue
from dilu.services.common.jsresources import ensure_kv, ensure_object_store
from dilu.services.common.natsconn import NatsOptions
from dilu.services.common.runner import running
from dilu.services.horizontal_scaler.service import HorizontalScaler
from dilu.services.profiler.service import ProfilerService
from dilu.services.scheduler.service import SchedulerService

pytestmark = pytest.mark.nats


def warned(logs) -> set[tuple[str, str, object, object]]:
    """(stream, setting, wanted, found) of each mismatch warning captured."""
    return {(e["stream"], e["setting"], e["wanted"], e["found"]) for e in logs
            if e.get("log_level") == "warning" and "setting" in e}


async def test_services_start_on_buckets_made_with_other_settings(nc, nats_url):
    js = nc.jetstream()
    mem = StorageType.MEMORY
    placement = await js.create_key_value(KeyValueConfig(bucket=subjects.PLACEMENT_BUCKET, history=2, storage=mem))
    profiles = await js.create_key_value(KeyValueConfig(bucket=subjects.PROFILES_BUCKET, history=1, ttl=3600,
                                                        storage=mem))
    await js.create_key_value(KeyValueConfig(bucket=subjects.NODES_BUCKET, history=3, storage=mem))
    await js.create_key_value(KeyValueConfig(bucket=subjects.FUNCTION_STATE_BUCKET, history=4, storage=mem))
    await profiles.put("kept", b"an operator's entry")
    await placement.put("kept", b"not a placement")  # skipped by the scheduler, never deleted

    options = NatsOptions.of(nats_url)
    with capture_logs() as logs:
        async with running(SchedulerService(), options), running(ProfilerService(backend="surface"), options), \
                running(HorizontalScaler(tick_s=0.2), options):
            pass  # all three started and said ready
    seen = warned(logs)
    assert ("KV_dilu-placement", "history", 5, 2) in seen
    assert ("KV_dilu-profiles", "history", 5, 1) in seen
    assert ("KV_dilu-profiles", "max_age_s", None, 3600.0) in seen  # Dilu keeps profiles; this bucket expires them
    assert ("KV_dilu-nodes", "history", 1, 3) in seen
    assert ("KV_dilu-nodes", "max_age_s", subjects.NODE_TTL_S * 4, None) in seen
    assert ("KV_dilu-function-state", "history", 1, 4) in seen

    # nothing reset: the settings and the entries are the operator's
    assert (await js.stream_info("KV_dilu-placement")).config.max_msgs_per_subject == 2
    assert (await js.stream_info("KV_dilu-profiles")).config.max_age == pytest.approx(3600)
    assert (await profiles.get("kept")).value == b"an operator's entry"
    assert (await placement.get("kept")).value == b"not a placement"


async def test_replicas_stream_subjects_and_object_store_mismatches_are_reported(nc):
    js = nc.jetstream()
    await js.add_stream(name=subjects.INVOKE_STREAM, subjects=["dilu.v1.invoke.>", "other.>"],
                        retention="workqueue", max_age=30, storage="memory")
    found = await workqueue.ensure_stream(js, replicas=3)  # the cluster setting, met by a one-server stream
    got = {(m.setting, str(m.wanted), str(m.found)) for m in found}
    assert ("replicas", "3", "1") in got
    assert ("subjects", "['dilu.v1.invoke.>']", "['dilu.v1.invoke.>', 'other.>']") in got
    assert ("max_age_s", "600.0", "30.0") in got
    assert (await js.stream_info(subjects.INVOKE_STREAM)).config.subjects == ["dilu.v1.invoke.>", "other.>"]
    again = await workqueue.ensure_stream(js, replicas=None)  # no opinion on replicas: not compared
    assert "replicas" not in {m.setting for m in again} and "subjects" in {m.setting for m in again}
    await js.create_object_store(subjects.CODE_BUCKET, ObjectStoreConfig(ttl=60, storage=StorageType.MEMORY))
    store, found = await ensure_object_store(js, bundle.CODE_STORE_CONFIG, replicas=3)
    assert {("replicas", 3, 1), ("max_age_s", None, 60.0)} <= {(m.setting, m.wanted, m.found) for m in found}
    await store.put("kept", b"code")
    assert (await (await ensure_object_store(js, bundle.CODE_STORE_CONFIG, replicas=1))[0].get("kept")).data == b"code"

    kv = await admin.functions_bucket(js)  # created when missing: no mismatch afterwards
    _kv, found = await ensure_kv(js, admin.FUNCTIONS_KV_CONFIG, replicas=1)
    assert found == [] and kv is not None


async def test_concurrent_creators_bind_to_whichever_won(nc):
    js = nc.jetstream()
    configs = [KeyValueConfig(bucket="race", history=h, storage=StorageType.MEMORY) for h in (1, 2, 3, 4, 5, 6)]
    results = await asyncio.gather(*(ensure_kv(js, c, replicas=1) for c in configs))
    history = (await js.stream_info("KV_race")).config.max_msgs_per_subject
    assert sum(found == [] for _kv, found in results) == 1  # one creator won; the others bound to its bucket
    for config, (kv, found) in zip(configs, results):
        assert kv is not None
        if config.history != history:
            assert [(m.setting, m.wanted, m.found) for m in found] == [("history", config.history, history)]
