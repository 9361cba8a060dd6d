"""The CPU backend (cpu_src/ compiled) against the numpy backend, its oracle.

Tolerances: a quantized product (u4, u8) quantizes the activations to int16 (the
default) or int8 per block of 32 and multiplies integers; each output is that of the
activations so quantized (emulated here in numpy) by the dequantized weights, to 1e-5 of
the largest; float products and the other ops differ from numpy's only in the order of
float32 sums (1e-5). On SmolLM2, int16 keeps the logits within 0.02 of the numpy
backend's (measured 0.003; logits ~25) and its greedy tokens equal; int8 moves them
further (relative L2 4.3e-2 measured; perplexity 26.36 against 26.41) and turns near
ties, as llama.cpp's int8 activations do.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGML
from gguf import quantize

from engine.backends import create_backend
from engine.backends import numpy_backend as ref
from engine.backends.cpu import kernels as cpu_kernels
from engine.backends.cpu.backend import CpuBackend
from engine.backends.cpu.kernels import CpuKernels, addr
from engine.backends.cpu.weights import CpuLinear, repack
from engine.model_loader import load_model
from engine.quantization.fp8 import Fp8Weight, e4m3_to_f32, f32_to_e4m3
from engine.quantization.gguf import GgufWeight
from engine.quantization.int4 import Int4Weight
from engine.quantization.kv_cache import KvScale, load_e4m3, store_e4m3
from engine.sampling_params import SamplingParams
from engine.weights import Tensor, f32_to_bf16_bits
from tests.conftest import FIXTURES, greedy, make_engine, run, text, tokens

rng = np.random.default_rng(0)


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    return CpuKernels(threads=2)


@pytest.fixture(scope="module", params=["native", "AVX2 only"])
def product_kernels(request) -> CpuKernels:
    """The kernels as this CPU runs them, and as one without AVX-512 would (the products'
    ymm code path: linear.c's other half)."""
    if request.param == "native":
        return CpuKernels(threads=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernels, "FLAGS", cpu_kernels.FLAGS + ("-mno-avx512f",))
        return CpuKernels(threads=2)


def _gguf(w: np.ndarray, kind: GGML) -> GgufWeight:
    return GgufWeight(quantize(w, kind), kind, w.shape[1])


def _q4_k(rows: int, columns: int) -> GgufWeight:
    """Random Q4_K blocks (gguf quantizes no K-quant): any scale, min and nibble bytes are valid."""
    blocks = rng.integers(0, 256, (rows, columns // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.array([0.002], np.float16).view(np.uint8)
    blocks[..., 2:4] = np.array([0.001], np.float16).view(np.uint8)
    return GgufWeight(blocks.reshape(rows, -1), GGML.Q4_K, columns)


def _int4(rows: int, columns: int, group: int, act_order: bool) -> Int4Weight:
    groups = columns // group
    g = np.repeat(np.arange(groups, dtype=np.int32), group)
    if act_order:  # the groups of columns as GPTQ's desc_act leaves them: interleaved
        g = g[rng.permutation(columns)]
    return Int4Weight(rng.integers(0, 16, (rows, columns), dtype=np.uint8),
                      rng.uniform(0.001, 0.02, (rows, groups)).astype(np.float32),
                      rng.integers(0, 16, (rows, groups), dtype=np.uint8), g)


def _fp8_blocks(w: np.ndarray) -> Fp8Weight:
    """Hugging Face's fp8: a scale per 128 x 128 block."""
    n, k = w.shape
    scale = rng.uniform(0.5, 2.0, (-(-n // 128), -(-k // 128))).astype(np.float32) / 448
    per_weight = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:n, :k]
    return Fp8Weight(f32_to_e4m3(w / per_weight), scale, (128, 128))


def weights_of_every_form(n: int, k: int) -> dict[str, object]:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    fp8_tensor = Fp8Weight.quantize(w)
    return {
        "f32": Tensor.of(w), "bf16": Tensor(f32_to_bf16_bits(w), "bf16"),
        "q4_0": _gguf(w, GGML.Q4_0), "q4_1": _gguf(w, GGML.Q4_1), "q8_0": _gguf(w, GGML.Q8_0), "q4_k": _q4_k(n, k),
        "int4 g128": _int4(n, k, 128, act_order=False), "int4 g32 act-order": _int4(n, k, 32, act_order=True),
        "int4 g64 act-order": _int4(n, k, 64, act_order=True),
        "fp8 per row": Fp8Weight.quantize(w), "fp8 per tensor": Fp8Weight(fp8_tensor.codes, fp8_tensor.scale[:1] * 1.5),
        "fp8 blocks": _fp8_blocks(w),
    }


def as_the_kernels_quantize(x: np.ndarray, linear, activations: str) -> np.ndarray:
    """x as a u4/u8 product reads it: its columns in the weight's order (perm), quantized
    in blocks of 32 to int8 or int16 (max |x| / levels a step, rounded to even, in float32
    as linear.c does), and back to float32 in x's own order."""
    levels = np.float32(127 if activations == "int8" else 32767)
    k = x.shape[1]
    padded = np.zeros((len(x), linear.kp), np.float32)
    padded[:, :k] = x if linear.perm is None else x[:, linear.perm[:k]]
    blocks = padded.reshape(len(x), -1, 32)
    top = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(top > 0, levels / np.where(top > 0, top, 1), 0).astype(np.float32)
    back = (np.rint(blocks * inv) * (top / levels)).reshape(len(x), -1)[:, :k]
    if linear.perm is None:
        return back
    out = np.empty_like(back)
    out[:, linear.perm[:k]] = back
    return out


def assert_multiplies_as_dequantized(kernels: CpuKernels, weight, x: np.ndarray, activations: str) -> None:
    """The product by a weight as the CPU kernels hold it equals x (quantized as the
    kernels do, for u4 and u8) times the weight's dequantized float32 values."""
    linear = repack(weight, activations)
    rounded = x if linear.form == "float" else as_the_kernels_quantize(x, linear, activations)
    expected = rounded.astype(np.float64) @ weight.float32().T.astype(np.float64)
    err = np.abs(linear(kernels, x) - expected).max() / np.abs(expected).max()
    assert err < 1e-5, f"{weight!r:.60} ({linear.form}, {activations}): relative error {err:.1e}"


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("n, k", [(96, 512), (40, 768), (24, 256), (16, 4352)])  # (4352: panels of 2048, 2048, 256)
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_every_weight_form_multiplies_as_its_dequantized_weights(product_kernels, n, k, rows, activations):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for weight in weights_of_every_form(n, k).values():
        assert_multiplies_as_dequantized(product_kernels, weight, x, activations)


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("n, k", [(5, 32), (17, 160), (33, 4192)])  # (4192: panels of 2048, 2048 and 96 columns)
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_partial_tiles_and_panels_multiply_as_whole_ones(product_kernels, n, k, rows, activations):
    """Rows that fill no whole tile of 16 (zero rows pad it, and are not written), and a
    last panel narrower than the others, in each form of block scales."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for weight in (_gguf(w, GGML.Q4_1), _gguf(w, GGML.Q8_0), _gguf(w, GGML.Q4_0), _int4(n, k, 32, act_order=False)):
        assert repack(weight, activations).kp == k
        assert_multiplies_as_dequantized(product_kernels, weight, x, activations)


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("rows", [4, 8, 16, 21, 40])  # (AMX_LEAST_ROWS in linear.c; 16 rows at a time)
def test_products_on_the_tile_unit_equal_the_vector_ones_bit_for_bit(kernels, rows, activations):
    """Where the CPU has AMX, products of many rows run on it (int16 activations as their
    high and low bytes): the same int32 sums of each block, scaled by the same
    instructions, as the kernels built without it give."""
    if not kernels.amx:
        pytest.skip("this CPU has no AMX tile unit the OS lets us use")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_kernels, "FLAGS", cpu_kernels.FLAGS + ("-mno-amx-tile", "-mno-amx-int8"))
        vector = CpuKernels(threads=2)
    assert not vector.amx
    n, k = 40, 4352  # (a partial tile; panels of 2048, 2048, 256)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for weight in (_gguf(w, GGML.Q4_1), _gguf(w, GGML.Q8_0), _gguf(w, GGML.Q4_0), _int4(n, k, 128, act_order=True)):
        linear = repack(weight, activations)
        assert np.array_equal(linear(kernels, x), linear(vector, x)), f"{weight!r:.60}"
        assert_multiplies_as_dequantized(kernels, weight, x, activations)


def test_int8_activations_err_as_much_as_their_rounding_allows(kernels):
    """The premise of int8: a product's error against float32 activations is bounded by
    half a step of each block's quantization, and is ~1e-2 of the output's magnitude."""
    w = rng.standard_normal((64, 1024)).astype(np.float32)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    weight = _gguf(w, GGML.Q4_1)
    exact = x.astype(np.float64) @ weight.float32().T.astype(np.float64)
    step = np.abs(x).reshape(8, -1, 32).max(axis=-1) / 127  # each block's
    bound = 0.5 * np.repeat(step, 32, axis=1) @ np.abs(weight.float32()).T
    err = np.abs(repack(weight, "int8")(kernels, x) - exact)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-5)
    assert 1e-3 < np.linalg.norm(err) / np.linalg.norm(exact) < 2e-2


def test_quantized_forms_hold_the_stored_bytes_not_float32():
    w = rng.standard_normal((64, 512)).astype(np.float32)
    assert repack(_gguf(w, GGML.Q4_1)).nbytes == 64 * 512 * 5 // 8  # a nibble a weight, two float16 a block: as GGUF
    assert repack(_gguf(w, GGML.Q8_0)).nbytes == 64 * 512 * 34 // 32  # a byte a weight, a float16 a block: as GGUF
    assert repack(_gguf(w, GGML.Q4_0)).nbytes == 64 * 512 * 9 // 16  # (their zero points one for the whole matrix)
    assert repack(Fp8Weight.quantize(w)).nbytes == 64 * 512 + 64 * 4


def test_layer_ops_match_the_numpy_reference(kernels):
    x, w = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    out = np.empty_like(x)
    kernels.rms_norm(addr(out), addr(x), None, addr(w), 5, 64, 1e-5)
    np.testing.assert_allclose(out, ref.rms_norm(x, w, 1e-5), atol=1e-5)
    delta, residual = rng.standard_normal((5, 64)).astype(np.float32), x.copy()
    kernels.rms_norm(addr(out), addr(residual), addr(delta), addr(w), 5, 64, 1e-5)  # (the residual's add, fused)
    np.testing.assert_allclose(residual, x + delta, atol=1e-6)
    np.testing.assert_allclose(out, ref.rms_norm(x + delta, w, 1e-5), atol=1e-5)

    gate_up = rng.standard_normal((5, 96)).astype(np.float32) * 6
    out = np.empty((5, 48), np.float32)
    kernels.silu_and_mul(addr(out), addr(gate_up), 5, 48)
    np.testing.assert_allclose(out, ref.silu_and_mul(gate_up), rtol=1e-6, atol=1e-5)

    y, delta = rng.standard_normal(37).astype(np.float32), rng.standard_normal(37).astype(np.float32)
    expected = y + delta
    kernels.add_to(addr(y), addr(delta), 37)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("dim", [16, 24, 64])
@pytest.mark.parametrize("fp8, scale", [(False, KvScale()), (True, KvScale()), (True, KvScale(0.37, 2.5))],
                         ids=["float32 cache", "e4m3 cache", "e4m3 cache, calibrated scales"])
def test_rope_and_cache_and_paged_attention_match_the_numpy_reference(kernels, fp8, scale, dim):
    """Two sequences in one step: one decoding at position 37, one prefilling positions
    20..24 after 20 cached tokens; grouped-query heads (8 over 2), cache slots scattered;
    head dimensions that the kernel's value sums take 8, 16 and 32 at a time. With an
    e4m3 cache (--kv-cache-dtype fp8) the cached codes are the numpy backend's rounding
    exactly, over the layer's K and V scales, and attention reads them as it does."""
    store, load = (store_e4m3, load_e4m3) if fp8 else (lambda x, _: x, lambda x, _: x)
    heads, kv_heads = 8, 2
    inv_freq = (1.0 / 10000 ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
    k_cache = store(rng.standard_normal((128, kv_heads, dim)).astype(np.float32), scale.k)
    v_cache = store(rng.standard_normal((128, kv_heads, dim)).astype(np.float32), scale.v)
    seqs = [(37, 1, rng.permutation(128)[:38])]  # (start, tokens, slots of 0..end)
    seqs.append((20, 5, rng.permutation(np.setdiff1d(np.arange(128), seqs[0][2]))[:25]))
    positions = np.concatenate([np.arange(s, s + n) for s, n, _ in seqs])
    new_slots = np.concatenate([slots[s:] for s, _, slots in seqs]).astype(np.int64)
    qkv = rng.standard_normal((len(positions), (heads + 2 * kv_heads) * dim)).astype(np.float32)
    cos, sin = ref.rope_cos_sin(positions, inv_freq)

    # the reference, on copies
    q = ref.apply_rope(qkv[:, : heads * dim].reshape(-1, heads, dim), cos, sin)
    k = ref.apply_rope(qkv[:, heads * dim : (heads + kv_heads) * dim].reshape(-1, kv_heads, dim), cos, sin)
    k_ref, v_ref = k_cache.copy(), v_cache.copy()
    k_ref[new_slots] = store(k, scale.k)
    v_ref[new_slots] = store(qkv[:, (heads + kv_heads) * dim :].reshape(-1, kv_heads, dim), scale.v)
    bounds = np.cumsum([0] + [n for _, n, _ in seqs])
    expected = np.concatenate([ref.paged_attention(q[bounds[i] : bounds[i + 1]], load(k_ref, scale.k),
                                                   load(v_ref, scale.v), slots, s, dim ** -0.5)
                               for i, (s, _, slots) in enumerate(seqs)])

    cos, sin = np.ascontiguousarray(cos), np.ascontiguousarray(sin)
    kernels.rope_and_cache(addr(qkv), len(positions), heads, kv_heads, dim, addr(cos), addr(sin), addr(new_slots),
                           addr(k_cache), addr(v_cache), fp8, *scale.inverses)
    np.testing.assert_allclose(qkv[:, : heads * dim], q.reshape(len(q), -1), atol=1e-6)
    np.testing.assert_array_equal(k_cache, k_ref)
    np.testing.assert_array_equal(v_cache, v_ref)

    out = np.empty((len(positions), heads * dim), np.float32)
    args = [np.array(a, dtype) for a, dtype in (
        (bounds[:-1], np.int32), ([n for _, n, _ in seqs], np.int32), ([s for s, _, _ in seqs], np.int32),
        (np.concatenate([slots for *_, slots in seqs]), np.int64), ([0, len(seqs[0][2])], np.int64))]
    kernels.attention(addr(out), addr(qkv), heads, kv_heads, dim, len(seqs), *(addr(a) for a in args), addr(k_cache),
                      addr(v_cache), dim ** -0.5 * scale.k, fp8, scale.v)
    np.testing.assert_allclose(out, expected, atol=1e-5 * scale.v)


def test_the_e4m3_cache_rounds_as_the_numpy_backend(kernels):
    """Values are stored unrotated (V): every e4m3 value, every midpoint between two
    neighbours (a tie, to the smaller magnitude), both signs, past 448 and below the
    smallest subnormal."""
    values = e4m3_to_f32(np.arange(0x7F, dtype=np.uint8))
    ties = (values[1:] + values[:-1]) / 2
    near = np.concatenate([values[1:] * 0.999, values[1:] * 1.001, [449.0, 1e4, 1e-4, 2.0 ** -11]])
    v = np.concatenate([values, ties, near]).astype(np.float32)
    v = np.concatenate([v, -v])
    dim = 16
    v = np.concatenate([v, np.zeros(-len(v) % dim, np.float32)]).reshape(-1, dim)
    rows = len(v)
    qkv = np.concatenate([rng.standard_normal((rows, 2 * dim)).astype(np.float32), v], axis=1)  # (one head each)
    cos, sin = np.ones((rows, dim // 2), np.float32), np.zeros((rows, dim // 2), np.float32)
    slots = np.arange(rows, dtype=np.int64)
    k_cache, v_cache = np.zeros((rows, 1, dim), np.uint8), np.zeros((rows, 1, dim), np.uint8)
    kernels.rope_and_cache(addr(qkv), rows, 1, 1, dim, addr(cos), addr(sin), addr(slots), addr(k_cache), addr(v_cache),
                           True, 1.0, 1.0)
    np.testing.assert_array_equal(v_cache.reshape(rows, dim), f32_to_e4m3(v))


def cpu_engine(model, kv_cache_dtype: str = "auto", activations: str = "int16", **config):
    from engine.llm_engine import EngineConfig, LLMEngine

    config.setdefault("num_kv_blocks", 256)
    backend = CpuBackend(model.config, model.model_weights(), threads=2, kv_cache_dtype=kv_cache_dtype,
                         activations=activations)
    return LLMEngine(model, backend, EngineConfig(**config))


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """32 greedy steps on each golden prompt and the capital-of-France question, batched,
    by the numpy backend and by the CPU backend with each precision of activations (the
    Q4_1/Q8_0 blocks as stored): the prompts, and {engine: tokens}."""
    golden = np.load(FIXTURES / "smollm2_golden.npz")
    prompts = [golden[f"ids_{i}"].tolist() for i in range(len(golden["names"]))]
    prompts.append(smollm2.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])[0])
    results = {}
    for name, engine in (("numpy", make_engine(smollm2)), ("int16", cpu_engine(smollm2)),
                         ("int8", cpu_engine(smollm2, activations="int8"))):
        assert engine.backend.weight_dtype == ("float32" if name == "numpy" else "int4+int8")
        outputs = run(engine, [engine.make_sequence(f"r{i}", p, greedy(32)) for i, p in enumerate(prompts)])
        results[name] = [tokens(outputs[f"r{i}"]) for i in range(len(prompts))]
    return prompts, results


def test_smollm2_from_its_gguf_with_int16_activations_gives_the_numpy_backends_greedy_tokens(smollm2_greedy):
    _, results = smollm2_greedy
    assert results["int16"] == results["numpy"]


def test_smollm2_with_int8_activations_leaves_the_numpy_backends_greedy_tokens_only_at_near_ties(smollm2,
                                                                                                 smollm2_greedy):
    """int8 activations turn near ties, as llama.cpp's do (on the same GGUF, llama.cpp
    leaves the numpy backend's tokens on 3 of the 5 golden prompts, at gaps of 0.08 to
    0.21): where a sequence first leaves the numpy backend's, the numpy backend's logit for
    its own choice is above the one for ours by less than 0.3 (measured 0.004 to 0.19).
    The question's first token is one ("The" 0.152 against "L" 0.140): int8 answers
    "L'Étoile, la Marseillaise", as an FP8 head does (test_quantization.py)."""
    from devtools.probes import our_logits

    prompts, results = smollm2_greedy
    numpy = make_engine(smollm2)
    for prompt, mine, theirs in zip(prompts, results["int8"], results["numpy"]):
        if mine == theirs:
            continue
        step = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        logits = our_logits(numpy, prompt + theirs[:step])
        assert 0 <= logits[theirs[step]] - logits[mine[step]] < 0.3, (prompt, step)


@pytest.mark.parametrize("activations, bound", [("int16", 0.02), ("int8", 1.5)])
def test_smollm2_logits_stay_near_the_numpy_backends(smollm2, activations, bound):
    """Max |difference| (measured 0.003 and 1.08) and relative L2 (1e-4 and 4.3e-2)."""
    from devtools.probes import our_logits

    ids = smollm2.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])[0]
    cpu, numpy = (our_logits(engine, ids) for engine in (cpu_engine(smollm2, activations=activations),
                                                         make_engine(smollm2)))
    assert np.abs(cpu - numpy).max() < bound
    assert np.linalg.norm(cpu - numpy) / np.linalg.norm(numpy) < 20 * bound / 25


def test_smollm2_perplexity_with_int8_activations_is_within_1pc_of_the_exact_models(smollm2):
    from tests.engine.test_quantization import TINY_MODEL, perplexity

    text = (TINY_MODEL.parent / "perplexity.txt").read_text()
    int8, int16 = (perplexity(cpu_engine(smollm2, activations=a), text) for a in ("int8", "int16"))
    assert int16 == pytest.approx(perplexity(make_engine(smollm2), text), rel=1e-4)
    assert abs(int8 / int16 - 1) < 0.01


def test_smollm2_answers_paris(smollm2):
    """With int16 activations, the default (int8's answer: the near-ties test)."""
    engine = cpu_engine(smollm2)
    ids = smollm2.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])[0]
    outputs = run(engine, [engine.make_sequence("q", ids, SamplingParams(temperature=0.0, max_tokens=12))])
    assert "Paris" in text(outputs["q"])


def test_smollm2_with_an_fp8_kv_cache_moves_no_more_than_the_numpy_backends_and_answers_paris(smollm2):
    """--kv-cache-dtype fp8 on the CPU backend. The two backends compute K and V a little
    differently (the CPU backend's int16 activations), so codes near a rounding boundary
    go either way, and the fp8 logits of the two differ about as much as fp8 moves
    either (max 1.8 and 1.7 here): the test holds what fp8 does to the CPU backend's
    logits to what it does to the numpy backend's (relative L2 4.9e-2 against 7.6e-2
    measured), and the first token to the numpy backend's."""
    from devtools.probes import our_logits
    from engine.llm_engine import EngineConfig, LLMEngine

    ids = smollm2.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])[0]
    logits = {}
    for dtype in ("auto", "fp8"):
        cpu = cpu_engine(smollm2, kv_cache_dtype=dtype)
        numpy = LLMEngine(smollm2, create_backend("numpy", smollm2.config, smollm2.model_weights(), kv_cache_dtype=dtype),
                          EngineConfig(num_kv_blocks=256))
        logits["cpu", dtype], logits["numpy", dtype] = our_logits(cpu, ids), our_logits(numpy, ids)
    assert cpu.info.kv_cache_dtype == "fp8_e4m3"

    def moved(backend: str) -> float:
        fp8, exact = logits[backend, "fp8"], logits[backend, "auto"]
        return np.linalg.norm(fp8 - exact) / np.linalg.norm(exact)

    assert moved("cpu") < 1.25 * moved("numpy")
    assert np.argmax(logits["cpu", "fp8"]) == np.argmax(logits["numpy", "fp8"])
    outputs = run(cpu, [cpu.make_sequence("q", ids, SamplingParams(temperature=0.0, max_tokens=12))])
    assert "Paris" in text(outputs["q"])


