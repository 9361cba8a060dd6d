"""The CUDA backend's host side, run on a recording stand-in for PyCUDA (no GPU): every
launch of every kind of step matches its kernel's argument types and launch limits,
each step launches what it must, and the single-token fusions are where the
architecture's ops allow them. What the kernels compute is tested on a GPU (tests/gpu)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import LoadedModel
from engine.sampling_params import SamplingParams
from engine.weights import Tensor, is_layer_matrix
from devtools.recording_pycuda import cuda_shaped, recording_pycuda

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(params=["tiny_model", "tiny_qwen3"])
def model(request) -> LoadedModel:
    return cuda_shaped(request.getfixturevalue(request.param))


def engine_steps(model: LoadedModel, requests: list[tuple[list[int], dict]], later: list[tuple[list[int], dict]] = (),
                 config: EngineConfig = EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=256),
                 **backend) -> list[list]:
    """The launches of each engine step, until the requests finish (`later` ones added
    after the first step)."""
    with recording_pycuda() as launches:
        from engine.backends.cuda.backend import CudaBackend

        engine = LLMEngine(model, CudaBackend(model.config, model.model_weights(), graph_max_batch=16, **backend), config)
        for i, (prompt, params) in enumerate(requests):
            engine.add(engine.make_sequence(f"r{i}", prompt, SamplingParams(**params)))
        steps = []
        while engine.has_work():
            launches.clear()
            engine.step()
            steps.append(list(launches))
            for i, (prompt, params) in enumerate(later if len(steps) == 1 else ()):
                engine.add(engine.make_sequence(f"later{i}", prompt, SamplingParams(**params)))
    return steps


MIXED = [
    (list(range(1, 300)), dict(GREEDY, max_tokens=6)),  # chunked
    (list(range(5, 9)), dict(GREEDY, max_tokens=6, repetition_penalty=1.2)),
    (list(range(7, 20)), dict(GREEDY, max_tokens=6, top_logprobs=2)),
    ([3], dict(temperature=0.8, max_tokens=4, seed=3, ignore_eos=True)),
]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_every_launch_matches_its_kernel(model, graphs, invariant):
    """(the stand-in checks each launch's arguments against the prepared signature, and
    its grid, block and shared memory against the device's limits)"""
    steps = engine_steps(model, MIXED, cuda_graphs=graphs, batch_invariant=invariant)
    assert len(steps) >= 6 and all(steps)
    replays = sum(launch.kernel == "cuGraphLaunch" for step in steps for launch in step)
    assert (replays > 0) == graphs


def test_a_step_that_samples_nothing_still_runs_the_model(model):
    """The first chunks of a prompt longer than the token budget sample no token, but
    must write the prompt's keys and values to the cache."""
    steps = engine_steps(model, [([i % 500 for i in range(600)], dict(GREEDY, max_tokens=2))], cuda_graphs=False)
    chunks = steps[:2]  # 256 + 256 of 600 tokens
    for step in chunks:
        kernels = Counter(launch.kernel for launch in step)
        assert kernels["embedding_gather"] == 1 and kernels["prefill_attention_partial"] == model.config.num_layers
        assert "sample_tokens" not in kernels
    assert Counter(launch.kernel for launch in steps[2])["sample_tokens"] == 1


def test_a_step_of_thousands_of_prompt_tokens_takes_whole_contexts(model):
    """In a step of WHOLE_CONTEXT_PROMPT prompt tokens or more, the prefill kernel takes
    each query tile's whole context as one partition and stores the output itself: the
    merge kernel runs over the decode rows only, if any. Smaller steps split contexts
    and merge every row."""
    from engine.backends.cuda.step_metadata import WHOLE_CONTEXT_PROMPT

    n = WHOLE_CONTEXT_PROMPT // 2
    prompts = [([(i + j) % 500 + 1 for i in range(n)], dict(GREEDY, max_tokens=2)) for j in range(3)]
    config = EngineConfig(num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=WHOLE_CONTEXT_PROMPT + 1,
                          output_reserve=0.0)  # (admission takes all the budget allows: the steps below)
    steps = engine_steps(model, [(list(range(1, 20)), dict(GREEDY, max_tokens=4))], later=prompts, config=config,
                         cuda_graphs=False)

    def attention(step):
        return ([launch for launch in step if launch.kernel == "prefill_attention_partial"],
                [launch for launch in step if launch.kernel == "paged_attention_merge"])

    prefill, merges = attention(engine_steps(model, prompts[:2], config=config, cuda_graphs=False)[0])
    assert all(launch.args[0] == "P" and launch.grid[2] == 1 for launch in prefill) and not merges  # (prompts alone)
    prefill, merges = attention(steps[1])  # the first request's decode, the first two prompts
    assert len(prefill) == model.config.num_layers
    assert all(launch.args[0] == "P" and launch.grid[2] == 1 for launch in prefill)
    assert [launch.grid[0] for launch in merges] == [1] * model.config.num_layers
    assert [launch.args[-2] for launch in merges] == [1] * model.config.num_layers  # (decode_rows: the one decode)
    prefill, merges = attention(steps[2])  # the rest of the prompts beside three decodes
    tokens = next(launch.grid[0] for launch in steps[2] if launch.kernel == "embedding_gather")
    assert prefill and all(launch.args[0] == 0 for launch in prefill)
    assert [launch.grid[0] for launch in merges] == [tokens] * model.config.num_layers and tokens > 3
    assert [launch.args[-2] for launch in merges] == [3] * model.config.num_layers


def test_large_decode_steps_take_long_partitions_and_merge_in_the_decode_kernel(model):
    """A decode step of more than SMALL_DECODE tokens takes LARGE_PARTITION-position
    partitions. Where every context fits one, the decode kernel stores each row's
    output (nor does a merge kernel run after a prompt step in one partition, whose
    prefill kernel stores its rows' output); past it, the decode kernel is given its
    arrival counters and merges the partitions itself: no merge kernel runs either."""
    from engine.backends.cuda.step_metadata import LARGE_PARTITION, SMALL_DECODE

    config = EngineConfig(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=2048)
    short = [([i + j for i in range(1, 20)], dict(GREEDY, max_tokens=2)) for j in range(SMALL_DECODE + 1)]
    long = ([i % 500 + 1 for i in range(LARGE_PARTITION + 50)], dict(GREEDY, max_tokens=2))
    layers, rows = model.config.num_layers, SMALL_DECODE + 1

    def attention(step, kernel):
        return [launch for launch in step if launch.kernel == kernel]

    prompts, decode = engine_steps(model, short, config=config, cuda_graphs=False)
    assert all(launch.args[0] == "P" for launch in attention(prompts, "prefill_attention_partial"))  # (stores)
    assert not attention(prompts, "paged_attention_merge")
    partial = attention(decode, "paged_attention_partial")
    assert len(partial) == layers and all(launch.grid == (rows, model.config.num_kv_heads, 1) for launch in partial)
    assert not attention(decode, "paged_attention_merge")
    prompts, decode = engine_steps(model, short[1:] + [long], config=config, cuda_graphs=False)
    partial = attention(decode, "paged_attention_partial")
    assert {launch.grid[2] for launch in partial} == {2} and all(launch.args[1] == "P" for launch in partial)
    assert not attention(decode, "paged_attention_merge")


def test_decodes_of_a_few_tokens_in_long_contexts_load_ahead(model):
    """A decode step of up to SMALL_DECODE tokens whose context passes SHORT_CONTEXT
    takes the decode kernel whose warps load a chunk ahead; in a shorter context, or
    beside prompt tokens, the one that loads a chunk at a time."""
    from engine.backends.cuda.step_metadata import SHORT_CONTEXT

    model = dataclasses.replace(model, config=dataclasses.replace(model.config, max_position_embeddings=2 * SHORT_CONTEXT))
    config = EngineConfig(num_kv_blocks=2 * SHORT_CONTEXT // 16 + 16, max_num_seqs=4, max_num_batched_tokens=8192)
    long_prompt = [i % 500 + 1 for i in range(SHORT_CONTEXT + 100)]
    steps = engine_steps(model, [(long_prompt, dict(GREEDY, max_tokens=3)), (list(range(1, 40)), dict(GREEDY, max_tokens=3))],
                         config=config, cuda_graphs=False)

    def decode_kernels(step) -> Counter:
        return Counter(launch.kernel for launch in step if launch.kernel.startswith("paged_attention_partial"))

    assert decode_kernels(steps[0]) == Counter()  # (the prompts)
    for step in steps[1:]:  # two decodes, the longest context past SHORT_CONTEXT
        assert decode_kernels(step) == Counter({"paged_attention_partial_prefetch": model.config.num_layers})
    steps = engine_steps(model, [(list(range(1, 40)), dict(GREEDY, max_tokens=3))], config=config, cuda_graphs=False)
    assert decode_kernels(steps[1]) == Counter({"paged_attention_partial": model.config.num_layers})


def test_single_token_steps_fuse_where_the_layer_allows(model):
    """A decode step of one row: Llama's norm, QKV GEMV and RoPE are one kernel; Qwen3's
    head norm sits between the GEMV and RoPE, so there they stay apart. Both fuse the
    MLP's norm, GEMV and SiLU, and the residual adds; no cuBLAS."""
    steps = engine_steps(model, [(list(range(1, 20)), dict(GREEDY, max_tokens=3))], cuda_graphs=False)
    decode = Counter(launch.kernel for launch in steps[1])
    layers = model.config.num_layers
    assert decode["gemv_rmsnorm_silu"] == layers and decode["gemv_add"] == 2 * layers
    assert "cublasGemmEx" not in decode
    if model.architecture.name == "qwen3":
        assert decode["head_rmsnorm"] == decode["rope_and_cache"] == layers and "gemv_rmsnorm_rope" not in decode
    else:
        assert decode["gemv_rmsnorm_rope"] == layers and "rope_and_cache" not in decode


def test_a_prompts_last_chunk_replays_a_graph_when_short(model):
    """A short prompt, and the last chunk of a long one (as the rest of a prompt past a
    cached prefix is), run as one replay of a prompt graph; a chunk that samples nothing
    or is longer than the largest bucket runs eagerly."""
    steps = engine_steps(model, [([i % 500 for i in range(300)], dict(GREEDY, max_tokens=2))], cuda_graphs=True)
    first, last = (Counter(launch.kernel for launch in step) for step in steps[:2])
    assert first["embedding_gather"] == 1 and "cuGraphLaunch" not in first  # 256 tokens that sample nothing
    assert last["cuGraphLaunch"] == 1 and "embedding_gather" not in last  # the other 44, sampling
    steps = engine_steps(model, [(list(range(1, 20)), dict(GREEDY, max_tokens=2))], cuda_graphs=True)
    assert all(Counter(launch.kernel for launch in step)["cuGraphLaunch"] == 1 for step in steps)


def test_fp8_weights_run_their_own_kernels(model):
    """An FP8 checkpoint (or one quantized at load) keeps its layers FP8 on the GPU: the
    single-token steps launch the FP8 GEMVs where a bfloat16 model launches the
    bfloat16 ones; a prompt step of up to 32 tokens multiplies each layer matrix by the
    FP8 skinny GEMM where its width allows (else dequantizes it once, for cuBLAS), and
    a longer one dequantizes each once."""
    from engine.backends.cuda.kernels import skinny_splits
    from engine.quantization.fp8 import Fp8Weight

    quantized = dataclasses.replace(model, weights={
        name: Fp8Weight.quantize(t.float32()) if is_layer_matrix(name, t) else t
        for name, t in model.weights.items()})
    requests = [(list(range(1, 20)), dict(GREEDY, max_tokens=3))]
    fp8, bf16 = engine_steps(quantized, requests, cuda_graphs=False), engine_steps(model, requests, cuda_graphs=False)
    c = model.config
    widths = [c.hidden_size, c.num_heads * c.head_dim, c.hidden_size, c.intermediate_size]  # qkv, o, gate_up, down
    skinny = sum(bool(skinny_splits(19, d_in, "fp8")) for d_in in widths)
    prompt = Counter(launch.kernel for launch in fp8[0])
    assert sum(n for kernel, n in prompt.items() if kernel.startswith("skinny_gemm_fp8_s")) == skinny * c.num_layers
    assert prompt["dequantize_fp8"] == (4 - skinny) * c.num_layers
    for ours, theirs in zip(fp8[1:], bf16[1:]):  # (the GEMVs' grids differ: gemv_rows_per_block)
        assert any(launch.kernel.endswith("_fp8") for launch in ours)
        assert [launch.kernel.replace("_fp8", "") for launch in ours] == [launch.kernel for launch in theirs]
    long_prompt = engine_steps(quantized, [(list(range(1, 100)), dict(GREEDY, max_tokens=1))], cuda_graphs=False)
    assert Counter(launch.kernel for launch in long_prompt[0])["dequantize_fp8"] == 4 * c.num_layers


def test_fp8_dynamic_weights_take_w8a8_products_past_the_skinny_gemm(model):
    """Weights whose checkpoint quantizes the activations too (FP8-dynamic): a prompt
    step's products of more rows than the skinny GEMM takes multiply e4m3 codes by
    cuBLASLt's FP8 GEMM instead of dequantizing the weight. The kernels around each
    product do its two ends: the norms and the SiLU write the codes (only the attention's
    output takes quantize_rows_e4m3), and RoPE, the SiLU and the norms' residual adds
    scale the sums back (only Qwen3's q/k norm takes them scaled by
    scale_rows_and_cols). Single-token steps are as plain FP8's."""
    from devtools.quantized import fp8_fast

    def fp8(dynamic: bool):
        return dataclasses.replace(model, weights={
            name: dataclasses.replace(fp8_fast(t.float32()), dynamic_activations=dynamic) if is_layer_matrix(name, t) else t
            for name, t in model.weights.items()})

    requests = [(list(range(1, 100)), dict(GREEDY, max_tokens=3))]
    dynamic, plain = engine_steps(fp8(True), requests, cuda_graphs=False), engine_steps(fp8(False), requests, cuda_graphs=False)
    launched, layers = Counter(launch.kernel for launch in dynamic[0]), model.config.num_layers
    per_layer = {"cublasLtMatmul": 4, "quantize_rows_e4m3": 1, "silu_and_mul_e4m3": 1, "silu_and_mul": 0,
                 "add_rmsnorm": 2, "scale_rows_and_cols": int(model.config.architecture == "qwen3")}
    assert {k: launched[k] for k in per_layer} == {k: n * layers + (k == "add_rmsnorm") for k, n in per_layer.items()}
    assert "dequantize_fp8" not in launched and Counter(launch.kernel for launch in plain[0])["dequantize_fp8"] == 4 * layers
    assert [[launch.kernel for launch in step] for step in dynamic[1:]] == [[launch.kernel for launch in step] for step in plain[1:]]


def test_w8a8_inputs_too_wide_for_the_fused_kernels_are_quantized_on_their_own(model, monkeypatch):
    """The norms and the SiLU that write a W8A8 product's codes hold a row in shared
    memory: rows wider than it holds (here, as if it held less) are computed in bfloat16
    and quantized by quantize_rows_e4m3."""
    from devtools.quantized import fp8_model

    quantized = fp8_model(model, dynamic_activations=True)
    with recording_pycuda() as launches:
        from engine.backends.cuda import forward
        from engine.backends.cuda.backend import CudaBackend

        monkeypatch.setattr(forward, "ROW_STASH_BYTES", 2 * model.config.hidden_size - 2)
        engine = LLMEngine(quantized, CudaBackend(quantized.config, quantized.model_weights(), cuda_graphs=False),
                           EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=256))
        engine.add(engine.make_sequence("r", list(range(1, 100)), SamplingParams(**dict(GREEDY, max_tokens=1))))
        engine.step()
    launched, layers = Counter(launch.kernel for launch in launches), model.config.num_layers
    assert {k: launched[k] for k in ("cublasLtMatmul", "quantize_rows_e4m3", "silu_and_mul", "silu_and_mul_e4m3")} == \
        {"cublasLtMatmul": 4 * layers, "quantize_rows_e4m3": 4 * layers, "silu_and_mul": layers, "silu_and_mul_e4m3": 0}


def test_w8a8_plans_are_kept_for_the_shapes_used_last(model):
    """Each W8A8 product's shape (its rows among them) takes a cuBLASLt plan: prompts of
    many lengths keep only the last MAX_PLANS, and still multiply W8A8."""
    import importlib

    from devtools.quantized import fp8_model

    quantized = fp8_model(model, dynamic_activations=True)
    with recording_pycuda() as launches:
        from engine.backends.cuda.backend import CudaBackend

        importlib.import_module("engine.backends.cuda.linear").MAX_PLANS = 6  # (4 a prompt length: qkv, o, gate/up, down)
        backend = CudaBackend(quantized.config, quantized.model_weights(), cuda_graphs=False)
        engine = LLMEngine(quantized, backend, EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=256))
        for i, n in enumerate((33, 40, 50)):
            prompt = list(range(100 * i + 1, 100 * i + n + 1))  # (no prefix in common: every row computed)
            engine.add(engine.make_sequence(f"r{i}", prompt, SamplingParams(**dict(GREEDY, max_tokens=1))))
            launches.clear()
            while engine.has_work():
                engine.step()
            assert Counter(launch.kernel for launch in launches)["cublasLtMatmul"] == 4 * model.config.num_layers
        assert len(backend.linear._plans) == 6 and {shape.tokens for shape in backend.linear._plans} == {40, 50}


