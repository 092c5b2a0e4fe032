"""The wire format in isolation: hand-computed arrays, exact messages."""

from __future__ import annotations

import re

import numpy as np
import pytest

from labrl.errors import SamplerError
from labrl.harness.samplers.sglang.pool import ServerPool, group_key
from labrl.harness.samplers.sglang.sampler import SGLangSamplerConfig, _version_tuple
from labrl.harness.samplers.sglang.wire import (
    decode_segment,
    encode_routed_experts,
    generate_payload,
    parse_weight_version,
    reshape_routed_rows,
    sampling_params_payload,
    to_learner_layout,
    versions_from_spans,
)
from labrl.harness.types import SamplingParams


def test_payload_uses_sglang_field_names():
    sp = sampling_params_payload(
        SamplingParams(max_new_tokens=9, temperature=0.7, stop_token_ids=(2,), seed=5)
    )
    assert sp == {
        "max_new_tokens": 9,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [2],
        "sampling_seed": 5,
    }
    body = generate_payload(
        rid="a", input_ids=(1, 2), sampling_params=sp, return_routed_experts=True, routed_experts_start_len=1
    )
    assert body == {
        "rid": "a",
        "input_ids": [1, 2],
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_routed_experts": True,
        "routed_experts_start_len": 1,
    }
    old = generate_payload(
        rid="a", input_ids=(1,), sampling_params=sp, return_routed_experts=True, routed_experts_start_len=None
    )
    assert "routed_experts_start_len" not in old


def test_versions_from_spans_tiles_tokens():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert versions_from_spans(spans, 5) == [3, 3, 4, 4, 4]
    with pytest.raises(
        SamplerError, match=re.escape("weight_versions spans leave output tokens [4] without a version")
    ):
        versions_from_spans([*spans[:1], {"version": "4", "start": 2, "end": 4}], 5)


def test_weight_version_parsing():
    assert parse_weight_version("default") == 0
    assert parse_weight_version("12") == 12
    with pytest.raises(SamplerError, match=re.escape("server weight_version 'v1' is not an integer")):
        parse_weight_version("v1")


def test_learner_layout_drops_dense_layers_and_pads_last_row():
    # 3 tokens -> 2 rows sent, 3 hidden layers (layer 0 dense), top-2
    rows = np.array(
        [
            [[0, 0], [1, 2], [3, 0]],
            [[0, 0], [2, 3], [1, 2]],
        ],
        np.int32,
    )
    out = to_learner_layout(rows, num_tokens=3, moe_layers=(1, 2))
    assert out.shape == (3, 2, 2)
    assert out.tolist() == [[[1, 2], [3, 0]], [[2, 3], [1, 2]], [[0, 1], [0, 1]]]


def test_routed_rows_roundtrip_base64_and_count_check():
    rows = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    body = {
        "output_ids": [7],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, 7, None]],
            "routed_experts": encode_routed_experts(rows),
        },
    }
    seg = decode_segment(body, submitted_version=0, want_routed_experts=True, server="s")
    back = reshape_routed_rows(seg.routed_rows, rows=2, num_hidden_layers=3, topk=2, server="s")
    assert np.array_equal(back, rows)
    msg = "s: routed_experts has 12 int32 values, expected 3 rows x 3 layers x top-2 = 18"
    with pytest.raises(SamplerError, match=re.escape(msg)):
        reshape_routed_rows(seg.routed_rows, rows=3, num_hidden_layers=3, topk=2, server="s")


def test_decode_without_spans_tags_conservatively():
    body = {
        "output_ids": [1, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "weight_version": "5",
            "output_token_logprobs": [[-0.1, 1, None], [-0.2, 2, None]],
        },
    }
    seg = decode_segment(body, submitted_version=4, want_routed_experts=False, server="s")
    assert (seg.versions, seg.exact_versions, seg.finish_reason) == ([4, 4], False, "stop")
    seg = decode_segment(body, submitted_version=5, want_routed_experts=False, server="s")
    assert (seg.versions, seg.exact_versions) == ([5, 5], True)
    with pytest.raises(
        SamplerError, match=re.escape("s: routed experts were requested but the answer has none")
    ):
        decode_segment(body, submitted_version=5, want_routed_experts=True, server="s")


def test_config_validation_names_the_field():
    # pydantic wraps the ConfigError raised in the validator; both are ValueErrors
    with pytest.raises(ValueError, match=re.escape("moe_layers [3] outside [0, num_hidden_layers=3)")):
        SGLangSamplerConfig(
            urls=("http://x",), num_hidden_layers=3, moe_layers=(1, 3), topk=2, export_dir="/tmp"
        )
    with pytest.raises(ValueError, match=re.escape("weight_transport 'disk' requires export_dir")):
        SGLangSamplerConfig(urls=("http://x",), num_hidden_layers=3, moe_layers=(1,), topk=2)


def test_release_parsing_and_routing_policies():
    assert _version_tuple("0.5.15.post1") == (0, 5, 15)
    assert _version_tuple("0.5.23rc1") == (0, 5, 23)
    assert group_key("task-17/3", "/") == "task-17"
    pool = ServerPool(["http://a", "http://b", "http://c"], "consistent")
    owners = {pool.pick(f"g{i}/{j}").url for i in range(1) for j in range(8)}
    assert len(owners) == 1  # one group, one server
    spread = {pool.pick(f"g{i}/0").url for i in range(40)}
    assert spread == {"http://a", "http://b", "http://c"}
    owner = pool.pick("g0/0")
    pool.mark_dead(owner)
    assert pool.pick("g0/0").url != owner.url
    least = ServerPool(["http://a", "http://b"], "least_loaded")
    least.servers[0].in_flight = 2
    assert least.pick("x").url == "http://b"
