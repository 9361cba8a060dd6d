"""Prefix caching as a client sees it, through a served engine process: a repeated
system prompt is reported in Usage.cached_tokens and counted in the metrics,
FlushCache forgets it, GetModelInfo says whether the cache is on, and
--no-prefix-caching turns it off."""

from __future__ import annotations

import numpy as np
import pytest

from llamastream.v1 import generation_pb2 as pb
from tests.server.test_observability import scrape
from tests.serving import collect, local_server, stub

SYSTEM = np.random.default_rng(3).integers(5, 500, 1000).tolist()  # a 1,000-token "system prompt"


def usage(client, own: list[int]) -> pb.Usage:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=SYSTEM + own), sampling=pb.SamplingParams(temperature=0.0),
                                 stop=pb.StopCriteria(max_tokens=4, ignore_eos=True))
    messages, _ = collect(client.Generate(request, timeout=60))
    return messages[-1].finished.usage


@pytest.fixture(scope="module")
def served():
    server = local_server(num_kv_blocks=256, metrics_port=0, engine_process=True)
    yield server, stub(f"127.0.0.1:{server.port}")
    server.drain()


def test_a_repeated_system_prompt_is_found_cached(served):
    server, client = served
    assert client.GetModelInfo(pb.GetModelInfoRequest()).prefix_caching
    first, second = usage(client, [1, 2, 3]), usage(client, [4, 5, 6, 7])
    assert first.cached_tokens == 0 and second.cached_tokens >= 992  # 62 full blocks of 16
    m = scrape(server.metrics_port)
    assert m[("llamastream:prefix_cache_hits_total", ())] >= 992
    assert m[("llamastream:prefix_cache_queries_total", ())] >= first.prompt_tokens + second.prompt_tokens
    assert m[("llamastream:kv_cache_blocks_evictable", ())] > 0


def test_flush_cache_forgets_the_cached_prefixes(served):
    _, client = served
    usage(client, [8])
    assert usage(client, [9]).cached_tokens >= 992
    client.FlushCache(pb.FlushCacheRequest())
    assert usage(client, [10]).cached_tokens == 0  # (applied before the engine's next step)


def test_no_prefix_caching_computes_every_prompt():
    server = local_server(prefix_caching=False, num_kv_blocks=256)
    try:
        client = stub(f"127.0.0.1:{server.port}")
        assert not client.GetModelInfo(pb.GetModelInfoRequest()).prefix_caching
        usage(client, [1])
        assert usage(client, [2]).cached_tokens == 0
    finally:
        server.drain()