def test_fp8_of_a_block_size_the_kernels_do_not_read_runs_as_bfloat16(model):
    """Block scales other than 128 x 128 are uploaded dequantized: a bfloat16 model's launches."""
    from devtools.quantized import fp8_fast

    quantized = dataclasses.replace(model, weights={
        name: fp8_fast(t.float32(), (64, 64)) if is_layer_matrix(name, t) else t
        for name, t in model.weights.items()})
    request = [(list(range(1, 20)), dict(GREEDY, max_tokens=3))]
    fp8, bf16 = engine_steps(quantized, request, cuda_graphs=False), engine_steps(model, request, cuda_graphs=False)
    assert [[(launch.kernel, launch.grid) for launch in step] for step in fp8] == \
        [[(launch.kernel, launch.grid) for launch in step] for step in bf16]


@pytest.mark.parametrize("block_size, message", [
    (12, "blocks hold a power of two of tokens, not 12: use --block-size 8 or 16"),  # (a slot is a shift and a mask)
    (3, "block size 3 is too small for the attention kernel: use at least 4"),  # (a partition's blocks fit its table)
    (1, "block size 1 is too small for the attention kernel: use at least 4"),
])
def test_a_kv_block_size_the_kernels_cannot_take_is_refused_with_one_they_can(model, block_size, message):
    with pytest.raises(ValueError, match=message):
        engine_steps(model, [], config=EngineConfig(num_kv_blocks=128, block_size=block_size))
    engine_steps(model, [], config=EngineConfig(num_kv_blocks=128, block_size=int(message.split()[-1])))


