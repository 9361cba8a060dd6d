"""Quantized checkpoints (engine/quantization): FP8 e4m3 against ml_dtypes' float8
(the reference implementation JAX uses), each INT4 layout unpacked against a plain
per-element reading of its documented packing, checkpoints written and read back by the
compressed-tensors library itself (tests/golden/make_quantized_fixtures.py) and by
GPTQModel (AWQ and GPTQ: tests/golden/make_int4_fixtures.py), a tiny
model written in each format and served by the numpy backend, and the errors for
formats llamastream does not serve."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from devtools.quantized import FORMATS, write_quantized
from engine.backends import create_backend
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import load_model
from engine.quantization.fp8 import E4M3, Fp8Weight, e4m3_to_f32, f32_to_e4m3
from engine.quantization.int4 import AWQ_ORDER, Int4Weight, from_awq, from_gptq, from_pack_quantized, pack_int32
from engine.quantization.int4 import _AWQ_SHIFTS
from engine.sampling_params import SamplingParams
from engine.weights import is_layer_matrix
from tests.conftest import TINY_MODEL, run, tokens

RNG = np.random.default_rng(0)


def test_e4m3_values_are_ml_dtypes_float8_e4m3fn():
    reference = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(E4M3, reference, equal_nan=True)


def test_rounding_to_e4m3_is_ml_dtypes_rounding():
    x = np.concatenate([RNG.standard_normal(20000) * s for s in (1e-3, 0.1, 1, 30, 300)]).astype(np.float32)
    x = x[np.abs(x) <= 448]
    ours = e4m3_to_f32(f32_to_e4m3(x))
    reference = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    # (both round to nearest; they may differ only at exact ties, which random floats never hit)
    assert np.array_equal(ours, reference)


def test_fp8_per_channel_quantization_keeps_each_row_within_its_step():
    w = RNG.standard_normal((64, 256)).astype(np.float32)
    q = Fp8Weight.quantize(w)
    assert q.codes.dtype == np.uint8 and q.scale.shape == (64, 1)
    assert np.allclose(np.abs(q.float32()).max(axis=1), np.abs(w).max(axis=1), rtol=1e-6)  # the row's maximum is exact
    assert np.all(np.abs(q.float32() - w) <= np.abs(w) * 2 ** -4 + q.scale * 2 ** -9)  # half a step of 3 mantissa bits


def test_fp8_block_scales_cover_each_block():
    bits = f32_to_e4m3(RNG.standard_normal((200, 300)).astype(np.float32))
    scale = RNG.uniform(0.5, 2, (2, 3)).astype(np.float32)
    w = Fp8Weight(bits, scale, (128, 128)).float32()
    assert np.array_equal(w[:128, :128], E4M3[bits[:128, :128]] * scale[0, 0])
    assert np.array_equal(w[128:, 256:], E4M3[bits[128:, 256:]] * scale[1, 2])


def random_int4(out: int, columns: int, group: int):
    q = RNG.integers(0, 16, (out, columns)).astype(np.uint8)
    zero = RNG.integers(0, 16, (out, columns // group)).astype(np.uint8)
    scale = RNG.uniform(0.01, 0.1, (out, columns // group)).astype(np.float32)
    return q, zero, scale


def reference(q, zero, scale, group_of) -> np.ndarray:
    """w[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)], one element at a time."""
    w = np.empty(q.shape, np.float32)
    for o in range(q.shape[0]):
        for i in range(q.shape[1]):
            g = group_of[i]
            w[o, i] = (float(q[o, i]) - float(zero[o, g])) * float(np.float16(scale[o, g]))
    return w


def test_awq_words_hold_columns_in_awqs_interleaved_order():
    """AutoAWQ packs output columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7."""
    q, zero, scale = random_int4(16, 32, 8)
    qweight = np.zeros((32, 2), np.uint32)
    for i in range(32):
        for word in range(2):
            for nibble, column in enumerate(AWQ_ORDER):
                qweight[i, word] |= np.uint32(q[word * 8 + column, i]) << np.uint32(4 * nibble)
    qzeros = pack_int32(zero.T, axis=1, shifts=_AWQ_SHIFTS)
    got = from_awq(qweight.view(np.int32), qzeros, scale.T.astype(np.float16), 8)
    assert np.array_equal(got.float32(), reference(q, zero, scale, np.arange(32) // 8))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v1", [True, False], ids=["gptq", "gptq_v2"])
def test_gptq_words_hold_input_rows_in_order(act_order, v1):
    q, zero, scale = random_int4(16, 32, 8)
    zero = np.maximum(zero, 1)  # (the original format stores zero - 1)
    group_of = RNG.permutation(np.arange(32) // 8).astype(np.int32) if act_order else np.arange(32) // 8
    qweight = np.zeros((4, 16), np.uint32)
    for i in range(32):
        qweight[i // 8] |= q[:, i].astype(np.uint32) << np.uint32(4 * (i % 8))
    stored_zero = zero.T - 1 if v1 else zero.T
    got = from_gptq(qweight.view(np.int32), pack_int32(stored_zero, axis=1), scale.T.astype(np.float16),
                    group_of if act_order else None, 8, zeros_minus_one=v1)
    assert np.array_equal(got.float32(), reference(q, zero, scale, group_of))


def test_pack_quantized_symmetric_is_offset_by_eight():
    q, _, scale = random_int4(16, 32, 8)
    packed = np.zeros((16, 4), np.uint32)
    for i in range(32):
        packed[:, i // 8] |= q[:, i].astype(np.uint32) << np.uint32(4 * (i % 8))
    got = from_pack_quantized(packed.view(np.int32), scale.astype(np.float16).astype(np.float32), None, (16, 32), 8)
    assert np.array_equal(got.float32(), reference(q, np.full((16, 4), 8), scale, np.arange(32) // 8))


def numpy_engine(model, kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(model, create_backend("numpy", model.config, model.model_weights(), kv_cache_dtype=kv_cache_dtype),
                     EngineConfig(num_kv_blocks=64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_round_trips_and_serves_close_to_its_source(fmt, tmp_path):
    """Each format written (devtools/quantized.py: the layouts of AutoAWQ, GPTQ v1,
    compressed-tensors and Hugging Face's fp8), read back exactly as written (an
    FP8-dynamic checkpoint's weights marked so), within its rounding of the source, and
    served by the numpy backend."""
    written = write_quantized(TINY_MODEL, tmp_path / fmt, fmt, group=16)
    source, quantized = load_model(TINY_MODEL), load_model(tmp_path / fmt)
    assert len(written) == 14 and quantized.weight_format == ("fp8" if fmt.startswith("fp8") else "int4")
    for name, q in written.items():
        ours, w = quantized.weights[name], source.weights[name].float32()
        assert type(ours) is type(q) and np.array_equal(ours.float32(), q.float32()), name
        assert getattr(ours, "dynamic_activations", False) == (fmt == "fp8-dynamic"), name
        assert ours.nbytes < w.nbytes / (3 if fmt.startswith("fp8") else 6)
        # within a step of its group (INT4), or e4m3's rounding: 3 mantissa bits, subnormals below 2^-6 of a scale
        bound = q.scale[:, q.group] if isinstance(q, Int4Weight) else np.abs(w) / 16 + 3e-6 * np.abs(w).max()
        assert (np.abs(ours.float32() - w) <= bound + 1e-7).all(), name
    engine = numpy_engine(quantized)
    outs = run(engine, [engine.make_sequence("q", [1, 5, 9, 42, 7, 300, 12], SamplingParams(temperature=0.0, max_tokens=8,
                                                                                             ignore_eos=True))])
    assert len(tokens(outs["q"])) == 8


def test_formats_llamastream_does_not_serve_are_named(tmp_path):
    shutil.copytree(TINY_MODEL, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    for quantization, says in [({"quant_method": "bitsandbytes"}, "'bitsandbytes', which llamastream does not serve"),
                               ({"quant_method": "awq", "version": "gemv"}, "AWQ gemv"),
                               ({"quant_method": "gptq", "bits": 8}, "GPTQ with 8 bits"),
                               ({"quant_method": "compressed-tensors", "format": "sparse-bitmask"}, "'sparse-bitmask'")]:
        (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
        with pytest.raises(ValueError, match=says):
            load_model(tmp_path / "m")


def test_a_config_that_does_not_match_its_tensors_names_the_tensor(tmp_path):
    write_quantized(TINY_MODEL, tmp_path / "awq", "awq", group=16)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"]["q_group_size"] = 8  # the scales say 16
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.\S+: its packed weights"):
        load_model(tmp_path / "awq")


def shrunk_kv_checkpoint(path, factor: float, scales: dict[str, float] | None) -> None:
    """The tiny Llama with its K and V projections times `factor` and its Q and O ones
    over it (a power of two: the same model, to the bit, with K and V `factor` as
    large), and, if given, each layer's calibrated KV-cache scales under the given names
    (compressed-tensors' or ModelOpt's), in a file of their own."""
    shutil.copytree(TINY_MODEL, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in tensors:
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * np.float32(factor)
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / np.float32(factor)
    save_file(tensors, str(path / "model.safetensors"))
    if scales:
        save_file({f"model.layers.{i}.{name}": np.array(scale, np.float32) for i in range(2)
                   for name, scale in scales.items()}, str(path / "kv_scales.safetensors"))


@pytest.mark.parametrize("names", [("self_attn.k_scale", "self_attn.v_scale"),
                                   ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")],
                         ids=["compressed-tensors", "modelopt"])
def test_calibrated_kv_scales_cache_small_keys_and_values_as_the_unscaled_model(tmp_path, names):
    """The tiny Llama with K and V 2^-10 as large (shrunk_kv_checkpoint: the same model)
    and scales of 2^-10 caches, with an FP8 cache, the codes the tiny Llama caches with
    a scale of 1, and gives its logits, to the bit; without the scales most of its K and
    V fall below e4m3's smallest steps, and its logits move far further from the
    float32 cache's."""
    factor = 2.0 ** -10
    shrunk_kv_checkpoint(tmp_path / "scaled", factor, dict(zip(names, (factor, factor))))
    shrunk_kv_checkpoint(tmp_path / "unscaled", factor, None)
    scaled, unscaled, source = load_model(tmp_path / "scaled"), load_model(tmp_path / "unscaled"), load_model(TINY_MODEL)
    assert [(s.k, s.v) for s in scaled.model_weights().kv_scales] == [(factor, factor)] * 2
    ids = [1, 5, 9, 42, 7, 300, 12, 88, 4, 19, 250, 3]
    exact, _ = prompt_logits(numpy_engine(source), ids)
    assert np.array_equal(prompt_logits(numpy_engine(scaled), ids)[0], exact)  # (the same model)
    results = {}
    for name, model in (("source", source), ("scaled", scaled), ("unscaled", unscaled)):
        engine = numpy_engine(model, "fp8")
        logits, slots = prompt_logits(engine, ids)
        results[name] = logits, [(k[slots], v[slots]) for k, v in zip(engine.backend.k_cache, engine.backend.v_cache)]
    assert np.array_equal(results["scaled"][0], results["source"][0])
    for (k, v), (k_source, v_source) in zip(results["scaled"][1], results["source"][1]):
        assert np.array_equal(k, k_source) and np.array_equal(v, v_source)
    error = {name: np.linalg.norm(logits - exact) / np.linalg.norm(exact) for name, (logits, _) in results.items()}
    assert error["unscaled"] > 5 * error["source"], error


def test_kv_scales_that_are_not_one_positive_number_a_layer_name_the_tensor(tmp_path):
    shrunk_kv_checkpoint(tmp_path / "m", 1.0, {"self_attn.k_scale": -1.0, "self_attn.v_scale": 1.0})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale is not one positive number"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "kv_scales.safetensors").unlink()
    save_file({"model.layers.0.self_attn.k_scale": np.array(0.5, np.float32)}, str(tmp_path / "m" / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match=r"not model\.layers\.0\.self_attn\.v_scale"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("block", [[8, 8], [256, 256]])
def test_fp8_scales_that_do_not_match_the_block_size_name_the_tensor(tmp_path, block):
    write_quantized(TINY_MODEL, tmp_path / "fp8", "fp8-block")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = block  # (the scales are of 128 x 128 blocks)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"model\.layers\.\d+\.\S+: its FP8 codes \(\d+ x \d+\) and scales "
                                         rf"\(\d+, \d+\) do not agree .* {block[0]} x {block[1]} block"):
        load_model(tmp_path / "fp8")


def test_quantizing_the_head_too_quantizes_the_head_or_the_embedding_tied_to_it():
    untied = load_model(TINY_MODEL, quantization="fp8", quantize_lm_head=True)
    assert isinstance(untied.weights["lm_head.weight"], Fp8Weight)
    assert not isinstance(untied.weights["model.embed_tokens.weight"], Fp8Weight)
    tied = load_model(None, quantization="fp8", quantize_lm_head=True)  # (the embedded GGUF's Q4_1, requantized)
    assert tied.config.tie_word_embeddings and isinstance(tied.weights["model.embed_tokens.weight"], Fp8Weight)
    with pytest.raises(ValueError, match="give --quantization too"):
        load_model(TINY_MODEL, quantize_lm_head=True)


def test_quantizing_a_quantized_checkpoint_again_is_refused(tmp_path):
    write_quantized(TINY_MODEL, tmp_path / "awq", "awq", group=16)
    with pytest.raises(ValueError, match=r"is quantized already \(the checkpoint is\): leave --quantization out"):
        load_model(tmp_path / "awq", quantization="fp8")


def test_quantizing_at_load_to_fp8_keeps_the_head_and_serves():
    model = load_model(TINY_MODEL, quantization="fp8")
    layers = [t for n, t in model.weights.items() if is_layer_matrix(n, t)]
    assert layers and all(isinstance(t, Fp8Weight) for t in layers)
    assert not isinstance(model.weights["model.embed_tokens.weight"], Fp8Weight)
    engine = numpy_engine(model)
    outs = run(engine, [engine.make_sequence("q", [1, 5, 9], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    assert len(tokens(outs["q"])) == 4


COMPRESSED_TENSORS = ["w4a16-asym", "w4a16-sym", "fp8-channel", "fp8-tensor"]


def prompt_logits(engine: LLMEngine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The backend's logits at every position of one prompt, and the cache slots it wrote."""
    from engine.scheduler import ScheduledSeq

    seq = engine.make_sequence("p", ids, SamplingParams(max_tokens=1))
    engine.block_manager.allocate(seq, len(ids))
    logits = engine.backend.forward([ScheduledSeq(seq, 0, len(ids))], every_token=True)
    slots = np.array([engine.block_manager.slot(seq, i) for i in range(len(ids))])
    engine.block_manager.free(seq, keep_cached=False)
    return logits, slots


def assert_reads_as_golden(model, golden, scheme: str, kind: type, rtol: float = 1e-6) -> None:
    """Every layer matrix of `model` equals the golden file's dequantization of it (to
    `rtol`), and the numpy backend's logits of its prompts its logits."""
    names = [k.split("/", 1)[1] for k in golden.files if k.startswith(f"{scheme}/model.")]
    assert len(names) == 14
    for name in names:
        ours = model.weights[name]
        assert isinstance(ours, kind), name
        np.testing.assert_allclose(ours.float32(), golden[f"{scheme}/{name}"], rtol=rtol, atol=rtol / 10, err_msg=name)
    for i in range(3):
        logits, _ = prompt_logits(numpy_engine(model), golden[f"ids{i}"].tolist())
        assert np.abs(logits - golden[f"{scheme}/logits{i}"]).max() < 1e-4


@pytest.mark.parametrize("scheme", COMPRESSED_TENSORS)
def test_compressed_tensors_checkpoints_read_as_the_library_decompresses_them(scheme):
    """compressed-tensors wrote these checkpoints (asymmetric INT4 groups with packed
    zero points, symmetric INT4, FP8 per row and per tensor) and decompressed them in
    transformers: our weights are its weights, and our logits its model's."""
    model = load_model(TINY_MODEL.parent / f"tiny-llama-{scheme}")
    assert model.weight_format == scheme.split("-")[0].replace("w4a16", "int4")
    assert_reads_as_golden(model, np.load(TINY_MODEL.parent / "tiny_llama_quantized_golden.npz"), scheme,
                           Int4Weight if scheme.startswith("w4") else Fp8Weight)


@pytest.mark.parametrize("scheme", ["gptq-act-order", "gptq-sym", "awq"])
def test_gptq_and_awq_checkpoints_read_as_gptqmodel_dequantizes_them(scheme):
    """GPTQModel quantized, wrote and read back these checkpoints (GPTQ with act-order
    and asymmetric groups in the original format, GPTQ symmetric, AWQ's GEMM layout;
    tests/golden/make_int4_fixtures.py): our weights are its dequantized weights, to the
    bit, and our logits those of transformers' float32 model holding them."""
    model = load_model(TINY_MODEL.parent / f"tiny-llama-{scheme}")
    assert model.weight_format == "int4"
    assert_reads_as_golden(model, np.load(TINY_MODEL.parent / "tiny_llama_int4_golden.npz"), scheme, Int4Weight, rtol=0)


def perplexity(engine: LLMEngine, text: str) -> float:
    """exp of the mean negative log-likelihood of each token of `text` given those before."""
    from engine.sampler import log_softmax

    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    logits, _ = prompt_logits(engine, ids)
    nll = [-log_softmax(logits[i].astype(np.float64))[ids[i + 1]] for i in range(len(ids) - 1)]
    return float(np.exp(np.mean(nll)))


def question(engine: LLMEngine) -> list[int]:
    t = engine.tokenizer
    return t.encode(t.render_chat([{"role": "user", "content": "What is the capital of France?"}]))


def answer(engine: LLMEngine) -> str:
    outs = run(engine, [engine.make_sequence("a", question(engine), SamplingParams(temperature=0.0, max_tokens=12))])
    return engine.tokenizer.decode(tokens(outs["a"]), skip_special_tokens=True)


def first_choices(engine: LLMEngine, k: int) -> list[int]:
    """The k likeliest first tokens of the answer."""
    return np.argsort(-prompt_logits(engine, question(engine))[0][-1])[:k].tolist()


def test_smollm2_quantized_still_answers_paris_and_its_perplexity_is_reported(tmp_path):
    """Real weights: the embedded SmolLM2 as shipped (its Q4_1 GGUF, dequantized), in
    FP8 (quantized at load; and with its head, the tied embedding, too; and written as
    compressed-tensors' per-row and Hugging Face's 128 x 128-block checkpoints), in INT4
    (written as AWQ, GPTQ and compressed-tensors pack-quantized checkpoints, groups of
    64), and as shipped with an FP8 KV cache."""
    from engine.model_loader import convert_gguf, embedded_model_path

    text = (TINY_MODEL.parent / "perplexity.txt").read_text()
    hf_dir = convert_gguf(embedded_model_path(), tmp_path / "smollm2")
    written = {"int4 (awq)": "awq", "int4 (gptq)": "gptq", "int4 (pack-quantized)": "pack-quantized",
               "fp8 (compressed-tensors)": "fp8-channel", "fp8 (128 x 128 blocks)": "fp8-block"}
    for fmt in written.values():
        write_quantized(hf_dir, tmp_path / fmt, fmt, group=64)
    shipped = load_model(hf_dir)
    engines = {"as shipped": numpy_engine(shipped), "fp8": numpy_engine(load_model(hf_dir, quantization="fp8")),
               "fp8 with its head": numpy_engine(load_model(hf_dir, quantization="fp8", quantize_lm_head=True)),
               **{name: numpy_engine(load_model(tmp_path / fmt)) for name, fmt in written.items()},
               "fp8 KV cache": numpy_engine(shipped, kv_cache_dtype="fp8")}
    figures = {name: perplexity(engine, text) for name, engine in engines.items()}
    print("\nSmolLM2-135M perplexity on tests/fixtures/perplexity.txt: "
          + ", ".join(f"{name} {ppl:.2f}" for name, ppl in figures.items()))
    # The first answer token is a near tie as shipped ("The" 0.152, "L" 0.140); the FP8
    # head turns it ("L" 0.183, "The" 0.171), and that answer is "L'Étoile, la Cité...":
    # there the same two lead, swapped
    for name, engine in engines.items():
        if name == "fp8 with its head":
            assert first_choices(engine, 2)[::-1] == first_choices(engines["as shipped"], 2)
        else:
            assert "Paris" in answer(engine), name
    for name, ppl in figures.items():
        assert ppl < (1.3 if name.startswith("int4") else 1.05) * figures["as shipped"], name

def test_an_fp8_kv_cache_holds_e4m3_of_what_float32_holds_and_serves_close_to_it():
    """--kv-cache-dtype fp8 on the numpy backend (the reference for the GPU's kernels):
    the first layer's cached K and V are exactly the e4m3 rounding of the float32
    cache's, a block takes a quarter of the bytes, and the logits stay close."""
    model = load_model(TINY_MODEL)
    engines = {dtype: numpy_engine(model, dtype) for dtype in ("auto", "fp8")}
    f32, fp8 = engines["auto"].backend, engines["fp8"].backend
    assert fp8.kv_cache_dtype == "fp8_e4m3" and engines["fp8"].info.kv_cache_dtype == "fp8_e4m3"
    assert fp8.kv_cache_bytes_per_block(16) * 4 == f32.kv_cache_bytes_per_block(16)
    ids = [0, 17, 93, 250, 4, 11] + list(range(100, 140))
    (exact, slots), (rounded, fp8_slots) = prompt_logits(engines["auto"], ids), prompt_logits(engines["fp8"], ids)
    for f32_cache, fp8_cache in ((f32.k_cache, fp8.k_cache), (f32.v_cache, fp8.v_cache)):
        stored = fp8_cache[0][fp8_slots]
        assert stored.dtype == np.uint8 and np.array_equal(stored, f32_to_e4m3(f32_cache[0][slots]))
    error = np.linalg.norm(rounded - exact) / np.linalg.norm(exact)
    assert error < 0.06  # (measured 4.2e-2: e4m3 keeps 3 mantissa bits; real weights: the SmolLM2 test above)