def test_the_kernels_compile_once_and_load_from_the_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="llamastream.engine"):
        CpuKernels(threads=1)
        assert "compiled the CPU kernels in" in caplog.text
        caplog.clear()
        CpuKernels(threads=1)
    assert "compil" not in caplog.text
    assert len(list((tmp_path / "llamastream").glob("cpu-kernels-*.so"))) == 1


def test_auto_takes_the_cpu_backend_without_a_gpu_and_numpy_without_a_compiler(tiny_model, monkeypatch, tmp_path, caplog):
    weights = tiny_model.model_weights()
    assert create_backend("auto", tiny_model.config, weights, threads=1).name == "cpu"
    assert create_backend("numpy", tiny_model.config, weights).name == "numpy"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (nothing cached there: it must compile)
    monkeypatch.setattr("engine.backends.cpu.kernels.COMPILER", "no-such-cc")
    with caplog.at_level(logging.WARNING, logger="llamastream.engine"):
        assert create_backend("auto", tiny_model.config, weights).name == "numpy"
    assert "no C compiler (no-such-cc) is on PATH" in caplog.text
    with pytest.raises(RuntimeError, match="no C compiler"):
        create_backend("cpu", tiny_model.config, weights)


QUANTIZED_CHECKPOINTS = ["tiny-llama-gptq-act-order", "tiny-llama-gptq-sym", "tiny-llama-awq", "tiny-llama-w4a16-asym",
                         "tiny-llama-fp8-channel"]  # (written by GPTQModel and compressed-tensors: test_quantization.py)