def test_an_fp8_caches_calibrated_scales_reach_each_layers_writes_and_reads(model):
    """Each layer's own K and V scales in the launches that write its FP8 cache (their
    reciprocals: rope_and_cache, or the fused GEMV of a one-token step) and that read it
    (the softmax's scale times K's, and V's: both attention kernels and the merge).
    Steps of prompt chunks, of prompt and decode rows, and of one decode row."""
    from engine.backends.cuda.step_metadata import PARTITION
    from engine.quantization.kv_cache import KvScale

    c = model.config
    scales = [KvScale(0.5 + i, 0.25 * (i + 1)) for i in range(c.num_layers)]
    weights = dict(model.weights)
    for i, scale in enumerate(scales):
        weights[f"model.layers.{i}.self_attn.k_scale"] = Tensor.of(np.array(scale.k, np.float32))
        weights[f"model.layers.{i}.self_attn.v_scale"] = Tensor.of(np.array(scale.v, np.float32))
    long_prompt = [i % 300 + 1 for i in range(PARTITION + 100)]  # (two partitions: the merge runs)
    requests = [(long_prompt, dict(GREEDY, max_tokens=3)), (list(range(5, 9)), dict(GREEDY, max_tokens=3))]
    steps = engine_steps(dataclasses.replace(model, weights=weights), requests, cuda_graphs=False, kv_cache_dtype="fp8")
    softmax = c.head_dim ** -0.5
    where = {  # kernel: (the slice of its arguments, what layer i passes there)
        "rope_and_cache": (slice(-2, None), lambda s: (1 / np.float32(s.k), 1 / np.float32(s.v))),
        "gemv_rmsnorm_rope": (slice(-4, -2), lambda s: (1 / np.float32(s.k), 1 / np.float32(s.v))),
        "paged_attention_partial": (slice(-2, None), lambda s: (np.float32(softmax * s.k), np.float32(s.v))),
        "prefill_attention_partial": (slice(-2, None), lambda s: (np.float32(softmax * s.k), np.float32(s.v))),
        "paged_attention_merge": (slice(-1, None), lambda s: (np.float32(s.v),)),
    }
    seen = Counter()
    for step in steps:
        for kernel, (args, expected) in where.items():
            launched = [launch.args[args] for launch in step if launch.kernel == kernel]
            if launched:
                assert launched == [tuple(float(x) for x in expected(s)) for s in scales], kernel
                seen[kernel] += 1
    unfused = {"gemv_rmsnorm_rope"} if model.architecture.name == "qwen3" else set()  # (as above)
    assert set(seen) == set(where) - unfused, seen
