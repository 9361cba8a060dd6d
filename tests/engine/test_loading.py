"""Model loading: sharded and bfloat16 safetensors, GGUF conversion, clear errors."""

from __future__ import annotations

import json
import shutil
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.model_loader import embedded_model_path, load_config, load_model
from engine.models import UnsupportedModel
from engine.weights import unpermute_qk
from tests.conftest import TINY_MODEL, TINY_QWEN3
from tests.serving import ROOT

GOLDEN = json.loads((TINY_MODEL.parent / "tokenizer_golden.json").read_text())


def copy_without_weights(dst):
    shutil.copytree(TINY_MODEL, dst, ignore=shutil.ignore_patterns("*.safetensors"))


def test_sharded_safetensors_load_like_one_file(tmp_path, tiny_model):
    copy_without_weights(tmp_path / "m")
    tensors = load_file(TINY_MODEL / "model.safetensors")
    names = sorted(tensors)
    index = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / "m" / file))
        index.update({n: file for n in part})
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    sharded = load_model(tmp_path / "m")
    assert sharded.weights.keys() == tiny_model.weights.keys()
    assert all(np.array_equal(sharded.weights[k].float32(), tiny_model.weights[k].float32()) for k in names)


def write_bf16_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """bfloat16 safetensors, written by hand (numpy has no bfloat16 type)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        bits = (t.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(bits)]}
        blobs.append(bits)
        offset += len(bits)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def test_bfloat16_safetensors_keep_their_format_and_widen_exactly(tmp_path):
    copy_without_weights(tmp_path / "m")
    tensors = load_file(TINY_MODEL / "model.safetensors")
    write_bf16_safetensors(tmp_path / "m" / "model.safetensors", tensors)
    loaded = load_model(tmp_path / "m")
    for name, t in tensors.items():
        truncated = ((t.view(np.uint32) >> 16) << 16).view(np.float32)
        assert loaded.weights[name].format == "bf16"
        assert np.array_equal(loaded.weights[name].float32(), truncated), name
        assert np.array_equal(loaded.weights[name].bf16_bits(), (t.view(np.uint32) >> 16).astype(np.uint16)), name


def test_unpermute_inverts_llama_cpp_permutation():
    def llama_cpp_permute(w, n_head):  # as in llama.cpp's convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_convert_gguf_writes_an_equivalent_hf_directory(tmp_path, smollm2):
    out = tmp_path / "smollm2-hf"
    done = subprocess.run([sys.executable, "-m", "server", "convert-gguf", str(embedded_model_path()), str(out)],
                          cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    # (stderr is no terminal here: the progress is one record at the end, not a bar)
    assert re.search(r"INFO llamastream.server: converting: (\d+) of \1 done", done.stderr), done.stderr
    converted = load_model(out)
    assert converted.config == smollm2.config
    assert all(np.array_equal(converted.weights[k].float32(), v.float32()) for k, v in smollm2.weights.items())
    for case in GOLDEN["smollm2"]["encode"]:
        assert converted.tokenizer.encode(case["text"]) == case["ids"]
    for case in GOLDEN["smollm2"]["chat"]:
        assert converted.tokenizer.encode_chat(case["messages"], case["add_generation_prompt"])[0] == case["ids"]
    assert converted.tokenizer.eos_token_ids == smollm2.tokenizer.eos_token_ids


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "config.json"),
    (lambda p: p.write_text("x"), "neither"),
])
def test_bad_model_paths_say_what_is_wrong(tmp_path, setup, message):
    path = tmp_path / "model"
    setup(path)
    for load in (load_model, load_config):
        with pytest.raises((FileNotFoundError, ValueError), match=message):
            load(path)


@pytest.mark.parametrize("path", [TINY_MODEL, TINY_QWEN3, None])
def test_the_config_alone_is_the_loaded_models(path, request):
    loaded = request.getfixturevalue("smollm2") if path is None else load_model(path)
    assert load_config(path) == loaded.config


def test_unsupported_models_are_refused_naming_the_supported_ones(tmp_path):
    copy_without_weights(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=r"model_type 'gpt2'.*serves llama \(LlamaForCausalLM\), qwen3 \(Qwen3ForCausalLM\)"):
        load_model(tmp_path / "m")


def test_gguf_block_weights_stay_as_stored_and_dequantize_as_the_gguf_package_does():
    """The embedded model's Q4_1 and Q8_0 matrices are kept as their blocks (the model
    says q4_1 and q8_0), and read back, rows unpermuted and projections fused, as the
    gguf package dequantizes the file."""
    from gguf import GGUFReader, dequantize

    from engine.quantization.gguf import GgufWeight
    from engine.weights import unpermute_qk

    model = load_model(embedded_model_path())
    assert model.weight_format == "q4_1"
    tensors = {t.name: t for t in GGUFReader(str(embedded_model_path())).tensors}
    for gguf_name, name, heads in [("token_embd.weight", "model.embed_tokens.weight", None),
                                   ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight", None),
                                   ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", model.config.num_heads)]:
        t = tensors[gguf_name]
        expected = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape([int(d) for d in reversed(t.shape)])
        if heads:
            expected = unpermute_qk(expected, heads)
        ours = model.weights[name]
        assert isinstance(ours, GgufWeight) and ours.nbytes == t.n_bytes
        assert np.array_equal(ours.float32(), expected), name
    qkv = model.model_weights().layers[3]["qkv"]
    assert isinstance(qkv, GgufWeight) and qkv.shape == (model.config.q_size + 2 * model.config.kv_size,
                                                         model.config.hidden_size)
