"""KV keys listed from the bucket stream's own state, against a real nats-server."""
import nats
import pytest
from nats.js.api import KeyValueConfig

from dilu.services.common.kvkeys import kv_keys

pytestmark = pytest.mark.nats


async def test_every_key_written_is_listed_deleted_ones_too(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="kvkeys-test", history=5))
    for k in range(40):
        await kv.put(f"k{k:02d}", b"x")
    await kv.put("k00", b"again")  # history: still one key
    await kv.delete("k01")
    keys = await kv_keys(js, "kvkeys-test")
    assert keys == [f"k{k:02d}" for k in range(40)]  # k01 listed: its delete marker is a message
    with pytest.raises(nats.js.errors.NotFoundError):
        await kv.get("k01")  # callers skip it on get
    with pytest.raises(nats.js.errors.NotFoundError):
        await kv_keys(js, "no-such-bucket")
    await nc.close()