def test_tiny_models_on_the_cpu_backend_match_numpy(tiny_model, tiny_qwen3):
    for model in [tiny_model, tiny_qwen3] + [load_model(FIXTURES / name) for name in QUANTIZED_CHECKPOINTS]:
        prompts = [[1, 5, 9, 2], list(range(3, 40))]
        results = []
        for engine in (make_engine(model), cpu_engine(model)):
            outputs = run(engine, [engine.make_sequence(f"r{i}", p, greedy(16)) for i, p in enumerate(prompts)])
            results.append([tokens(outputs[f"r{i}"]) for i in range(len(prompts))])
        assert results[0] == results[1], model.name


def test_cpu_activations_go_from_the_command_line_to_the_products(caplog):
    from server.app import build_engine
    from server.cli import build_parser, serve_config

    assert build_parser().parse_args(["serve"]).cpu_activations == "int16"
    args = build_parser().parse_args(["serve", "--device", "cpu", "--cpu-activations", "int8", "--num-kv-blocks", "64"])
    with caplog.at_level(logging.INFO, logger="llamastream.engine"):
        engine = build_engine(serve_config(args))
    assert "integer products with int8 activations" in caplog.text
    linears = [engine.backend.lm_head] + [w for layer in engine.backend.layers for w in layer.values()
                                          if isinstance(w, CpuLinear)]
    assert {w.act for w in linears} == {1}  # (the embedded SmolLM2: every matrix Q4_1 or Q8_0, laid out for int8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cpu-activations", "int4"])
    with pytest.raises(ValueError, match="--cpu-activations must be one of int8, int16, not 'int4'"):
        CpuBackend(engine.model.config, engine.model.model_weights(), threads=1, activations="int4")
